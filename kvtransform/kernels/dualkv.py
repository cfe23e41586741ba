"""DualKV attention: Triton forward and deterministic Triton backward (the plain-PyTorch reference, re-exported
here, is in ``kernels/dualkv_reference.py``).

Packed shared-prefix layout (``kvtransform.layout``): segments ``[cu_seqlens[s], cu_seqlens[s+1])`` ordered group by
group (prefix, then its responses); ``segment_prefix[s]`` is the prefix segment of response ``s`` (``-1`` for a
prefix). A query of a prefix attends causally within its prefix; query ``r`` of a response attends to the whole
prefix of its group plus tokens ``0..r`` of its own response. Source: DualKV (arXiv 2605.15422, §2–3); the paper's
kernel is CUDA with fp32 atomics in the backward; this one is Triton and bitwise deterministic.

Kernels (one launch each, covering every group and segment):

* forward ``_fwd_kernel``: one program per (query block, query head) (or per query block and KV head with the GQA
  group packed, config ``PACK``), taken from a work table built on the device from ``cu_seqlens`` (heaviest blocks
  first; two small planning kernels, no host sync, no sort). Keys are visited in two phases: the group's prefix (a "context" range,
  unmasked except its last block) for response queries, then the query's own segment (unmasked blocks below the
  diagonal, masked diagonal block). Online softmax in fp32 (exp2), output and natural-log LSE.
* backward: ``_bwd_delta_kernel`` (``Delta = rowsum(dO∘O) - dLSE``), ``_bwd_dq_kernel`` (one program per query block
  and head, same key ranges as the forward) and ``_bwd_dkdv_kernel`` (one program per key block and KV head; it loops
  over the ``H/H_kv`` query heads that read the KV head and over every query that sees the key block: the causal
  queries of its own segment and, for a prefix key block, every response query of its group, which lie contiguously
  after the prefix). Each output element is owned by exactly one program and accumulated in fp32 registers in a fixed
  order, so gradients are bitwise reproducible (no atomics).

GQA: query head ``h`` reads KV head ``h // (H // H_kv)``; K/V are never copied. Head dims up to 256 are padded to the
next power of two with masks. fp16/bf16 use the tensor cores with fp32 accumulation; fp32 inputs use IEEE fp32 dots.

The tile bodies (shared with the prefix-tree kernels, which are these kernels with ``CSR`` context ranges) and the
attention variants (sliding window with block skipping, logit soft-capping, sinks; each behind a ``tl.constexpr``,
so the default compiles to the code without them) are in ``kernels/attention_tiles.py``; the planning launches in
``kernels/dualkv_plan.py``. :func:`launch_fwd` / :func:`launch_bwd` are the host launchers both layouts use.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


from ._common import dot_precision, next_pow2
from ._common import interpreting as _interpreting  # kvtransform.ops.dualkv reads it from here
from .dualkv_reference import dualkv_attention_reference, dualkv_attention_reference_backward  # the CPU path


from .dualkv_plan import LAYOUT_ASSERT_MSG, plan_layout as _plan_layout, plan_work as _plan_work  # noqa: E402,F401
from .attention_tiles import (LOG2E, LN2, _bwd_delta_kernel, _dkdv_desc_range, _dkdv_own,  # noqa: F401
                              _dq_ctx, _dq_ctx_ranges, _dq_own, _fwd_ctx, _fwd_ctx_ranges, _fwd_own, _fwd_store,
                              _query_rows, _row_positions, sinks_grad, variant_args, variant_tables)


# ====================================================================================================== kernels
@triton.jit
def _work_entry(WSEG, H, GROUP, PACK: tl.constexpr):
    """``(w, u, seg)`` of this program of the forward or dQ kernel: its work-table entry, head unit and segment
    (``seg < 0``: a padding entry, nothing to do)."""
    pid = tl.program_id(0)
    n_units = H // GROUP if PACK > 1 else H
    w = pid // n_units
    return w, pid % n_units, tl.load(WSEG + w)


@triton.jit
def _query_tile(Q, WBLK, CU, POS, w, u, seg, stride_qt, stride_qh, GROUP, D: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr, EVEN_D: tl.constexpr,
                WINDOW: tl.constexpr):
    """The query tile of work entry ``w`` (segment ``seg``, head unit ``u``) as the forward and dQ kernels take it:
    the segment's bounds, :func:`_query_rows`' rows, the key and head-dim offsets, the rows' load mask, int64 token
    rows and query heads, the Q tile and :func:`_row_positions`' positions."""
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + seg)
    se = tl.load(CU + seg + 1)
    hk, q_start, offs_m, head, rm = _query_rows(u, blk, ss, se, GROUP, BLOCK_M, PACK)
    offs_d = tl.arange(0, D_PAD)
    qm = rm[:, None]
    if not EVEN_D:
        qm = qm & (offs_d[None, :] < D)
    row = offs_m.to(tl.int64)
    hrow = head.to(tl.int64)
    q = tl.load(Q + (row * stride_qt + hrow * stride_qh)[:, None] + offs_d[None, :], mask=qm, other=0.0)
    qpos, qmin, qmax = _row_positions(POS, offs_m, rm, q_start, se, BLOCK_M, WINDOW)
    return ss, se, hk, q_start, offs_m, head, rm, tl.arange(0, BLOCK_N), offs_d, qm, row, hrow, q, qpos, qmin, qmax


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU, KCTX_LO, KCTX_HI, WSEG, WBLK,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                T, H, GROUP, qk_scale,
                D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PACK: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr = False,
                KD=None, VD=None, TMA: tl.constexpr = False, KPTR=None, KNXT=None, POS=None, SINKS=None, window=0,
                cap2=1.0, CSR: tl.constexpr = False, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                HAS_SINKS: tl.constexpr = False, FAST_TANH: tl.constexpr = False):
    """One program per (work entry, head unit): ``PACK == 1``: one query head, ``BLOCK_M`` query tokens;
    ``PACK > 1`` (a power of two >= GROUP): every query head of one KV head (the GQA group, rows ``j * BLOCK_M + i``
    = head ``j``, token ``i``; rows of heads ``j >= GROUP`` are padding), so K/V blocks are loaded once for the
    group and the tile has ``PACK * BLOCK_M`` rows. ``TMA``: K/V blocks through the host-built tensor descriptors
    ``KD``/``VD`` (2-D ``(T, H_kv*D)`` views, blocks ``(BLOCK_N, D)``). Context keys: the one range ``[KCTX_LO[s],
    KCTX_HI[s])`` of segment ``s``, or with ``CSR`` (the prefix tree) the ranges ``KPTR[s]..KPTR[s+1]`` of
    ``KCTX_LO``/``KCTX_HI``. The variants (``WINDOW``, ``SOFTCAP``, ``HAS_SINKS``): ``kernels/attention_tiles.py``."""
    w, u, seg = _work_entry(WSEG, H, GROUP, PACK)
    if seg < 0:
        return
    (ss, se, hk, q_start, offs_m, head, rm, offs_n, offs_d, qm, row, hrow, q, qpos, qmin,
     qmax) = _query_tile(Q, WBLK, CU, POS, w, u, seg, stride_qt, stride_qh, GROUP, D, D_PAD, BLOCK_M, BLOCK_N, PACK,
                         EVEN_D, WINDOW)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    m_i = tl.full([PACK * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([PACK * BLOCK_M], tl.float32)
    acc = tl.zeros([PACK * BLOCK_M, D_PAD], tl.float32)
    # the context (a response's prefix; a node's ancestors, root first), then the own segment causally
    if CSR and not WINDOW:
        acc, l_i, m_i = _fwd_ctx_ranges(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                                        offs_d, KCTX_LO, KCTX_HI, KNXT, tl.load(KPTR + seg), tl.load(KPTR + seg + 1),
                                        qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, PREC, SCALE_POS, SOFTCAP,
                                        FAST_TANH, KD, VD, hk * D, TMA)
    elif CSR:
        for r in range(tl.load(KPTR + seg), tl.load(KPTR + seg + 1)):
            acc, l_i, m_i = _fwd_ctx(acc, l_i, m_i, q, offs_m, qpos, qmin, qmax, k_base, v_base, stride_kt, stride_vt,
                                     offs_n, offs_d, tl.load(KCTX_LO + r), tl.load(KCTX_HI + r), qk_scale, cap2, POS,
                                     window, D, BLOCK_N, EVEN_D, PREC, SCALE_POS, WINDOW, SOFTCAP, FAST_TANH, KD, VD,
                                     hk * D, TMA)
    else:
        acc, l_i, m_i = _fwd_ctx(acc, l_i, m_i, q, offs_m, qpos, qmin, qmax, k_base, v_base, stride_kt, stride_vt,
                                 offs_n, offs_d, tl.load(KCTX_LO + seg), tl.load(KCTX_HI + seg), qk_scale, cap2, POS,
                                 window, D, BLOCK_N, EVEN_D, PREC, SCALE_POS, WINDOW, SOFTCAP, FAST_TANH, KD, VD,
                                 hk * D, TMA)
    acc, l_i, m_i = _fwd_own(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, ss,
                             se, q_start, qk_scale, cap2, POS, window, D, BLOCK_M, BLOCK_N, EVEN_D, PREC, SCALE_POS,
                             WINDOW, SOFTCAP, FAST_TANH, KD, VD, hk * D, TMA)
    _fwd_store(acc, l_i, m_i, offs_m, head, rm, qm, offs_d, O, LSE, SINKS, stride_ot, stride_oh, T, HAS_SINKS)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, CU, KCTX_LO, KCTX_HI, WSEG, WBLK,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dqt, stride_dqh, T, H, GROUP, qk_scale, sm_scale,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   EVEN_D: tl.constexpr, PREC: tl.constexpr, PACK: tl.constexpr = 1, KD=None, VD=None,
                   TMA: tl.constexpr = False, KPTR=None, KNXT=None, POS=None, window=0, cap2=1.0,
                   CSR: tl.constexpr = False, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                   FAST_TANH: tl.constexpr = False,
                   RSUM=None, HAS_SINKS: tl.constexpr = False):
    """One program per (work entry, head unit), the forward's tiling and key ranges (:func:`_fwd_kernel`: ``PACK >
    1`` packs the GQA group's query heads into one tile so K/V blocks are loaded once for the group; ``TMA`` loads
    them through tensor descriptors; ``CSR`` the tree's context ranges). Each dQ row has one owner program: no
    atomics. ``HAS_SINKS``: each row's fp32 ``rowsum(P * dP)`` is also stored in ``RSUM`` ``(H, T)`` (the sinks'
    gradient, ``attention_tiles.sinks_grad``)."""
    w, u, seg = _work_entry(WSEG, H, GROUP, PACK)
    if seg < 0:
        return
    (ss, se, hk, q_start, offs_m, head, rm, offs_n, offs_d, qm, row, hrow, q, qpos, qmin,
     qmax) = _query_tile(Q, WBLK, CU, POS, w, u, seg, stride_qt, stride_qh, GROUP, D, D_PAD, BLOCK_M, BLOCK_N, PACK,
                         EVEN_D, WINDOW)
    do = tl.load(DO + (row * stride_dot + hrow * stride_doh)[:, None] + offs_d[None, :], mask=qm, other=0.0)
    lse2 = tl.load(LSE + hrow * T + offs_m, mask=rm, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + hrow * T + offs_m, mask=rm, other=0.0)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    kcol = hk * D
    dq = tl.zeros([PACK * BLOCK_M, D_PAD], tl.float32)
    rsum = tl.zeros([PACK * BLOCK_M], tl.float32)
    if CSR:
        dq, rsum = _dq_ctx_ranges(dq, rsum, q, do, lse2, delta, offs_m, qpos, qmin, qmax, k_base, v_base, stride_kt,
                                  stride_vt, offs_n, offs_d, KCTX_LO, KCTX_HI, KNXT, tl.load(KPTR + seg),
                                  tl.load(KPTR + seg + 1), qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, PREC,
                                  WINDOW, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
    else:
        dq, rsum = _dq_ctx(dq, rsum, q, do, lse2, delta, offs_m, qpos, qmin, qmax, k_base, v_base, stride_kt,
                           stride_vt, offs_n, offs_d, tl.load(KCTX_LO + seg), tl.load(KCTX_HI + seg), qk_scale, cap2,
                           POS, window, D, BLOCK_N, EVEN_D, PREC, WINDOW, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA,
                           HAS_SINKS)
    dq, rsum = _dq_own(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                       offs_d, ss, se, q_start, qk_scale, cap2, POS, window, D, BLOCK_M, BLOCK_N, EVEN_D, PREC, WINDOW,
                       SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
    if HAS_SINKS:
        tl.store(RSUM + hrow * T + offs_m, rsum, mask=rm)
    dq = dq * sm_scale
    tl.store(DQ + (row * stride_dqt + hrow * stride_dqh)[:, None] + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=qm)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, CU, QCTX_LO, QCTX_HI, WSEG, WBLK,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dkt, stride_dkh, stride_dvt, stride_dvh, T, H_KV, GROUP, qk_scale, sm_scale,
                     D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN_D: tl.constexpr, PREC: tl.constexpr, QD=None, DOD=None, TMA: tl.constexpr = False,
                     QPTR=None, POS=None, NODE_OF=None, S=0, window=0, cap2=1.0, CSR: tl.constexpr = False,
                     WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, FAST_TANH: tl.constexpr = False):
    """One program per (work entry = BLOCK_N keys of one segment, KV head): dK/dV over every query head of the GQA
    group and every query that sees these keys (its own segment's, causally; then the context query range: a
    prefix's responses, contiguous after it, or with ``CSR`` the tree's descendant ranges ``QPTR[s]..QPTR[s+1]``);
    each dK/dV row has one owner program (no atomics). ``TMA``: the Q/dO blocks through host tensor descriptors (2-D
    ``(T, H*D)`` views, blocks ``(BLOCK_M, D)``)."""
    pid = tl.program_id(0)
    w = pid // H_KV
    g = pid % H_KV
    seg = tl.load(WSEG + w)
    if seg < 0:
        return
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + seg)
    se = tl.load(CU + seg + 1)
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
    kpos, kmin, kmax = _row_positions(POS, offs_n, offs_n < se, k_start, se, BLOCK_N, WINDOW)
    dk = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    if CSR:
        r0 = tl.load(QPTR + seg)
        r1 = tl.load(QPTR + seg + 1)
    else:
        cs = tl.load(QCTX_LO + seg)
        ce = tl.load(QCTX_HI + seg)
    for hh in range(0, GROUP):
        h = g * GROUP + hh
        q_base = Q + h * stride_qh
        do_base = DO + h * stride_doh
        lse_base = LSE + h.to(tl.int64) * T
        delta_base = DELTA + h.to(tl.int64) * T
        dk, dv = _dkdv_own(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                           offs_m, offs_d, k_start, se, qk_scale, cap2, POS, window, D, BLOCK_M, BLOCK_N, EVEN_D,
                           PREC, WINDOW, SOFTCAP, FAST_TANH, QD, DOD, h * D, TMA)
        if CSR:
            for r in range(r0, r1):
                dk, dv = _dkdv_desc_range(dk, dv, k, v, offs_n, kpos, kmin, kmax, q_base, do_base, lse_base,
                                          delta_base, stride_qt, stride_dot, offs_m, offs_d, tl.load(QCTX_LO + r),
                                          tl.load(QCTX_HI + r), qk_scale, cap2, POS, window, CU, NODE_OF, S, D,
                                          BLOCK_M, EVEN_D, PREC, WINDOW, SOFTCAP, FAST_TANH, QD, DOD, h * D, TMA)
        else:
            dk, dv = _dkdv_desc_range(dk, dv, k, v, offs_n, kpos, kmin, kmax, q_base, do_base, lse_base, delta_base,
                                      stride_qt, stride_dot, offs_m, offs_d, cs, ce, qk_scale, cap2, POS, window, CU,
                                      NODE_OF, S, D, BLOCK_M, EVEN_D, PREC, WINDOW, SOFTCAP, FAST_TANH, QD, DOD,
                                      h * D, TMA)
    dk = dk * sm_scale
    tl.store(DK + krow * stride_dkt + g * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=km)
    tl.store(DV + krow * stride_dvt + g * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=km)


# ====================================================================================================== launchers
def _default_fwd_cfg(d_pad: int, dtype: torch.dtype, group: int = 1):
    """Forward launch config (``group``: query heads per KV head). Chosen so that ptxas reports no spills for sm_90
    at D=128 (bf16)."""
    if _interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2) if d_pad <= 128 else \
            dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if d_pad == 128 and group == 4 and dtype == torch.bfloat16:
        # launch-config probe (H200, bf16, GQA 32/8, kernel alone; BENCHMARKS.md, "DualKV attention op"): the 4 query
        # heads of a KV head packed (32 tokens x 4 heads = 128 tile rows) with K/V through tensor descriptors:
        # 557 / 517 TFLOP/s at P=5059 mb=4 / P=8192 mb=16, against 459 / 455 for 128/128/8/3 in the same run; on
        # the bf16 check layouts with odd lengths its output was bitwise equal to 128/128/8/3's. Measured for this
        # group, head_dim and dtype only.
        return dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3, PACK=True, TMA=True)
    if d_pad <= 128:  # H200 sweep (P=8K, N=16, D=128): 128/128/8/3 451 TFLOP/s, 128/64/8/3 425
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def _default_dq_cfg(d_pad: int, dtype: torch.dtype, group: int = 1):
    """dQ launch config (``group``: query heads per KV head)."""
    if _interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1) if d_pad <= 128 else \
            dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if d_pad == 128 and group == 4 and dtype == torch.bfloat16:
        # launch-config probe (H200, bf16, GQA 32/8, kernel alone; BENCHMARKS.md, "DualKV attention op"): the forward's
        # packed GQA-4 tiling with TMA K/V, 1.523 / 8.761 ms at P=5059 mb=4 / P=8192 mb=16 against 1.812 / 9.872
        # for 128/64/8/3 (dQ bitwise equal to it); measured for this group, head_dim and dtype only
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=3, PACK=True, TMA=True)
    if d_pad <= 128:  # H200 sweep: 128/64/8/3 best of 8
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)


def _default_bwd_cfg(d_pad: int, dtype: torch.dtype):
    """dK/dV launch config (BLOCK_N keys per program, BLOCK_M queries per step).

    The kernel computes the (BLOCK_N, BLOCK_M) products with K and V as the A operands. A variant with K and V as
    B operands (transposed P and dS as A operands) was dropped: on the H200 with triton 3.6 it gave wrong,
    run-to-run different dK at P=8K (BENCHMARKS.md, "DualKV attention op") and was slower anyway."""
    if _interpreting():
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)
    if d_pad == 128 and dtype == torch.bfloat16:
        # launch-config sweeps (GQA 32/8; BENCHMARKS.md, "DualKV attention op"): Q/dO through tensor
        # descriptors, 2 stages; 64 keys with 4 warps (two programs share an SM, ~99 KB of shared memory each, so one
        # program's softmax phase overlaps the other's MMAs) beat 128 keys with 8 warps by 4-7 % for the whole
        # backward (plain and soft-capped)
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, TMA=True)
    if d_pad <= 128:  # H200 sweep (P=8K, N=16, D=128): 64/128/8/3 best of 13
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3)
    return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)


KERNELS = ("fwd", "dq", "dkdv")


def _cfg(kind: str, d_pad: int, dtype: torch.dtype, config: Optional[dict] = None, group: int = 1) -> dict:
    """Launch config of one kernel (``kind`` in :data:`KERNELS`): the default for ``(d_pad, dtype)`` (the forward's
    and dQ's also for the GQA ``group``), updated with ``config[kind]`` (keys ``BLOCK_M``, ``BLOCK_N``,
    ``num_warps``, ``num_stages``, ``TMA``, forward and dQ also ``PACK``) when given. A given config starts from the
    unpacked default without TMA (``PACK``/``TMA`` off unless it sets them: a 128-token tile packed 4× would be 512
    rows)."""
    own = bool(config and config.get(kind))
    base = dict(_default_fwd_cfg(d_pad, dtype, 1 if own else group) if kind == "fwd" else
                _default_dq_cfg(d_pad, dtype, 1 if own else group) if kind == "dq" else
                _default_bwd_cfg(d_pad, dtype))
    if own:
        base.pop("TMA", None)
    if config:
        unknown = set(config) - set(KERNELS)
        if unknown:
            raise ValueError(f"launch config: unknown kernel(s) {sorted(unknown)}; expected keys among {KERNELS}")
        given = config.get(kind)
        base.update(given if isinstance(given, dict) else {})
    for key in ("BLOCK_M", "BLOCK_N"):
        b = base[key]
        if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{kind} launch config: {key}={b!r} must be a power of two >= 16 (tl.dot's minimum)")
    return base


def _prep(q, k, v):
    t, h, d = q.shape
    h_kv = k.shape[1]
    d_pad = next_pow2(d, 16)
    prec = dot_precision(q.dtype)
    return t, h, d, h_kv, d_pad, prec


def _lastdim_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _tma_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int):
    """Host tensor descriptors of two ``(T, heads, D)`` tensors (K and V, or Q and dO) as 2-D ``(T, heads*D)`` views
    with ``(block_n, D)`` blocks, or ``(None, None)`` where the bulk tensor copy cannot address them (head dim not a
    power of two >= 16, heads not contiguous, rows or the base not 16-byte aligned, or no descriptor support in this
    Triton)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - older Triton
        return None, None
    t, h_kv, d = k.shape
    es = k.element_size()
    for x in (k, v):
        if (d != next_pow2(d, 16) or x.stride(2) != 1 or x.stride(1) != d or (x.stride(0) * es) % 16
                or x.data_ptr() % 16):
            return None, None
    return tuple(TensorDescriptor(x.as_strided((t, h_kv * d), (x.stride(0), 1)), [t, h_kv * d], [x.stride(0), 1],
                                  [block_n, d]) for x in (k, v))


def _only(kernel, kwargs: dict) -> dict:
    """The entries of ``kwargs`` that ``kernel`` takes."""
    return {key: val for key, val in kwargs.items() if key in kernel.arg_names}


def _variants(q, cu, ctx_tokens, scale, window, softcap, sinks) -> dict:
    """Kernel arguments of the attention variants (``kernels/attention_tiles.py``), the window's position tables
    built on the device only when a window is given. A window above T is T: the same keys (no position on a
    sequence of T tokens is T behind another), and the kernels' int32 bounds (position + window) cannot wrap."""
    if window is not None:
        window = min(int(window), max(1, q.shape[0]))
    va = variant_args(scale, q.dtype, window, softcap, sinks, _interpreting())
    pos = node_of = None
    if window is not None:
        pos, node_of = variant_tables(cu, ctx_tokens(), q.shape[0])
    va.update(POS=pos, NODE_OF=node_of, S=cu.numel() - 1)
    return va


def launch_fwd(q, k, v, cu, kctx_lo, kctx_hi, kptr, ctx_tokens, plan, scale, config, window=None, softcap=None,
               sinks=None, ranges_next=None):
    """The forward launch shared by :func:`dualkv_fwd` and ``kernels/prefix_tree.py``'s: ``cu`` the bounded
    offsets, ``kctx_lo``/``kctx_hi`` the context key ranges (one per segment, or with ``kptr`` the CSR ranges of the
    tree), ``ctx_tokens()`` the context tokens per segment (int ``(S,)``; called only with a window),
    ``plan(block, sign)`` the work table
    ``(seg, blk, entries)``, ``ranges_next(block)`` the tree's whole-block walk table
    (``attention_tiles.whole_range_next`` of the context ranges; with ``kptr``). Returns ``(out, lse)``."""
    q, k, v = _lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v)
    t, h, d, h_kv, d_pad, prec = _prep(q, k, v)
    out = torch.empty_like(q)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    group = h // h_kv
    cfg = _cfg("fwd", d_pad, q.dtype, config, group)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pack = next_pow2(group) if cfg.get("PACK") and group > 1 else 1
    wseg, wblk, w = plan(bm, +1)
    kd, vd = _tma_descriptors(k, v, bn) if cfg.get("TMA") else (None, None)
    va = _variants(q, cu, ctx_tokens, scale, window, softcap, sinks)
    knxt = None if kptr is None else ranges_next(bn)
    _fwd_kernel[(w * (h_kv if pack > 1 else h),)](
        q, k, v, out, lse, cu, kctx_lo, kctx_hi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        t, h, group, va.pop("qk_scale"),
        D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, PACK=pack, EVEN_D=(d == d_pad), PREC=prec, KD=kd, VD=vd,
        TMA=kd is not None, KPTR=kptr, KNXT=knxt, CSR=kptr is not None, **_only(_fwd_kernel, va),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out, lse


def launch_bwd(do, q, k, v, out, lse, dlse, cu, kctx_lo, kctx_hi, kptr, qctx_lo, qctx_hi, qptr, ctx_tokens, plan,
               scale, config, window=None, softcap=None, sinks=None, ranges_next=None):
    """The backward launches shared by :func:`dualkv_bwd` and ``kernels/prefix_tree.py``'s (arguments as
    :func:`launch_fwd`'s; ``qctx_lo``/``qctx_hi`` (``qptr``) the context query ranges that see a segment's keys):
    ``Delta``, dQ (with sinks also each row's exact fp32 Delta for the sinks' gradient), dK/dV, and the sinks'
    gradient. Returns ``(dq, dk, dv, dsinks or None)``."""
    q, k, v, out, do = (_lastdim_contig(x) for x in (q, k, v, out, do))
    t, h, d, h_kv, d_pad, prec = _prep(q, k, v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if t == 0:
        return dq, dk, dv, (None if sinks is None else torch.zeros_like(sinks))
    group = h // h_kv
    lse = lse.contiguous()
    delta = torch.empty((h, t), dtype=torch.float32, device=q.device)
    bmd = 32 if _interpreting() else 64
    has_dlse = dlse is not None
    _bwd_delta_kernel[(triton.cdiv(t, bmd), h)](
        out, do, dlse.contiguous().float() if has_dlse else delta, delta, out.stride(0), out.stride(1),
        do.stride(0), do.stride(1), t, D=d, D_PAD=d_pad, BLOCK_M=bmd, HAS_DLSE=has_dlse)
    va = _variants(q, cu, ctx_tokens, scale, window, softcap, sinks)
    qk_scale = va.pop("qk_scale")
    common = dict(D=d, D_PAD=d_pad, EVEN_D=(d == d_pad), PREC=prec)

    cfg = _cfg("dq", d_pad, q.dtype, config, group)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pack = next_pow2(group) if cfg.get("PACK") and group > 1 else 1
    wseg, wblk, w = plan(bm, +1)
    kd, vd = _tma_descriptors(k, v, bn) if cfg.get("TMA") else (None, None)
    rsum = None if sinks is None else torch.empty((h, t), dtype=torch.float32, device=q.device)
    knxt = None if kptr is None else ranges_next(bn)
    _bwd_dq_kernel[(w * (h_kv if pack > 1 else h),)](
        q, k, v, do, dq, lse, delta, cu, kctx_lo, kctx_hi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1), t, h, group, qk_scale, scale, BLOCK_M=bm, BLOCK_N=bn, PACK=pack, KD=kd, VD=vd,
        TMA=kd is not None, KPTR=kptr, KNXT=knxt, CSR=kptr is not None, RSUM=rsum, **common,
        **_only(_bwd_dq_kernel, va),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    cfg = _cfg("dkdv", d_pad, q.dtype, config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if bn % bm:
        raise ValueError(f"dkdv launch config: BLOCK_N ({bn} keys per program) must be a multiple of BLOCK_M ({bm} "
                         f"queries per step); e.g. BLOCK_M={bm} BLOCK_N={bm * max(1, bn // bm)}")
    wseg, wblk, w = plan(bn, -1)
    qd, dod = _tma_descriptors(q, do, bm) if cfg.get("TMA") else (None, None)
    _bwd_dkdv_kernel[(w * h_kv,)](
        q, k, v, do, dk, dv, lse, delta, cu, qctx_lo, qctx_hi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), t, h_kv, group, qk_scale, scale, BLOCK_M=bm,
        BLOCK_N=bn, QD=qd, DOD=dod, TMA=qd is not None, QPTR=qptr, CSR=qptr is not None, **common,
        **_only(_bwd_dkdv_kernel, va), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dq, dk, dv, (None if sinks is None else sinks_grad(sinks, lse, rsum, dlse))


def _dualkv_plan(cu_seqlens, segment_prefix, t, assert_layout):
    """``(cub, ctx, plan)`` of a DualKV layout for :func:`launch_fwd` / :func:`launch_bwd`."""
    cub, ctx = _plan_layout(cu_seqlens, segment_prefix, t, assert_layout)

    def plan(block, sign):
        return _plan_work(cub, ctx[0], ctx[1], block, t, +1) if sign > 0 else \
            _plan_work(cub, ctx[2], ctx[3], block, t, -1)

    return cub, ctx, plan


def dualkv_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               segment_prefix: torch.Tensor, scale: float, *, config: Optional[dict] = None,
               assert_layout: bool = False, window: Optional[int] = None, softcap: Optional[float] = None,
               sinks: Optional[torch.Tensor] = None):
    """Triton DualKV forward (one launch for every group and segment).

    Args:
        q: ``(T, H, D)`` fp16/bf16/fp32, last dim contiguous (copied if not); k, v: ``(T, H_kv, D)``, same dtype.
        cu_seqlens: int32 ``(S+1,)``; segment_prefix: int32 ``(S,)``; both on q's device. Their values are not
            validated here (``kvt::dualkv_attention`` does that) but clamped (as ``bounded_layout`` in
            ``kernels/dualkv_reference.py``): an inconsistent layout never makes the kernels touch memory outside q,
            k, v, out and lse.
        scale: softmax scale.
        config: optional launch config ``{"fwd": {"BLOCK_M": .., "BLOCK_N": .., "num_warps": .., "num_stages": ..,
            "PACK": .., "TMA": ..}}`` (any subset of the keys; ``BLOCK_M`` query tokens per program; ``PACK`` true:
            one program covers every query head of a KV head, ``next_pow2(H/H_kv) * BLOCK_M`` tile rows; ``TMA``
            true: K/V blocks through tensor descriptors where :func:`_kv_descriptors` allows); the defaults
            otherwise (tuned on an H200).
        assert_layout: ``torch._assert_async`` the layout's consistency (``kvt::dualkv_attention`` on CUDA: the check
            comes from the planning kernel, no extra launches).
        window, softcap, sinks: the attention variants (``kernels/attention_tiles.py``; checked by the op, not here):
            int >= 1, float > 0, ``(H,)`` float tensor on q's device.

    Returns:
        ``(out, lse)``: out ``(T, H, D)`` in q.dtype; lse fp32 ``(H, T)``, natural log (the sink term included).
    """
    t = q.shape[0]
    cub, ctx, plan = _dualkv_plan(cu_seqlens, segment_prefix, t, assert_layout)
    return launch_fwd(q, k, v, cub, ctx[0], ctx[1], None, lambda: ctx[1] - ctx[0], plan, scale, config, window,
                      softcap, sinks)


def dualkv_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, scale: float,
               dlse: Optional[torch.Tensor] = None, *, config: Optional[dict] = None, assert_layout: bool = False,
               window: Optional[int] = None, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
    """Triton DualKV backward, bitwise deterministic (no atomics; every gradient element has one owner program).

    Args:
        do: ``(T, H, D)`` gradient of ``out``; q, k, v, out as in :func:`dualkv_fwd`; lse: fp32 ``(H, T)`` from the
            forward; cu_seqlens, segment_prefix, scale as in :func:`dualkv_fwd`.
        dlse: optional fp32 ``(H, T)`` gradient of ``lse`` (enters as ``Delta = rowsum(dO∘O) - dLSE``).
        config: optional launch configs ``{"dq": {...}, "dkdv": {...}}`` as :func:`dualkv_fwd`'s (dq: the forward's
            tiling, ``PACK`` and ``TMA`` included; dkdv: ``BLOCK_N`` keys per program, ``BLOCK_N % BLOCK_M == 0``).
        assert_layout: as :func:`dualkv_fwd`'s.
        window, softcap, sinks: as the forward's.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of q, k, v (with ``sinks``: also ``dsinks`` ``(H,)``, a fixed-order
        reduction of each row's fp32 ``rowsum(P * dP) - dLSE`` from the dQ kernel); the shared prefix's dK/dV
        include the contributions of every response of its group plus its own causal part.
    """
    t = q.shape[0]
    cub, ctx, plan = _dualkv_plan(cu_seqlens, segment_prefix, t, assert_layout)
    dq, dk, dv, dsinks = launch_bwd(do, q, k, v, out, lse, dlse, cub, ctx[0], ctx[1], None, ctx[2], ctx[3], None,
                                    lambda: ctx[1] - ctx[0], plan, scale, config, window, softcap, sinks)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


__all__ = ["dualkv_fwd", "dualkv_bwd", "launch_fwd", "launch_bwd", "dualkv_attention_reference",
           "dualkv_attention_reference_backward", "KERNELS", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]
