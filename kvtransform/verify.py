"""Verification gates: run the original and the rewritten module on the same real inputs; refuse beyond tolerance.

Not a pass (it runs modules, not graph rewrites). Two gates: :func:`verify_logits` for modules with the
``(input_ids, attention_mask) -> logits`` signature (canonical), and :func:`verify_packed` for the DualKV module
(per-sequence log-probs and every parameter gradient against the original model on the replicated batch,
:func:`check_exactness`; its one-level program on a :class:`~kvtransform.packing.PackedBatch` and its prefix-tree
program on a :class:`~kvtransform.tree_packing.TreeBatch`). :func:`check_numerics_rule` checks the DualKV module against
a float64 run of the original, per tensor (the project's numerics rule; the real-model tests use it). Both batch kinds
go through the same code: :func:`scored_sequences` (what the original runs), :func:`packed_logprobs` (what the packed
module's logits give) and :func:`loss_masks` are the only places that tell them apart.

Inputs are tokenised text shipped with the package (``kvtransform/data/prompts.txt``) at several lengths, as one
unpadded row and left-padded rows (so the attention mask's padding path is exercised); without a tokenizer, random
token ids. Logits are compared on real (non-padding) positions only: what a padded position computes is undefined.
"""
from __future__ import annotations

import dataclasses
import math
from importlib import resources
from typing import Any, Callable, Optional, Union

import torch

from kvtransform.config import DualKVConfig, TransformConfig, VerifyConfig
from kvtransform.packing import PackedBatch, pack_shared_prefix_groups
from kvtransform.tree_packing import TreeBatch, pack_trajectories
from kvtransform.report import Report, Verification
from kvtransform.utils import device_of, stage, timed


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


# ---------------------------------------------------------------------------------------------------------------------
# DualKV: exactness against the replicated batch
# ---------------------------------------------------------------------------------------------------------------------
def trainable_parameters(model) -> list:
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


Batch = Union[PackedBatch, TreeBatch]


def scored_sequences(batch: Batch) -> list:
    """Per sequence of ``batch`` (responses of a PackedBatch, trajectories of a TreeBatch, packing order) ``(ids
    (L,) int64 CPU, first)``: the whole sequence the original model runs, and the first position whose log-prob is
    scored (the response's first token; a trajectory's second token)."""
    if isinstance(batch, TreeBatch):
        return [(s, 1) for s in batch.sequences]
    return [(torch.cat([p, r]), p.numel()) for p, rs in batch.groups for r in rs]


def num_sequences(batch: Batch) -> int:
    return batch.num_trajectories if isinstance(batch, TreeBatch) else batch.num_responses


def packed_logprobs(batch: Batch, logits: torch.Tensor) -> list:
    """The packed logits ``(1, T, vocab)`` as per-sequence log-probs aligned with :func:`scored_sequences`."""
    return batch.trajectory_logprobs(logits) if isinstance(batch, TreeBatch) else batch.response_logprobs(logits)


def loss_masks(batch: Batch) -> Optional[list]:
    """Per sequence a bool mask over its scored log-probs (a TreeBatch built with loss masks), or None: all count."""
    if isinstance(batch, TreeBatch) and batch.loss_masks is not None:
        return batch.loss_mask_tensors()
    return None


def replicated_logprobs(model, batch: Batch, padded: bool = False) -> list:
    """Per-sequence log-probs from the *original* model run on the replicated batch (every sequence of
    :func:`scored_sequences` on its own): N separate forwards, or with ``padded`` one right-padded ``(N, max_len)``
    batch with an attention mask (what a trainer without packing runs). Differentiable; list of ``(L_i - first_i,)``
    (a PackedBatch: ``(R_i,)``; a TreeBatch: ``(len(seq_i) - 1,)``)."""
    dev = device_of(model)
    seqs = scored_sequences(batch)
    outs = []
    if padded:
        n, s = len(seqs), max(x.numel() for x, _ in seqs)
        ids = torch.zeros(n, s, dtype=torch.long)
        am = torch.zeros(n, s, dtype=torch.long)
        for i, (x, _) in enumerate(seqs):
            ids[i, :x.numel()] = x
            am[i, :x.numel()] = 1
        logits = model(input_ids=ids.to(dev), attention_mask=am.to(dev), use_cache=False).logits
        rows = [logits[i] for i in range(n)]
    else:
        rows = [model(input_ids=x[None].to(dev), use_cache=False).logits[0] for x, _ in seqs]
    for (x, p), lg in zip(seqs, rows):
        work = torch.float64 if lg.dtype == torch.float64 else torch.float32
        n = x.numel()
        lp = torch.log_softmax(lg[p - 1:n - 1].to(work), -1).gather(1, x[p:n].to(dev)[:, None])[:, 0]
        outs.append(lp)
    return outs


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    return err, err / scale if scale > 0 else err


def _loss_grads(lps: list, adv: torch.Tensor, params: list, masks: Optional[list] = None,
                packed: bool = False) -> list:
    """fp64 copies of the gradients of ``Σ_i adv_i · Σ_j mask_ij · lps_ij`` (no masks: all 1) for ``params`` (zeros
    where unused). ``packed``: the log-probs are the packed module's, which must reach the model's parameters
    (ValueError otherwise: a module transformed from another model or a copy would compare zero gradients)."""
    if masks is not None:
        lps = [lp * m.to(lp.device, lp.dtype) for lp, m in zip(lps, masks)]
    loss = sum(adv[i].to(lp.dtype) * lp.sum() for i, lp in enumerate(lps))
    grads = None
    if not packed or (isinstance(loss, torch.Tensor) and loss.requires_grad):
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    if packed and (grads is None or all(g is None for g in grads)):
        raise ValueError("the packed module's log-probs carry no gradient to the model's parameters: pass the model "
                         "it was transformed from (not a copy or another model), with gradients enabled")
    return [(torch.zeros_like(p) if g is None else g).detach().double() for p, g in zip(params, grads)]


def _advantages(advantages, n: int) -> torch.Tensor:
    """float64 CPU ``(n,)`` advantages (default: standard normal, seeded 0). ValueError (one line) for anything
    that is not ``n`` finite numbers. All zeros (a group whose rewards are equal) are valid: the loss's gradient is
    then exactly 0 for every run, so only the log-probs are compared."""
    if advantages is None:
        return torch.randn(n, generator=torch.Generator().manual_seed(0)).double()
    try:
        adv = torch.as_tensor(advantages).detach().to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"advantages must be {n} numbers (one per response or trajectory); got "
                         f"{type(advantages).__name__}") from None
    if tuple(adv.shape) != (n,):
        raise ValueError(f"advantages must have shape ({n},), one per response or trajectory; got "
                         f"{tuple(adv.shape)}")
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("advantages must be finite numbers; got NaN or inf")
    return adv


def check_exactness(model, opt, batch: Batch, advantages: Optional[torch.Tensor] = None,
                    backward: bool = True, padded: bool = False) -> dict:
    """Compare the transformed module on ``batch`` with the original model on the replicated batch.

    Compares the per-sequence log-probs and, with ``backward``, the gradient of every parameter of
    ``loss = Σ_i advantage_i · Σ_j mask_ij · logprob_ij`` (:func:`loss_masks`; ``torch.autograd.grad``: ``.grad`` of
    the model is untouched).

    Args:
        model: the original model (whose parameters ``opt`` shares).
        opt: the :class:`DualKVModule` (or any module ``batch -> logits (1, T, vocab)``).
        batch: a :class:`PackedBatch` (N responses) or a :class:`TreeBatch` (N trajectories).
        advantages: ``N`` numbers, a tensor, list or array (default: standard normal, seeded 0).
        backward: also compare gradients.
        padded: run the original as one right-padded batch instead of N separate sequences.

    Raises:
        ValueError: ``advantages`` not ``N`` finite numbers (all zeros compare the log-probs only); with
            ``backward``, no parameter of ``model`` requires grad, or ``opt``'s log-probs do not reach ``model``'s
            parameters (a module transformed from another model or a copy: its gradients would compare as zeros).

    Returns:
        dict: ``logprobs_abs``/``logprobs_rel`` (max abs error, and that over max |reference|); ``grad_abs``,
        ``grad_rel`` (the worst parameter's max abs error, and that over the parameter's max |reference
        gradient|), ``grad_worst`` (its name); ``grad_global_rel`` (``‖g − g_ref‖₂ / ‖g_ref‖₂`` over all
        parameters as one vector); ``num_params``.

    Note: in fp32 the per-parameter ``grad_rel`` of a deep model has a noise floor set by the original model itself:
    on SmolLM2-135M (30 layers) the original run as N separate sequences and as one padded batch already differ by
    ~3e-5 on some LayerNorm weights (summation order); ``grad_global_rel`` sits at ~4e-6 for both.
    """
    if not isinstance(backward, bool):
        raise ValueError(f"backward must be True or False; got {backward!r}")
    advantages = _advantages(advantages, num_sequences(batch))
    dev = device_of(model)
    params = trainable_parameters(model)
    if backward and not params:
        raise ValueError("no parameter of the model requires grad: unfreeze the ones to check (requires_grad_), or "
                         "pass backward=False")
    res: dict[str, Any] = {}
    with torch.set_grad_enabled(backward):
        lp_new = packed_logprobs(batch, opt(batch))
        lp_ref = replicated_logprobs(model, batch, padded=padded)
    a = torch.cat([x.detach() for x in lp_new])
    b = torch.cat([x.detach() for x in lp_ref])
    res["logprobs_abs"], res["logprobs_rel"] = _rel(a, b)
    if backward:
        adv = advantages.to(dev, torch.float64 if a.dtype == torch.float64 else torch.float32)
        ps = [p for _, p in params]
        masks = loss_masks(batch)
        g_new, g_ref = _loss_grads(lp_new, adv, ps, masks, packed=True), _loss_grads(lp_ref, adv, ps, masks)
        worst = (0.0, 0.0, "")
        sq_diff, sq_ref = 0.0, 0.0
        for (name, p), x, y in zip(params, g_new, g_ref):
            sq_diff += float(((x - y) ** 2).sum())
            sq_ref += float((y ** 2).sum())
            e, r = _rel(x, y)
            if r > worst[1] or r != r:
                worst = (e, r, name)
        res["grad_abs"], res["grad_rel"], res["grad_worst"] = worst
        res["grad_global_rel"] = math.sqrt(sq_diff / sq_ref) if sq_ref > 0 else math.sqrt(sq_diff)
        res["num_params"] = len(params)
    return res


def _float64_experts(ref: torch.nn.Module) -> torch.nn.Module:
    """``ref`` (a float64 copy) with mixture-of-experts layers on transformers' per-expert loop (``'eager'``): the
    default ``'grouped_mm'`` experts have no float64 kernel, and the loop computes the same per-expert products."""
    impl = getattr(getattr(ref, "config", None), "_experts_implementation", None)
    if impl not in (None, "eager") and hasattr(ref, "set_experts_implementation"):
        ref.set_experts_implementation("eager")
    return ref


def check_numerics_rule(model, opt, batch: Batch, advantages: Optional[torch.Tensor] = None,
                        floor: float = 1e-5, original_runs: tuple = ("separate", "padded")) -> dict:
    """The project's numerics rule for the DualKV module, per tensor, against a float64 run of the original model.

    Runs on ``batch`` (a :class:`PackedBatch`: N responses; a :class:`TreeBatch`: N trajectories, loss masks
    honoured): the packed module ``opt`` (the model's dtype), the original ``model`` on the replicated batch
    (same dtype) in each way of ``original_runs`` (``"separate"``: N sequences; ``"padded"``: one right-padded batch
    with an attention mask; both are how a trainer runs the original), and a float64 copy of the original (N
    separate sequences). For the per-sequence log-probs (all sequences as one tensor) and the gradient of every
    parameter (loss ``Σ_i adv_i Σ_j mask_ij logprob_ij``) the error of a run is ``max|x − x64| / max|x64|``; the
    original's error is the larger over ``original_runs``; the rule holds for a tensor when ``err(opt) <= 2 ·
    err(original) + floor``. A fixed tolerance between two runs in the model's dtype sets no bound: the original's own error varies
    with the input and with how it is run (SmolLM2-135M, fp32, one 3-response batch: ``‖g − g64‖ / ‖g64‖`` is
    1.4e-5 run separately and 3.1e-5 padded).

    Args:
        model: the original model (floating point; the packed module shares its parameters).
        opt: the :class:`DualKVModule`.
        batch: a :class:`PackedBatch` or a :class:`TreeBatch`.
        advantages: ``(N,)`` (default: standard normal, seeded 0).
        floor: the absolute floor of the rule, relative to ``max|x64|``. It grows with depth and shrinks with
            precision; measured: 1e-5 holds for fp32 models of 2-3 layers, the 30-layer SmolLM2-135M in fp32 needs
            1e-4 (tests/test_dualkv_transform.py says why), tiny bf16 models ~3e-3.
        original_runs: the ways the original is run in the model's dtype (a non-empty subset of
            ``("separate", "padded")``, or one of them as a string).

    Returns:
        dict: ``passed`` (every tensor within the rule), ``rows`` (``(name, err_opt, err_original, limit)`` per
        tensor; ``"logprobs"`` first), ``worst`` (the row with the largest ``err_opt / limit``), and
        ``grad_global_rel_opt`` / ``grad_global_rel_original`` (``‖g − g64‖₂ / ‖g64‖₂`` over all parameters; the
        original's is the larger over ``original_runs``).

    Raises:
        ValueError: ``original_runs`` empty or with another value; ``advantages`` not ``N`` finite numbers (all
            zeros: the gradients are exactly 0, the log-probs compared); no parameter of ``model`` requires grad;
            ``floor`` negative; ``opt``'s log-probs that do not reach ``model``'s parameters (a module transformed
            from another model or a copy).

    Memory: a float64 copy of the model (8 bytes per parameter) for the duration of the call.
    """
    import copy

    runs_ok = ("separate", "padded")
    if isinstance(original_runs, str):
        original_runs = (original_runs,)
    if not original_runs or any(r not in runs_ok for r in original_runs):
        raise ValueError(f"original_runs={original_runs!r}: pass a non-empty subset of {runs_ok}")
    if not floor >= 0:
        raise ValueError(f"floor={floor!r}: pass a non-negative float (relative to max|x64|)")
    dev = device_of(model)
    adv = _advantages(advantages, num_sequences(batch)).to(dev)
    params = trainable_parameters(model)
    if not params:
        raise ValueError("no parameter of the model requires grad: unfreeze the ones to check (requires_grad_)")
    names, ps = [nm for nm, _ in params], [p for _, p in params]
    ref = _float64_experts(copy.deepcopy(model).to(torch.float64))
    p64 = dict(trainable_parameters(ref))
    missing = [nm for nm in names if nm not in p64]
    if missing:
        raise ValueError(f"float64 copy of the model lacks parameters {missing[:3]}: pass the original model")
    ps64 = [p64[nm] for nm in names]

    def flat(lps, grads):
        return [torch.cat([x.detach().double() for x in lps])] + grads

    masks = loss_masks(batch)
    lp = replicated_logprobs(ref, batch)
    x_64 = flat(lp, _loss_grads(lp, adv, ps64, masks))
    del ref, lp
    lp = packed_logprobs(batch, opt(batch))
    x_opt = flat(lp, _loss_grads(lp, adv, ps, masks, packed=True))
    x_orig = []
    for how in dict.fromkeys(original_runs):
        lp = replicated_logprobs(model, batch, padded=how == "padded")
        x_orig.append(flat(lp, _loss_grads(lp, adv, ps, masks)))
    rows = []
    for i, (name, a, c) in enumerate(zip(["logprobs"] + names, x_opt, x_64)):
        e_opt, e_orig = _rel(a, c)[1], max(_rel(xs[i], c)[1] for xs in x_orig)
        rows.append((name, e_opt, e_orig, 2 * e_orig + floor))

    def global_rel(xs):
        d = math.sqrt(sum(float(((g - g64) ** 2).sum()) for g, g64 in zip(xs[1:], x_64[1:])))
        r = math.sqrt(sum(float((g64 ** 2).sum()) for g64 in x_64[1:]))
        return d / r if r > 0 else d

    def over(r):  # how far past its limit a row is (NaN: infinitely; 0/0 with floor 0: within)
        if r[1] != r[1]:
            return math.inf
        return r[1] / r[3] if r[3] > 0 else (0.0 if r[1] == 0 else math.inf)

    ok = all(e <= lim for _, e, _, lim in rows)       # NaN compares False: a NaN anywhere fails
    return {"passed": bool(ok), "rows": rows, "worst": max(rows, key=over),
            "grad_global_rel_opt": global_rel(x_opt),
            "grad_global_rel_original": max(global_rel(xs) for xs in x_orig)}


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
