"""Exactness of a packed batch against the original model (DualKV, arXiv 2605.15422; prefix trees): the packed
module's per-sequence log-probs and the gradient of every parameter of ``Σ_i adv_i Σ_j mask_ij logprob_ij`` against
the original run on the replicated sequences (:func:`check_exactness`), and the project's numerics rule against a
float64 run of the original, per tensor (:func:`check_numerics_rule`). Both batch kinds go through the same code:
:func:`scored_sequences` (what the original runs), :func:`packed_logprobs` (what the packed module's logits give) and
:func:`loss_masks` are the only places that tell them apart. ``kvtransform.verify`` runs these as the DualKV
transform's gate and re-exports the public names."""
from __future__ import annotations

import functools
import math
from typing import Any, Optional, Union

import torch

from kvtransform.packing import PackedBatch
from kvtransform.tree_packing import TreeBatch
from kvtransform.utils import device_of

__all__ = ["Batch", "check_exactness", "check_numerics_rule", "loss_masks", "num_sequences", "packed_logprobs",
           "replicated_logprobs", "scored_sequences", "trainable_parameters"]


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
                         "it was transformed from (not a copy or another model)")
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


def _grad_check(fn):
    """Run the check ``fn(model, opt, batch, ...)`` with autograd on: under a caller's ``torch.no_grad()`` there would
    be no gradients to compare. One-line errors for a call inside ``torch.inference_mode()`` (ValueError: it cannot
    be left from inside) and a ``batch`` that is neither a PackedBatch nor a TreeBatch (TypeError)."""
    @functools.wraps(fn)
    def run(model, opt, batch, *args, **kwargs):
        if torch.is_inference_mode_enabled():
            raise ValueError(f"{fn.__name__} computes gradients, which torch.inference_mode() forbids: call it (or "
                             f"kvt.transform(model, 'dualkv'), whose gate runs it) outside inference mode")
        if not isinstance(batch, (PackedBatch, TreeBatch)):
            raise TypeError(f"batch must be a PackedBatch (kvt.pack_shared_prefix) or a TreeBatch "
                            f"(kvt.pack_trajectories); got {type(batch).__name__}")
        with torch.enable_grad():
            return fn(model, opt, batch, *args, **kwargs)
    return run


@_grad_check
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
            parameters (a module transformed from another model or a copy: its gradients would compare as zeros);
            a call inside ``torch.inference_mode()`` (under ``torch.no_grad()`` the check turns gradients on itself).
        TypeError: ``batch`` neither a PackedBatch nor a TreeBatch.

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


@_grad_check
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
            from another model or a copy); a call inside ``torch.inference_mode()`` (under ``torch.no_grad()`` the
            check turns gradients on itself).
        TypeError: ``batch`` neither a PackedBatch nor a TreeBatch.

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
