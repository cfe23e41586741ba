"""Verification gates: run the original and the rewritten module on the same real inputs; refuse beyond tolerance.

Not a pass (it runs modules, not graph rewrites). Three gates: :func:`verify_logits` for modules with the
``(input_ids, attention_mask) -> logits`` signature (canonical), :func:`verify_decode` for the SpeContext module's
prefill and decode steps, and :func:`verify_packed` for the DualKV module
(per-sequence log-probs and every parameter gradient against the original model on the replicated batch,
:func:`check_exactness`; its one-level program on a :class:`~kvtransform.packing.PackedBatch` and its prefix-tree
program on a :class:`~kvtransform.tree_packing.TreeBatch`). :func:`check_numerics_rule` checks the DualKV module against
a float64 run of the original, per tensor (the project's numerics rule; the real-model tests use it). Both batch kinds
go through the same code: :func:`scored_sequences` (what the original runs), :func:`packed_logprobs` (what the packed
module's logits give) and :func:`loss_masks` are the only places that tell them apart (all in
:mod:`kvtransform.exactness`, re-exported here).

Inputs are tokenised text shipped with the package (``kvtransform/data/prompts.txt``) at several lengths, as one
unpadded row and left-padded rows (so the attention mask's padding path is exercised); without a tokenizer, random
token ids. Logits are compared on real (non-padding) positions only: what a padded position computes is undefined.
"""
from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Callable, Optional

import torch

from kvtransform.config import DualKVConfig, TransformConfig, VerifyConfig
from kvtransform.exactness import (Batch, check_exactness, check_numerics_rule, loss_masks, num_sequences,
                                   packed_logprobs, replicated_logprobs, scored_sequences, trainable_parameters)
from kvtransform.packing import PackedBatch, pack_shared_prefix_groups
from kvtransform.tree_packing import TreeBatch, pack_trajectories
from kvtransform.report import Report, Verification
from kvtransform.utils import stage, timed

__all__ = ["VerificationError", "verify", "check", "default_tolerance", "verify_logits", "verify_packed",
           "verify_decode", "sample_text", "text_token_ids", "verification_cases",
           # kvtransform.exactness, re-exported (kvtransform.verify.check_numerics_rule is the documented name)
           "Batch", "check_exactness", "check_numerics_rule", "loss_masks", "num_sequences", "packed_logprobs",
           "replicated_logprobs", "scored_sequences", "trainable_parameters"]


class VerificationError(RuntimeError):
    """The rewritten module differs from the original beyond tolerance; nothing was written."""


# bf16 keeps 8 mantissa bits (fp16: 11): SmolLM2-135M's rewritten logits differ from the original bf16 model's by
# max_rel 2.8e-2 (both computed in bf16, different summation order), so its default is wider than fp16's.
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def sample_text() -> str:
    """The real text shipped with the package (several short prompts, one per line)."""
    return resources.files("kvtransform").joinpath("data/prompts.txt").read_text(encoding="utf-8")


def text_token_ids(tokenizer, vocab_size: int, n: int, offset: int = 0, generator=None) -> torch.Tensor:
    """``n`` token ids (int64) of the shipped text, starting ``offset`` tokens in (wrapping); random ids when
    ``tokenizer`` is None."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (n,), generator=generator)
    ids = tokenizer(sample_text(), add_special_tokens=False)["input_ids"]
    ids = [i for i in ids if i < vocab_size]
    reps = (offset + n) // max(len(ids), 1) + 1
    return torch.tensor((ids * reps)[offset:offset + n], dtype=torch.long)


def _input_kind(tokenizer, noun: str) -> str:
    """How the progress line names the verification inputs: ``real <noun>`` (tokenised text) or, without a
    tokenizer, ``<noun> of random token ids (no tokenizer)``."""
    return f"real {noun}" if tokenizer is not None else f"{noun} of random token ids (no tokenizer)"


def verification_cases(cfg: VerifyConfig, tokenizer, vocab_size: int, device) -> list[tuple[str, torch.Tensor,
                                                                                               torch.Tensor]]:
    """``[(name, input_ids (B, S), attention_mask (B, S))]`` for each configured length."""
    gen = torch.Generator().manual_seed(cfg.seed)
    cases = []
    for s in cfg.lengths:
        s = int(s)
        if s < 2:
            raise ValueError(f"verify.lengths must be >= 2 tokens, got {s}")
        rows = [text_token_ids(tokenizer, vocab_size, s, offset=17 * r, generator=gen) for r in range(cfg.batch_size)]
        ids = torch.stack(rows)
        am = torch.ones_like(ids)
        cases.append((f"len{s}", ids.to(device), am.to(device)))
        if cfg.padding and cfg.batch_size > 1:
            am = torch.ones_like(ids)
            for r in range(1, cfg.batch_size):
                pad = max(1, (s * r) // (2 * cfg.batch_size))
                am[r, :pad] = 0
            cases.append((f"len{s}-leftpad", ids.to(device), am.to(device)))
    return cases


@torch.no_grad()
def verify(original: Callable, rewritten: Callable, cases, tolerance: float) -> Verification:
    """Compare ``original(ids, am)`` and ``rewritten(ids, am)`` logits on real positions of every case.

    Returns a :class:`~kvtransform.report.Verification`; ``passed`` is False when ``max_rel_error`` (max abs error
    over max abs reference) exceeds ``tolerance`` or anything is NaN. Does not raise: :func:`check` does.
    """
    v = Verification(max_abs_error=0.0, max_rel_error=0.0, tolerance=float(tolerance), passed=True)
    for name, ids, am in cases:
        ref = original(ids, am).float()
        out = rewritten(ids, am).float()
        keep = am.bool()
        diff = (ref - out)[keep].abs()
        abs_err = float(diff.max()) if diff.numel() else 0.0
        if torch.isnan(out[keep]).any() or torch.isnan(ref[keep]).any():
            abs_err = float("nan")
        scale = float(ref[keep].abs().max()) if keep.any() else 1.0
        rel_err = abs_err / max(scale, 1e-30)
        v.cases.append({"name": name, "shape": list(ids.shape), "max_abs_error": abs_err, "max_rel_error": rel_err})
        v.max_abs_error = max(v.max_abs_error, abs_err) if abs_err == abs_err else float("nan")
        v.max_rel_error = max(v.max_rel_error, rel_err) if rel_err == rel_err else float("nan")
    v.passed = bool(v.max_rel_error == v.max_rel_error and v.max_rel_error <= tolerance)
    return v


def check(v: Verification, failed: Optional[tuple] = None) -> None:
    """Raise :class:`VerificationError` if ``v`` did not pass, naming the case, its tolerance and its config key:
    ``failed`` = ``(case, tolerance, key)``, default the worst case, ``v.tolerance``, ``transform.verify.tolerance``."""
    if v.passed is False:
        if failed is None:
            worst = max(v.cases, key=lambda c: (c["max_rel_error"] != c["max_rel_error"], c["max_rel_error"]))
            failed = (worst, v.tolerance, "transform.verify.tolerance")
        case, tol, key = failed
        raise VerificationError(
            f"verification failed: max_rel_error={case['max_rel_error']:.3g} > tolerance={tol:.3g} "
            f"(case {case['name']}, shape {case['shape']}). Nothing was written. If the difference is "
            f"expected for this dtype, raise {key}; otherwise report the model and config.")


def default_tolerance(dtype: torch.dtype, configured: Optional[float]) -> float:
    return float(configured) if configured is not None else DEFAULT_TOLERANCE.get(dtype, 2e-2)


def verify_logits(model, opt, cfg: TransformConfig, tokenizer, report: Report, progress: bool) -> None:
    """The gate for modules with the ``(input_ids, attention_mask) -> logits`` signature: both modules on
    :func:`verification_cases` (lengths beyond ``opt.max_seq_len`` are verified at ``opt.max_seq_len``, noted in
    the report); fills ``report.verification``.

    Raises:
        VerificationError: beyond tolerance (nothing is written).
    """
    if not cfg.verify.enabled:
        return
    param = next(model.parameters())
    vcfg = cfg.verify
    too_long = [n for n in vcfg.lengths if n > opt.max_seq_len]
    if too_long:  # verify at the longest length the module accepts instead
        vcfg = dataclasses.replace(vcfg, lengths=sorted({min(n, opt.max_seq_len) for n in vcfg.lengths}))
        if report.pass_record("attention"):
            report.pass_record("attention").notes.append(
                f"verify lengths {too_long} exceed the model's {opt.max_seq_len} positions; verified at "
                f"{opt.max_seq_len} instead")
    cases = verification_cases(vcfg, tokenizer, model.config.vocab_size, param.device)
    tol = default_tolerance(param.dtype, cfg.verify.tolerance)

    def original(ids, am):
        # The transformed module computes the model in eval mode (attention dropout off): compare with that.
        was_training = model.training
        model.eval()
        try:
            return model(input_ids=ids, attention_mask=am, use_cache=False).logits
        finally:
            model.train(was_training)

    with stage(progress, f"verifying on {len(cases)} {_input_kind(tokenizer, 'inputs')}"), \
            timed(report.timings, "verify"):
        report.verification = verify(original, opt, cases, tol)
    check(report.verification)


def _verify_batch(cfg: DualKVConfig, tokenizer, vocab: int, device) -> PackedBatch:
    """Packed batch of real text (the shipped prompts) in the shape of ``cfg.verify_groups``."""
    gen = torch.Generator().manual_seed(cfg.verify.seed)
    groups, off = [], 0
    for g in cfg.verify_groups:
        if not isinstance(g, (list, tuple)) or len(g) != 2:
            raise ValueError(f"verify_groups entries must be [prompt_len, [response_lens...]]; got {g!r}")
        p, rs = int(g[0]), [int(r) for r in g[1]]
        prompt = text_token_ids(tokenizer, vocab, p, offset=off, generator=gen)
        off += p + 7
        resp = []
        for r in rs:
            resp.append(text_token_ids(tokenizer, vocab, r, offset=off, generator=gen))
            off += r + 3
        groups.append((prompt, resp))
    return pack_shared_prefix_groups(groups, vocab_size=vocab, device=device)


def _verify_tree(batch: PackedBatch) -> TreeBatch:
    """A depth-3 prefix tree from the verification groups: per group ``prompt + first response + response_i`` for
    every other response, and ``prompt + last response`` (loss masks: the prompt's tokens off)."""
    seqs, masks = [], []
    for p, rs in batch.groups:
        for s in [torch.cat([p, rs[0], r]) for r in rs[1:]] + [torch.cat([p, rs[-1]])]:
            seqs.append(s)
            masks.append(torch.arange(s.numel()) >= p.numel())
    return pack_trajectories(seqs, loss_masks=masks, device=batch.device)


def verify_packed(model, opt, cfg: DualKVConfig, tokenizer, report: Report, progress: bool) -> None:
    """The dualkv transform's verification gate: log-probs (and gradients, ``cfg.verify_backward``) of the packed
    module vs the original model on the replicated ``cfg.verify_groups`` batch of real text; then, when ``opt``
    has a prefix-tree program (``opt.tree_core``), the same on a depth-3 tree of those sequences
    (:func:`_verify_tree`, loss masks on). Fills ``report.verification`` (tree cases named ``tree ...``) and raises
    :class:`VerificationError` beyond tolerance (the one-level program is checked, and refused, first).

    Enforced per program: per-sequence log-probs (max abs error / max |ref|) ``<= verify.tolerance`` (fp32 1e-4,
    bf16/fp16 2e-2 by default) and the gradient of ``Σ adv_i Σ mask · logprobs_i`` over all parameters (``‖g −
    g_ref‖₂ / ‖g_ref‖₂``) ``<= verify_grad_tolerance`` (fp32 1e-4, bf16/fp16 5e-2 by default), unless no parameter
    requires grad (a frozen reference model: log-probs only, said in the attention pass's notes).
    The worst single parameter's max relative error is recorded as an informational case."""
    if not cfg.verify.enabled:
        return
    param = next(model.parameters())
    tol = default_tolerance(param.dtype, cfg.verify.tolerance)
    gtol = cfg.verify_grad_tolerance
    if gtol is None:
        # float64: transformers' norms run in float32 even there; packed vs replicated gradients differ by ~5e-8
        gtol = {torch.float32: 1e-4, torch.float64: 1e-6}.get(param.dtype, 5e-2)
    backward = cfg.verify_backward and bool(trainable_parameters(model))
    if cfg.verify_backward and not backward and report.pass_record("attention"):  # a frozen reference model
        report.pass_record("attention").notes.append("no parameter of the model requires grad (a frozen reference "
                                                     "model): log-probs verified, gradients not")
    batch = _verify_batch(cfg, tokenizer, model.config.vocab_size, param.device)
    runs = [("", batch)] + ([("tree ", _verify_tree(batch))] if getattr(opt, "tree_core", None) is not None else [])
    v = Verification(tolerance=float(tol))
    enforced = []  # (case, its tolerance, the config key that sets it)
    for prefix, b in runs:
        n = num_sequences(b)
        adv = torch.randn(n, generator=torch.Generator().manual_seed(cfg.verify.seed))
        what = f"{n} trajectories as a tree" if prefix else f"{n} responses"
        with stage(progress, f"verifying exactness vs the replicated batch ({what}, {b.num_tokens} packed "
                             f"{_input_kind(tokenizer, 'tokens')})"), \
                timed(report.timings, "verify_tree" if prefix else "verify"):
            was_training = model.training
            model.eval()
            try:
                res = check_exactness(model, opt, b, adv, backward=backward)
            finally:
                model.train(was_training)
        shape = [1, b.num_tokens]
        enforced.append(({"name": f"{prefix}logprobs", "shape": shape, "max_abs_error": res["logprobs_abs"],
                          "max_rel_error": res["logprobs_rel"]}, tol, "transform.verify.tolerance"))
        v.cases.append(enforced[-1][0])
        if "grad_rel" in res:
            enforced.append(({"name": f"{prefix}grad, all {res['num_params']} parameters (L2; tolerance {gtol:g})",
                              "shape": shape, "max_abs_error": res["grad_abs"],
                              "max_rel_error": res["grad_global_rel"]}, gtol, "transform.verify_grad_tolerance"))
            v.cases.append(enforced[-1][0])
            # Per parameter (max abs / max |ref|) is reported, not enforced: its floor is the original model's own
            # summation-order noise (fp32, 30 layers: ~3e-5 between two ways of running the original itself).
            v.cases.append({"name": f"{prefix}grad, worst parameter {res['grad_worst']} (informational)",
                            "shape": shape, "max_abs_error": res["grad_abs"], "max_rel_error": res["grad_rel"]})
        v.max_abs_error = max(c["max_abs_error"] for c, _, _ in enforced)
        v.max_rel_error = max(c["max_rel_error"] for c, _, _ in enforced)
        failed = [(c, t, k) for c, t, k in enforced if not c["max_rel_error"] <= t]  # (NaN fails)
        bad = any(c["max_rel_error"] != c["max_rel_error"] for c in v.cases)
        v.passed = bool(not bad and not failed)
        report.verification = v
        check(v, failed[0] if failed else None)


def verify_decode(model, opt, cfg, tokenizer, report: Report, progress: bool, new_tokens: int = 3) -> None:
    """The gate: a ragged batch of real prompts (lengths ``cfg.verify.lengths``) through the packed prefill, then
    ``new_tokens`` teacher-forced decode steps selecting every cached token; logits compared with the original
    model on the same sequences (relative error ``max|a-b| / max|b|``); fills ``report.verification``.

    Raises:
        VerificationError: beyond tolerance (nothing is written).
    """
    from kvtransform.model_features import length_dependent_rope
    from kvtransform.runtime.heads import all_positions

    if not cfg.verify.enabled:
        return
    param = next(model.parameters())
    vocab = model.config.vocab_size
    lengths = [min(int(n), opt.max_seq_len - new_tokens) for n in cfg.verify.lengths]
    gen = torch.Generator().manual_seed(cfg.verify.seed)
    seqs = [text_token_ids(tokenizer, vocab, n + new_tokens, offset=17 * i, generator=gen)
            for i, n in enumerate(lengths)]
    tol = default_tolerance(param.dtype, cfg.verify.tolerance)
    v = Verification(max_abs_error=0.0, max_rel_error=0.0, tolerance=tol, passed=True)
    with stage(progress, f"verifying prefill + decode steps on {_input_kind(tokenizer, 'text')}"), \
            timed(report.timings, "verify"):
        rt = opt.runtime
        prompts = [s[:n] for s, n in zip(seqs, lengths)]
        # RoPE whose frequencies follow a call's longest row (LongRoPE, dynamic NTK) gives a short row of a ragged
        # batch other frequencies than the row alone, as in transformers' own batches: each length on its own then
        groups = ([[i] for i in range(len(prompts))] if length_dependent_rope(model)
                  else [list(range(len(prompts)))])
        runs = []  # the gather program (what decode.pt2 holds); also the slot-mode variant when the head uses it
        for slot in (False, True) if rt._slot_mode() else (False,):
            rows = [None] * len(prompts)  # per prompt: (new_tokens + 1, vocab)
            for group in groups:
                cache, logits = rt.prefill([prompts[i] for i in group], max(lengths[i] for i in group) + new_tokens,
                                           param.device)
                ours = [logits]
                for t in range(new_tokens):
                    tok = torch.stack([seqs[i][lengths[i] + t] for i in group]).to(param.device)
                    logits, _ = rt.decode(cache, tok, all_positions(cache), slot=slot)
                    ours.append(logits)
                for j, i in enumerate(group):
                    rows[i] = torch.stack(ours, 1)[j].float()
            runs.append(rows)
        was_training = model.training
        model.eval()
        try:
            for i, (s, n) in enumerate(zip(seqs, lengths)):
                with torch.no_grad():  # (no autograd graph of the reference: memory, and float() of a grad tensor)
                    ref = model(input_ids=s[None].to(param.device), use_cache=False).logits[0, n - 1:].float()
                abs_err = max(float((ours[i] - ref).abs().max()) for ours in runs)
                rel = abs_err / max(float(ref.abs().max()), 1e-30)
                v.cases.append({"name": f"len{n}+{new_tokens}", "shape": [1, n + new_tokens],
                                "max_abs_error": abs_err, "max_rel_error": rel})
                v.max_abs_error = max(v.max_abs_error, abs_err)
                v.max_rel_error = max(v.max_rel_error, rel)
        finally:
            model.train(was_training)
    v.passed = bool(v.max_rel_error == v.max_rel_error and v.max_rel_error <= tol)
    report.verification = v
    check(v)
