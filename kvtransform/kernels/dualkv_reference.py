"""Plain-PyTorch references of the DualKV kernels (``kernels/dualkv.py``): the attention and its explicit backward
(the CPU path of ``kvt::dualkv_attention`` and the tests' reference), and the torch specification of the work tables
the kernels' planning launches build.

Packed shared-prefix layout (``kvtransform.layout``): segments ``[cu_seqlens[s], cu_seqlens[s+1])`` ordered group by
group (prefix, then its responses); ``segment_prefix[s]`` is the prefix segment of response ``s`` (``-1`` for a
prefix). Source: DualKV (arXiv 2605.15422, §2–3).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton


def _dropped(n: int, m: int, window: Optional[int], device) -> torch.Tensor:
    """bool ``(n, m)``: the keys each of ``n`` queries does not see under :func:`segment_attention`'s mask (bottom-right
    aligned causal, and outside the ``window``)."""
    pos = torch.arange(n, device=device)[:, None] + (m - n)
    j = torch.arange(m, device=device)[None, :]
    drop = j > pos
    if window is not None:
        drop = drop | (j <= pos - window)
    return drop


def segment_attention(qs, ks, vs, scale: float, soft: torch.dtype, window: Optional[int] = None,
                      softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, probs: bool = True):
    """One dense bottom-right-aligned causal attention of ``n`` queries against ``m >= n`` keys (the last ``n`` keys
    are the queries' own tokens; key ``j`` is at sequence position ``j``, query ``i`` at ``i + m - n``), the shared
    body of the DualKV and prefix-tree references.

    Args:
        qs ``(H, n, D)``, ks/vs ``(H, m, D)`` (GQA heads already repeated), in the matmul dtype; scale: softmax
            scale; soft: the softmax dtype; window/softcap/sinks: the attention variants
            (:func:`kvtransform.ops._common.check_attention_variants`; sinks ``(H,)``); probs: form the
            probabilities (False: ``p`` is None and, where ``vs`` is in ``soft``, the output is normalised after the
            PV product, one pass over the ``(H, n, m)`` scores fewer).

    Returns:
        ``(o, lse, p, t)``: o ``(H, n, D)`` in vs.dtype, lse ``(H, n)`` in ``soft`` (the sink term included), p the
        probabilities ``(H, n, m)`` (or None) and t the ``tanh`` of the soft-capped scores (None without softcap).

    The softmax exponentiates once (``exp(s - max)``, normalised by its row sum; every row keeps its diagonal key, so
    no row is empty) and updates the fresh score tensor in place where autograd allows it: on a CPU these passes
    over the scores, not the two matmuls, set the time (a 1,100-token segment of SmolLM2's shape: 2.3x faster than
    ``logsumexp`` followed by ``exp(s - lse)``).
    """
    n, m = qs.shape[1], ks.shape[1]
    s = torch.matmul(qs, ks.transpose(-1, -2)).to(soft).mul_(scale)
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = softcap * t
    s = s.masked_fill_(_dropped(n, m, window, qs.device), float("-inf"))
    mx = s.detach().amax(-1, keepdim=True)  # a constant shift: the softmax and the LSE do not depend on it
    if sinks is not None:
        sk = sinks.to(soft)[:, None, None]
        mx = torch.maximum(mx, sk.detach())
    e = (s - mx).exp_()
    den = e.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sk - mx)
    lse = (mx + den.log()).squeeze(-1)
    if not probs and vs.dtype == e.dtype:
        return torch.matmul(e, vs) / den, lse, None, t
    p = e / den
    return torch.matmul(p.to(vs.dtype), vs), lse, p, t


# PyTorch's fused CPU flash attention (what scaled_dot_product_attention runs on a CPU), with its LSE; a private op
# of torch (2.3 and later), so looked up once and not required
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_segment_attention(qs, ks, vs, scale: float, window: Optional[int] = None):
    """:func:`segment_attention`'s ``(o, lse)`` without soft-cap or sinks from PyTorch's fused CPU flash-attention
    kernel (blocked: the ``(H, n, m)`` scores are never held), or None where it does not apply (not a CPU tensor,
    not fp32/fp64, an empty segment, a scale that is not positive, a torch without the op, or a call autograd records:
    the kernel's autograd gives no gradient through the LSE). On one core, a 2,000-token segment of
    SmolLM2's shape: 0.10-0.16 s against 0.62-0.68 s for :func:`segment_attention`, the same error against float64."""
    n, m = qs.shape[1], ks.shape[1]
    if _FLASH_CPU is None or qs.device.type != "cpu" or qs.dtype not in (torch.float32, torch.float64) or n == 0 \
            or not scale > 0 \
            or torch.is_grad_enabled() and (qs.requires_grad or ks.requires_grad or vs.requires_grad):
        return None  # (the kernel takes the row max before scaling: wrong for a negative scale)
    # the kernel reads each row of D as contiguous (a permuted input with stride(-1) != 1 gave errors of order 1)
    qs, ks, vs = (x if x.stride(-1) == 1 else x.contiguous() for x in (qs, ks, vs))
    if window is None and n == m:
        o, lse = _FLASH_CPU(qs[None], ks[None], vs[None], 0.0, True, scale=scale)
    else:
        mask = torch.zeros(n, m, dtype=qs.dtype).masked_fill_(_dropped(n, m, window, qs.device), float("-inf"))
        o, lse = _FLASH_CPU(qs[None], ks[None], vs[None], 0.0, False, attn_mask=mask, scale=scale)
    return o[0], lse[0]


def segment_attention_backward(qs, ks, vs, dos, dlse, scale: float, window=None, softcap=None, sinks=None):
    """Explicit gradients of :func:`segment_attention` (all inputs in one float dtype, ``dlse`` ``(H, n)`` or None):
    ``(dq (H, n, D), dk (H, m, D), dv (H, m, D), dsinks (H,) or None)``. ``Delta = rowsum(dO∘O) - dLSE``;
    soft-capping multiplies dS by ``1 - tanh^2``; ``dsinks[h] = -sum_rows exp(sinks[h] - lse) * Delta``."""
    o, lse, p, t = segment_attention(qs, ks, vs, scale, qs.dtype, window, softcap, sinks)
    delta = (o * dos).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    ds = p * (torch.matmul(dos, vs.transpose(-1, -2)) - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dsink = None if sinks is None else -(torch.exp(sinks.to(qs.dtype)[:, None] - lse) * delta).sum(-1)
    return torch.matmul(ds, ks) * scale, torch.matmul(ds.transpose(-1, -2), qs) * scale, \
        torch.matmul(p.transpose(-1, -2), dos), dsink


def segment_rows(cu: list, sp: list, s: int) -> list:
    """Token ranges ``[(lo, hi), ...]`` of the keys segment ``s`` sees, in sequence order (prefix, then itself)."""
    return [(cu[s], cu[s + 1])] if sp[s] < 0 else [(cu[sp[s]], cu[sp[s] + 1]), (cu[s], cu[s + 1])]


def packed_reference(q, k, v, cu: list, rows: list, softmax_scale, upcast: bool, window, softcap, sinks):
    """Forward of :func:`dualkv_attention_reference` for any layout given as ``rows[s]`` = the key token ranges of
    segment ``s`` (``[cu[s], cu[s+1])`` last; shared by the prefix-tree reference)."""
    t, h, d = q.shape
    grp = h // k.shape[1]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    work = torch.float64 if q.dtype == torch.float64 else (torch.float32 if upcast else q.dtype)
    soft = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for s, rs in enumerate(rows):
        a, b = cu[s], cu[s + 1]
        qs = q[a:b].to(work).transpose(0, 1)  # (H, n, D)
        ks = torch.cat([k[x:y] for x, y in rs]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        vs = torch.cat([v[x:y] for x, y in rs]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        fused = None if softcap is not None or sinks is not None else fused_segment_attention(qs, ks, vs, scale, window)
        o, lse = fused if fused is not None else \
            segment_attention(qs, ks, vs, scale, soft, window, softcap, sinks, probs=False)[:2]
        outs.append(o.transpose(0, 1).to(q.dtype))
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros(q.shape)
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(h, t, dtype=soft, device=q.device)
    return out, lse


def packed_reference_backward(grad_out, grad_lse, q, k, v, cu: list, rows: list, softmax_scale, window, softcap,
                              sinks):
    """Backward of :func:`packed_reference` (fp32, fp64 for fp64 inputs): ``(dq, dk, dv)``, plus ``dsinks`` (in
    sinks' dtype) when ``sinks`` is given; a key's dK/dV sum every segment that sees it."""
    t, h, d = q.shape
    h_kv = k.shape[1]
    grp = h // h_kv
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    dk = torch.zeros(k.shape, dtype=work, device=q.device)
    dv = torch.zeros(v.shape, dtype=work, device=q.device)
    dsinks = None if sinks is None else torch.zeros(h, dtype=work, device=q.device)
    for s, rs in enumerate(rows):
        a, b = cu[s], cu[s + 1]
        qs = q[a:b].to(work).transpose(0, 1)
        ks = torch.cat([k[x:y] for x, y in rs]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        vs = torch.cat([v[x:y] for x, y in rs]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        dlse = None if grad_lse is None else grad_lse[:, a:b].to(work)
        dqs, dks, dvs, dsk = segment_attention_backward(qs, ks, vs, grad_out[a:b].to(work).transpose(0, 1), dlse,
                                                        scale, window, softcap, sinks)
        dq[a:b] = dqs.transpose(0, 1)
        m = ks.shape[1]
        dks = dks.view(h_kv, grp, m, d).sum(1).transpose(0, 1)
        dvs = dvs.view(h_kv, grp, m, d).sum(1).transpose(0, 1)
        off = 0
        for x, y in rs:
            dk[x:y] += dks[off:off + y - x]
            dv[x:y] += dvs[off:off + y - x]
            off += y - x
        if dsinks is not None:
            dsinks += dsk
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
    return grads if sinks is None else (*grads, dsinks.to(sinks.dtype))


def dualkv_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               segment_prefix: torch.Tensor, softmax_scale: Optional[float] = None,
                               upcast: bool = True, *, window: Optional[int] = None,
                               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
    """Plain-PyTorch (differentiable, also in ``sinks``) DualKV attention, segment by segment.

    Each query segment is one dense attention: a prefix against its own keys (causal); a response ``r`` against
    ``cat(prefix keys, own keys)`` with the bottom-right aligned causal mask (the whole prefix plus ``0..r``).

    Args:
        q: ``(T, H, D)``; k, v: ``(T, H_kv, D)``, ``H % H_kv == 0``; any float dtype.
        cu_seqlens: int ``(S+1,)`` segment boundaries; segment_prefix: int ``(S,)`` (``-1`` for a prefix).
        softmax_scale: default ``D ** -0.5``.
        upcast: compute in fp32 (or fp64 if the inputs are fp64); if False, the matmuls run in the input dtype and
            only the softmax in fp32 (PyTorch's own low-precision error, used by the numerics rule of the tests).
        window, softcap, sinks: the attention variants (``kvtransform.ops._common.check_attention_variants``; not
            validated here). Positions are each token's position in its own sequence: a response token continues
            its prefix's positions.

    Returns:
        ``(out, lse)``: out ``(T, H, D)`` in ``q.dtype``; lse ``(H, T)`` fp32 (fp64 for fp64 inputs), natural log
        (the sink term included).

    Reads the offsets on the host (one sync); not for use under tracing.
    """
    cu = [int(x) for x in cu_seqlens.tolist()]
    sp = [int(x) for x in segment_prefix.tolist()]
    return packed_reference(q, k, v, cu, [segment_rows(cu, sp, s) for s in range(len(sp))], softmax_scale, upcast,
                            window, softcap, sinks)


def dualkv_attention_reference_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor,
                                        k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                        segment_prefix: torch.Tensor, softmax_scale: Optional[float] = None, *,
                                        window: Optional[int] = None, softcap: Optional[float] = None,
                                        sinks: Optional[torch.Tensor] = None):
    """Explicit (no autograd) gradients of :func:`dualkv_attention_reference`, computed in fp32 (fp64 for fp64
    inputs) segment by segment; the prefix's dK/dV sum its own causal part and every response of its group.

    Args:
        grad_out: ``(T, H, D)``; grad_lse: optional ``(H, T)``; the rest as :func:`dualkv_attention_reference`.

    Returns:
        ``(dq, dk, dv)`` in the dtypes and shapes of q, k, v; with ``sinks`` also ``dsinks`` ``(H,)``.
    """
    cu = [int(x) for x in cu_seqlens.tolist()]
    sp = [int(x) for x in segment_prefix.tolist()]
    return packed_reference_backward(grad_out, grad_lse, q, k, v, cu, [segment_rows(cu, sp, s) for s in range(len(sp))],
                                     softmax_scale, window, softcap, sinks)


# ====================================================================================================== work tables
# The launchers build these tables with two small Triton kernels (``kernels/dualkv.py``: ``_plan_layout_kernel``,
# ``_plan_work_kernel``): these torch versions took ~80 small launches per kernel call (0.15-0.2 ms of GPU time before
# the forward at P=5059/mb=4 on an H200, BENCHMARKS.md, "DualKV attention op") and are the specification the tests compare
# the planning kernels with.
def bounded_layout(cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, total_tokens: int):
    """The layout as the kernels use it: offsets clamped into ``[0, T]`` and made non-decreasing (running max),
    prefix indices clamped into ``[-1, S-1]``; int32, on the device, no host sync. A valid layout is unchanged; for
    any other the kernels then index only rows ``[0, T)`` of their tensors and entries ``[0, S]`` of the tables (rows
    that no clamped segment covers are left unwritten; ``kvt::dualkv_attention`` refuses such layouts)."""
    cu = torch.cummax(cu_seqlens.clamp(0, total_tokens), 0).values.to(torch.int32)
    sp = segment_prefix.clamp(-1, segment_prefix.numel() - 1).to(torch.int32)
    return cu, sp


def segment_tables(cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor):
    """Per-segment int32 ranges, on the device, without host syncs.

    Returns ``(kctx_lo, kctx_hi, qctx_lo, qctx_hi)``: the context *key* range a segment's queries also see (the group
    prefix, for a response; empty for a prefix) and the context *query* range that also sees a segment's keys (all
    response tokens of the group, for a prefix; empty for a response)."""
    cu = cu_seqlens.long()
    sp = segment_prefix.long()
    s = sp.numel()
    is_resp = sp >= 0
    p = sp.clamp(min=0)
    zero = torch.zeros_like(sp)
    kctx_lo = torch.where(is_resp, cu[p], zero)
    kctx_hi = torch.where(is_resp, cu[p + 1], zero)
    # group end of each prefix: max end of its responses (and itself)
    owner = torch.where(is_resp, p, torch.arange(s, device=sp.device))
    gend = torch.zeros(s, dtype=torch.long, device=sp.device).scatter_reduce(0, owner, cu[1:], reduce="amax",
                                                                           include_self=True)
    qctx_lo = torch.where(is_resp, zero, cu[1:])
    qctx_hi = torch.where(is_resp, zero, gend)
    return (kctx_lo.to(torch.int32), kctx_hi.to(torch.int32), qctx_lo.to(torch.int32), qctx_hi.to(torch.int32))


def work_table(cu_seqlens: torch.Tensor, block: int, total_tokens: int, extra: torch.Tensor, per_block_sign: int):
    """Blocks of ``block`` tokens of every segment, heaviest first, as two int32 tensors ``(seg, blk)`` of static
    length ``cdiv(T, block) + S`` (unused entries have ``seg = -1``). Built on the device, no host sync.

    Cost of block ``b`` of segment ``s``: ``extra[s] + (b+1)*block`` (query blocks: the keys they visit) if
    ``per_block_sign > 0``, else ``extra[s] + len_s - b*block`` (key blocks: the queries that see them)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    s = lens.numel()
    nblk = (lens + block - 1) // block
    ends = torch.cumsum(nblk, 0)
    w = triton.cdiv(total_tokens, block) + s
    i = torch.arange(w, device=cu.device)
    seg = torch.searchsorted(ends, i, right=True)
    valid = seg < s
    seg_c = seg.clamp(max=s - 1)
    blk = i - (ends[seg_c] - nblk[seg_c])
    if per_block_sign > 0:
        cost = extra.long()[seg_c] + (blk + 1) * block
    else:
        cost = extra.long()[seg_c] + lens[seg_c] - blk * block
    cost = torch.where(valid, cost, torch.full_like(cost, -(w + 1)))
    order = torch.argsort(cost, descending=True, stable=True)
    seg_out = torch.where(valid, seg_c, torch.full_like(seg_c, -1))[order].to(torch.int32).contiguous()
    blk_out = blk[order].to(torch.int32).contiguous()
    return seg_out, blk_out, w


__all__ = ["dualkv_attention_reference", "dualkv_attention_reference_backward", "segment_attention",
           "fused_segment_attention",
           "segment_attention_backward", "packed_reference", "packed_reference_backward", "bounded_layout",
           "segment_tables",
           "work_table"]
