"""Prefix-tree attention: Triton forward, deterministic Triton backward, and the plain-PyTorch reference.

Layout (:class:`kvtransform.tree_layout.PrefixTreeLayout`): nodes ``[cu_seqlens[n], cu_seqlens[n+1])`` of the
packed token axis; a query of node ``n`` attends to every token of its ancestor nodes and causally within ``n``.
The kernels read the ancestors and descendants as merged token ranges (CSR ``key_range_ptr``/``key_ranges`` and
``query_range_ptr``/``query_ranges``, int32; ranges ``(R, 2)`` rows ``[lo, hi)``). Source: Tree Training (arXiv
2511.00413) for packing trajectories as a tree; the kernels generalise the DualKV ones (arXiv 2605.15422, §2–3,
``kernels/dualkv.py``) from one shared level to any depth.

Kernels (one launch each, every tree and node at once). They share the tile bodies of ``kernels/dualkv.py``
(``_fwd_inner``, ``_bwd_dq_inner``, ``_bwd_dkdv_inner``, ``_query_rows``, ``_bwd_delta_kernel``): only the loop over
context ranges differs (DualKV has at most one).

* forward ``_tree_fwd_kernel``: one program per (query block of a node, query head) (or, config ``PACK``, per query
  block and KV head with the GQA group packed), from a heaviest-first work table built on the device. Keys: every
  ancestor range (whole blocks unmasked, the ragged tail masked), then the own node (blocks below the diagonal
  unmasked, the diagonal causal). Online softmax in fp32 (exp2), fp32 natural-log LSE.
* backward: ``Delta = rowsum(dO∘O) - dLSE``; ``_tree_dq_kernel`` (the forward's iteration) and ``_tree_dkdv_kernel``
  (one program per key block of node ``m`` and KV head: the own node's queries causally, then every descendant
  range fully, over the ``H/H_kv`` query heads of the KV head). Every gradient element has one owner program and
  is accumulated in fp32 registers in a fixed order: bitwise deterministic, no atomics.

GQA: query head ``h`` reads KV head ``h // (H // H_kv)``. Head dims 1..256 padded to the next power of two (>= 16)
with masks. Token offsets are int64 inside the kernels (``T * stride`` can pass 2**31); layout values are int32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import next_pow2
from .dualkv import (LOG2E, MAX_HEAD_DIM, SUPPORTED_DTYPES, _bwd_delta_kernel, _bwd_dkdv_inner, _bwd_dq_inner, _cfg,
                     _fwd_inner, _interpreting, _prep, _query_rows, _tma_descriptors)

__all__ = ["prefix_tree_fwd", "prefix_tree_bwd", "prefix_tree_attention_reference",
           "prefix_tree_attention_reference_backward", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]


# ====================================================================================================== reference
def _layout_lists(layout):
    """``(cu, key_ranges per node)`` python lists from a PrefixTreeLayout or a tuple ``(cu_seqlens, key_range_ptr,
    key_ranges)`` of tensors (a host read)."""
    if hasattr(layout, "key_range_ptr"):
        cu_t, ptr_t, rng_t = layout.cu_seqlens, layout.key_range_ptr, layout.key_ranges
    else:
        cu_t, ptr_t, rng_t = layout
    cu = [int(x) for x in cu_t.tolist()]
    ptr = [int(x) for x in ptr_t.tolist()]
    rng = [(int(a), int(b)) for a, b in rng_t.reshape(-1, 2).tolist()]
    return cu, [rng[ptr[n]:ptr[n + 1]] for n in range(len(cu) - 1)]


def prefix_tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout,
                                    softmax_scale: Optional[float] = None, upcast: bool = True):
    """Plain-PyTorch (differentiable) prefix-tree attention, node by node.

    Each node's queries attend to ``cat(ancestor keys, own keys)`` with the bottom-right aligned causal mask (every
    ancestor token plus own tokens ``0..r``); memory per node ``H * len * (context + len)`` scores.

    Args:
        q: ``(T, H, D)``; k, v: ``(T, H_kv, D)``, ``H % H_kv == 0``; any float dtype.
        layout: a :class:`~kvtransform.tree_layout.PrefixTreeLayout`, or ``(cu_seqlens, key_range_ptr,
            key_ranges)`` int tensors.
        softmax_scale: default ``D ** -0.5``.
        upcast: compute in fp32 (fp64 for fp64 inputs); False: the matmuls in the input dtype and the softmax in
            fp32 (PyTorch's own low-precision error, the numerics rule's yardstick).

    Returns:
        ``(out, lse)``: out ``(T, H, D)`` in q.dtype; lse ``(H, T)`` fp32 (fp64 for fp64 inputs), natural log.

    Reads the layout on the host; not for tracing.
    """
    t, h, d = q.shape
    grp = h // k.shape[1]
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    cu, kr = _layout_lists(layout)
    work = torch.float64 if q.dtype == torch.float64 else (torch.float32 if upcast else q.dtype)
    soft = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        rows = kr[n] + [(a, b)]
        qs = q[a:b].to(work).transpose(0, 1)
        ks = torch.cat([k[x:y] for x, y in rows]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        vs = torch.cat([v[x:y] for x, y in rows]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        ln, m = b - a, ks.shape[1]
        scores = torch.matmul(qs, ks.transpose(-1, -2)).to(soft) * scale
        keep = torch.arange(m, device=q.device)[None, :] <= torch.arange(ln, device=q.device)[:, None] + (m - ln)
        scores = scores.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse[..., None])
        outs.append(torch.matmul(p.to(vs.dtype), vs).transpose(0, 1).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def prefix_tree_attention_reference_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                                             q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout,
                                             softmax_scale: Optional[float] = None):
    """Explicit gradients of :func:`prefix_tree_attention_reference` (fp32, fp64 for fp64 inputs), node by node: an
    ancestor's dK/dV sum its own causal part and the parts of every descendant.

    Args:
        grad_out: ``(T, H, D)``; grad_lse: optional ``(H, T)``; the rest as the reference.

    Returns:
        ``(dq, dk, dv)`` in the dtypes and shapes of q, k, v.
    """
    t, h, d = q.shape
    h_kv = k.shape[1]
    grp = h // h_kv
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu, kr = _layout_lists(layout)
    dq = torch.zeros(q.shape, dtype=work, device=q.device)
    dk = torch.zeros(k.shape, dtype=work, device=q.device)
    dv = torch.zeros(v.shape, dtype=work, device=q.device)
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        rows = kr[n] + [(a, b)]
        qs = q[a:b].to(work).transpose(0, 1)
        ks = torch.cat([k[x:y] for x, y in rows]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        vs = torch.cat([v[x:y] for x, y in rows]).to(work).transpose(0, 1).repeat_interleave(grp, dim=0)
        dos = grad_out[a:b].to(work).transpose(0, 1)
        ln, m = b - a, ks.shape[1]
        keep = torch.arange(m, device=q.device)[None, :] <= torch.arange(ln, device=q.device)[:, None] + (m - ln)
        p = torch.softmax((torch.matmul(qs, ks.transpose(-1, -2)) * scale).masked_fill(~keep, float("-inf")), -1)
        delta = (torch.matmul(p, vs) * dos).sum(-1)
        if grad_lse is not None:
            delta = delta - grad_lse[:, a:b].to(work)
        ds = p * (torch.matmul(dos, vs.transpose(-1, -2)) - delta[..., None])
        dq[a:b] = (torch.matmul(ds, ks) * scale).transpose(0, 1)
        dks = (torch.matmul(ds.transpose(-1, -2), qs) * scale).view(h_kv, grp, m, d).sum(1).transpose(0, 1)
        dvs = torch.matmul(p.transpose(-1, -2), dos).view(h_kv, grp, m, d).sum(1).transpose(0, 1)
        off = 0
        for x, y in rows:
            dk[x:y] += dks[off:off + y - x]
            dv[x:y] += dvs[off:off + y - x]
            off += y - x
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ====================================================================================================== work tables
def _bounded(cu_seqlens, range_ptr, ranges, total_tokens):
    """The layout as the kernels read it, on the device without a host sync: offsets clamped into ``[0, T]`` and
    non-decreasing, range pointers clamped into ``[0, R]`` and non-decreasing, range ends clamped into ``[0, T]``
    (``lo <= hi``). A valid layout is unchanged; any other never makes the kernels index outside their tensors.
    Returns ``(cu, ptr, lo, hi)`` int32 (``lo``/``hi`` at least one entry long)."""
    cu = torch.cummax(cu_seqlens.clamp(0, total_tokens), 0).values.to(torch.int32)
    r = ranges.reshape(-1, 2)
    ptr = torch.cummax(range_ptr.clamp(0, r.shape[0]), 0).values.to(torch.int32)
    if r.shape[0] == 0:
        z = torch.zeros(1, dtype=torch.int32, device=cu.device)
        return cu, ptr, z, z
    lo = r[:, 0].clamp(0, total_tokens)
    hi = torch.maximum(r[:, 1].clamp(0, total_tokens), lo)
    return cu, ptr, lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def _context_tokens(ptr: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """int64 ``(N,)``: tokens in each node's ranges (segment sums of ``hi - lo`` over the CSR), on the device."""
    lens = (hi.long() - lo.long())
    csum = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    p = ptr.long()
    return csum[p[1:]] - csum[p[:-1]]


def _work_table(cu: torch.Tensor, block: int, total_tokens: int, extra: torch.Tensor, per_block_sign: int):
    """Blocks of ``block`` tokens of every node, heaviest first: ``(node, blk)`` int32 tensors of static length
    ``cdiv(T, block) + N`` (unused entries ``node = -1``), built on the device (no host sync). Cost of block ``b`` of
    node ``n``: ``extra[n] + (b+1)*block`` (query blocks) for ``per_block_sign > 0``, else ``extra[n] + len_n -
    b*block`` (key blocks)."""
    cu = cu.long()
    lens = cu[1:] - cu[:-1]
    s = lens.numel()
    nblk = (lens + block - 1) // block
    ends = torch.cumsum(nblk, 0)
    w = triton.cdiv(total_tokens, block) + s
    i = torch.arange(w, device=cu.device)
    node = torch.searchsorted(ends, i, right=True)
    valid = node < s
    node_c = node.clamp(max=s - 1)
    blk = i - (ends[node_c] - nblk[node_c])
    if per_block_sign > 0:
        cost = extra[node_c] + (blk + 1) * block
    else:
        cost = extra[node_c] + lens[node_c] - blk * block
    cost = torch.where(valid, cost, torch.full_like(cost, -1))
    order = torch.argsort(cost, descending=True, stable=True)
    node_out = torch.where(valid, node_c, torch.full_like(node_c, -1))[order].to(torch.int32).contiguous()
    return node_out, blk[order].to(torch.int32).contiguous(), w


# ====================================================================================================== kernels
@triton.jit
def _tree_fwd_kernel(Q, K, V, O, LSE, CU, KPTR, KLO, KHI, WSEG, WBLK,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     T, H, GROUP, qk_scale,
                     D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     PACK: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr,
                     KD, VD, TMA: tl.constexpr):
    """One program per (work entry, head unit) as ``kernels/dualkv.py``'s ``_fwd_kernel``; the keys: every
    ancestor range of the node, then the own node causally."""
    pid = tl.program_id(0)
    n_units = H // GROUP if PACK > 1 else H
    w = pid // n_units
    u = pid % n_units
    node = tl.load(WSEG + w)
    if node < 0:
        return
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + node)
    se = tl.load(CU + node + 1)
    hk, q_start, offs_m, head, rm = _query_rows(u, blk, ss, se, GROUP, BLOCK_M, PACK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    qm = rm[:, None]
    if not EVEN_D:
        qm = qm & (offs_d[None, :] < D)
    q_row = offs_m.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=qm, other=0.0)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    kcol = hk * D
    m_i = tl.full([PACK * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([PACK * BLOCK_M], tl.float32)
    acc = tl.zeros([PACK * BLOCK_M, D_PAD], tl.float32)
    r0 = tl.load(KPTR + node)
    r1 = tl.load(KPTR + node + 1)
    for r in range(r0, r1):  # ancestors, root first: whole blocks unmasked, then the ragged tail
        cs = tl.load(KLO + r)
        ce = tl.load(KHI + r)
        c_full = cs + ((ce - cs) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                                   cs, c_full, ce, qk_scale, D, BLOCK_N, EVEN_D, False, False, PREC, SCALE_POS, KD,
                                   VD, kcol, TMA)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                                   c_full, ce, ce, qk_scale, D, BLOCK_N, EVEN_D, True, False, PREC, SCALE_POS, KD,
                                   VD, kcol, TMA)
    # own node: whole key blocks strictly below the query block unmasked, then the causal rest
    d_lo = ss + ((q_start - ss) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               ss, d_lo, se, qk_scale, D, BLOCK_N, EVEN_D, False, False, PREC, SCALE_POS, KD, VD,
                               kcol, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               d_lo, tl.minimum(q_start + BLOCK_M, se), se, qk_scale, D, BLOCK_N, EVEN_D, True, True,
                               PREC, SCALE_POS, KD, VD, kcol, TMA)
    l_i = tl.where(rm, l_i, 1.0)
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    o_row = offs_m.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(O + o_row[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=qm)
    tl.store(LSE + head.to(tl.int64) * T + offs_m, lse, mask=rm)


@triton.jit
def _tree_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, CU, KPTR, KLO, KHI, WSEG, WBLK,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                    stride_dqt, stride_dqh, T, H, GROUP, qk_scale, sm_scale,
                    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_D: tl.constexpr, PREC: tl.constexpr, PACK: tl.constexpr, KD, VD, TMA: tl.constexpr):
    """dQ: the forward's tiling and key iteration; each dQ row has one owner program."""
    pid = tl.program_id(0)
    n_units = H // GROUP if PACK > 1 else H
    w = pid // n_units
    u = pid % n_units
    node = tl.load(WSEG + w)
    if node < 0:
        return
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + node)
    se = tl.load(CU + node + 1)
    hk, q_start, offs_m, head, rm = _query_rows(u, blk, ss, se, GROUP, BLOCK_M, PACK)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    qm = rm[:, None]
    if not EVEN_D:
        qm = qm & (offs_d[None, :] < D)
    row = offs_m.to(tl.int64)
    hrow = head.to(tl.int64)
    q = tl.load(Q + (row * stride_qt + hrow * stride_qh)[:, None] + offs_d[None, :], mask=qm, other=0.0)
    do = tl.load(DO + (row * stride_dot + hrow * stride_doh)[:, None] + offs_d[None, :], mask=qm, other=0.0)
    lse2 = tl.load(LSE + hrow * T + offs_m, mask=rm, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + hrow * T + offs_m, mask=rm, other=0.0)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    kcol = hk * D
    dq = tl.zeros([PACK * BLOCK_M, D_PAD], tl.float32)
    r0 = tl.load(KPTR + node)
    r1 = tl.load(KPTR + node + 1)
    for r in range(r0, r1):
        cs = tl.load(KLO + r)
        ce = tl.load(KHI + r)
        c_full = cs + ((ce - cs) // BLOCK_N) * BLOCK_N
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                           cs, c_full, ce, qk_scale, D, BLOCK_N, EVEN_D, False, False, PREC, KD, VD, kcol, TMA)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                           c_full, ce, ce, qk_scale, D, BLOCK_N, EVEN_D, True, False, PREC, KD, VD, kcol, TMA)
    d_lo = ss + ((q_start - ss) // BLOCK_N) * BLOCK_N
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                       ss, d_lo, se, qk_scale, D, BLOCK_N, EVEN_D, False, False, PREC, KD, VD, kcol, TMA)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                       d_lo, tl.minimum(q_start + BLOCK_M, se), se, qk_scale, D, BLOCK_N, EVEN_D, True, True,
                       PREC, KD, VD, kcol, TMA)
    dq = dq * sm_scale
    tl.store(DQ + (row * stride_dqt + hrow * stride_dqh)[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=qm)


@triton.jit
def _tree_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, CU, QPTR, QLO, QHI, WSEG, WBLK,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                      stride_dkt, stride_dkh, stride_dvt, stride_dvh, T, H_KV, GROUP, qk_scale, sm_scale,
                      D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      EVEN_D: tl.constexpr, PREC: tl.constexpr, QD, DOD, TMA: tl.constexpr):
    """One program per (BLOCK_N keys of one node, KV head): dK/dV over the GQA group's query heads and every query
    that sees these keys (the own node causally, then every descendant range); one owner per row, no atomics."""
    pid = tl.program_id(0)
    w = pid // H_KV
    g = pid % H_KV
    node = tl.load(WSEG + w)
    if node < 0:
        return
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + node)
    se = tl.load(CU + node + 1)
    k_start = ss + blk * BLOCK_N
    offs_n = k_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    km = offs_n[:, None] < se
    if not EVEN_D:
        km = km & (offs_d[None, :] < D)
    krow = offs_n.to(tl.int64)[:, None]
    k = tl.load(K + krow * stride_kt + g * stride_kh + offs_d[None, :], mask=km, other=0.0)
    v = tl.load(V + krow * stride_vt + g * stride_vh + offs_d[None, :], mask=km, other=0.0)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    diag_hi = tl.minimum(k_start + BLOCK_N, se)
    o_full = diag_hi + ((se - diag_hi) // BLOCK_M) * BLOCK_M
    r0 = tl.load(QPTR + node)
    r1 = tl.load(QPTR + node + 1)
    for hh in range(0, GROUP):
        h = g * GROUP + hh
        q_base = Q + h * stride_qh
        do_base = DO + h * stride_doh
        lse_base = LSE + h.to(tl.int64) * T
        delta_base = DELTA + h.to(tl.int64) * T
        qcol = h * D
        # own node: the diagonal (causal), then the queries after it (whole blocks, then the tail)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_m, offs_d, k_start, diag_hi, se, qk_scale, D, BLOCK_M, EVEN_D, True, True, PREC,
                                 QD, DOD, qcol, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_m, offs_d, diag_hi, o_full, se, qk_scale, D, BLOCK_M, EVEN_D, False, False,
                                 PREC, QD, DOD, qcol, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_m, offs_d, o_full, se, se, qk_scale, D, BLOCK_M, EVEN_D, True, False, PREC,
                                 QD, DOD, qcol, TMA)
        for r in range(r0, r1):  # descendants: every query sees every key of this block
            cs = tl.load(QLO + r)
            ce = tl.load(QHI + r)
            c_full = cs + ((ce - cs) // BLOCK_M) * BLOCK_M
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt,
                                     stride_dot, offs_m, offs_d, cs, c_full, ce, qk_scale, D, BLOCK_M, EVEN_D, False,
                                     False, PREC, QD, DOD, qcol, TMA)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt,
                                     stride_dot, offs_m, offs_d, c_full, ce, ce, qk_scale, D, BLOCK_M, EVEN_D, True,
                                     False, PREC, QD, DOD, qcol, TMA)
    dk = dk * sm_scale
    tl.store(DK + krow * stride_dkt + g * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=km)
    tl.store(DV + krow * stride_dvt + g * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=km)


# ====================================================================================================== launchers
def _lastdim(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def check_launch(q, k, v, cu_seqlens, range_ptr, ranges, what: str) -> None:
    """Host checks of the launchers (no data read): ranks, dtypes, head counts, devices, int32 layout tensors of
    consistent sizes. ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{what}: {name} must be a 3-D tensor (T, heads, head_dim)")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{what}: q, k, v must share one of {SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"{what}: k/v must be (T={t}, H_kv, D={d}) with H={h} divisible by H_kv; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{what}: head_dim {d} outside 1..{MAX_HEAD_DIM}")
    for name, x in (("cu_seqlens", cu_seqlens), ("range_ptr", range_ptr), ("ranges", ranges)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"{what}: {name} must be int32 on {q.device}; got {x.dtype} on {x.device}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or range_ptr.shape != cu_seqlens.shape:
        raise ValueError(f"{what}: cu_seqlens and the range pointers must be (N+1,) with N >= 1; got "
                         f"{tuple(cu_seqlens.shape)}, {tuple(range_ptr.shape)}")
    if ranges.dim() != 2 or ranges.shape[1] != 2:
        raise ValueError(f"{what}: ranges must be (R, 2); got {tuple(ranges.shape)}")


def prefix_tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    key_range_ptr: torch.Tensor, key_ranges: torch.Tensor, scale: float, *,
                    config: Optional[dict] = None):
    """Triton prefix-tree forward (one launch for every tree and node).

    Args:
        q: ``(T, H, D)`` fp16/bf16/fp32 (last dim contiguous, else copied); k, v: ``(T, H_kv, D)``, same dtype.
        cu_seqlens: int32 ``(N+1,)``; key_range_ptr: int32 ``(N+1,)``; key_ranges: int32 ``(RK, 2)`` (the layout's
            ancestors as token ranges). Values are not validated here (``kvt::prefix_tree_attention`` does that
            on CPU; the public wrapper's layout was validated when built) but clamped, so the kernels never
            read or write outside their tensors.
        scale: softmax scale.
        config: optional ``{"fwd": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "PACK", "TMA"}}``, defaults as
            ``kernels/dualkv.py`` (tuned there on an H200).

    Returns:
        ``(out, lse)``: out ``(T, H, D)`` in q.dtype; lse fp32 ``(H, T)``, natural log.

    Raises:
        ValueError: shapes, dtypes or devices that disagree (:func:`check_launch`).
    """
    check_launch(q, k, v, cu_seqlens, key_range_ptr, key_ranges, "prefix_tree_fwd")
    q, k, v = _lastdim(q), _lastdim(k), _lastdim(v)
    t, h, d, h_kv, d_pad, prec = _prep(q, k, v)
    out = torch.empty_like(q)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    group = h // h_kv
    cfg = _cfg("fwd", d_pad, q.dtype, config, group)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pack = next_pow2(group) if cfg.get("PACK") and group > 1 else 1
    cu, kptr, klo, khi = _bounded(cu_seqlens, key_range_ptr, key_ranges, t)
    wseg, wblk, w = _work_table(cu, bm, t, _context_tokens(kptr, klo, khi), +1)
    kd, vd = _tma_descriptors(k, v, bn) if cfg.get("TMA") else (None, None)
    _tree_fwd_kernel[(w * (h_kv if pack > 1 else h),)](
        q, k, v, out, lse, cu, kptr, klo, khi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        t, h, group, scale * LOG2E,
        D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, PACK=pack, EVEN_D=(d == d_pad), PREC=prec, SCALE_POS=scale > 0,
        KD=kd, VD=vd, TMA=kd is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


def prefix_tree_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens: torch.Tensor, key_range_ptr: torch.Tensor,
                    key_ranges: torch.Tensor, query_range_ptr: torch.Tensor, query_ranges: torch.Tensor,
                    scale: float, dlse: Optional[torch.Tensor] = None, *, config: Optional[dict] = None):
    """Triton prefix-tree backward, bitwise deterministic (every gradient element has one owner program).

    Args:
        do: ``(T, H, D)`` gradient of ``out``; q, k, v, out, cu_seqlens, key_range_ptr, key_ranges, scale as in
            :func:`prefix_tree_fwd`; lse: fp32 ``(H, T)`` from the forward.
        query_range_ptr: int32 ``(N+1,)``; query_ranges: int32 ``(RQ, 2)`` (the descendants as token ranges).
        dlse: optional fp32 ``(H, T)`` gradient of ``lse`` (enters as ``Delta = rowsum(dO∘O) - dLSE``).
        config: optional ``{"dq": {...}, "dkdv": {...}}`` (keys as ``kernels/dualkv.py``'s; dkdv's ``BLOCK_N`` a
            multiple of its ``BLOCK_M``).

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of q, k, v: an ancestor's dK/dV include every descendant's
        queries.

    Raises:
        ValueError: as :func:`prefix_tree_fwd`; a dkdv ``BLOCK_N`` that is not a multiple of its ``BLOCK_M``.
    """
    check_launch(q, k, v, cu_seqlens, key_range_ptr, key_ranges, "prefix_tree_bwd")
    check_launch(q, k, v, cu_seqlens, query_range_ptr, query_ranges, "prefix_tree_bwd")
    q, k, v, out, do = (_lastdim(x) for x in (q, k, v, out, do))
    t, h, d, h_kv, d_pad, prec = _prep(q, k, v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if t == 0:
        return dq, dk, dv
    group = h // h_kv
    lse = lse.contiguous()
    delta = torch.empty((h, t), dtype=torch.float32, device=q.device)
    bmd = 32 if _interpreting() else 64
    has_dlse = dlse is not None
    _bwd_delta_kernel[(triton.cdiv(t, bmd), h)](
        out, do, dlse.contiguous().float() if has_dlse else delta, delta, out.stride(0), out.stride(1),
        do.stride(0), do.stride(1), t, D=d, D_PAD=d_pad, BLOCK_M=bmd, HAS_DLSE=has_dlse)
    cu, kptr, klo, khi = _bounded(cu_seqlens, key_range_ptr, key_ranges, t)
    _, qptr, qlo, qhi = _bounded(cu_seqlens, query_range_ptr, query_ranges, t)

    cfg = _cfg("dq", d_pad, q.dtype, config, group)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pack = next_pow2(group) if cfg.get("PACK") and group > 1 else 1
    wseg, wblk, w = _work_table(cu, bm, t, _context_tokens(kptr, klo, khi), +1)
    kd, vd = _tma_descriptors(k, v, bn) if cfg.get("TMA") else (None, None)
    _tree_dq_kernel[(w * (h_kv if pack > 1 else h),)](
        q, k, v, do, dq, lse, delta, cu, kptr, klo, khi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1), t, h, group, scale * LOG2E, scale,
        D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, EVEN_D=(d == d_pad), PREC=prec, PACK=pack, KD=kd, VD=vd,
        TMA=kd is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    cfg = _cfg("dkdv", d_pad, q.dtype, config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if bn % bm:
        raise ValueError(f"dkdv launch config: BLOCK_N ({bn}) must be a multiple of BLOCK_M ({bm})")
    wseg, wblk, w = _work_table(cu, bn, t, _context_tokens(qptr, qlo, qhi), -1)
    qd, dod = _tma_descriptors(q, do, bm) if cfg.get("TMA") else (None, None)
    _tree_dkdv_kernel[(w * h_kv,)](
        q, k, v, do, dk, dv, lse, delta, cu, qptr, qlo, qhi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), t, h_kv, group, scale * LOG2E, scale,
        D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, EVEN_D=(d == d_pad), PREC=prec, QD=qd, DOD=dod,
        TMA=qd is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dq, dk, dv
