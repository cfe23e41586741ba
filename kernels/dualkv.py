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
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


from ._common import dot_precision, next_pow2
from ._common import interpreting as _interpreting  # kvtransform.ops.dualkv reads it from here
from .dualkv_reference import dualkv_attention_reference, dualkv_attention_reference_backward  # the CPU path


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _plan_layout_kernel(CU, SP, CUB, CTX, OK, S, T, SB: tl.constexpr):
    """One program: the layout as the kernels use it (what ``bounded_layout`` and ``segment_tables`` of
    ``kernels/dualkv_reference.py`` compute with ~30 small torch ops): ``CUB`` (S+1) = running max of ``cu_seqlens``
    clamped into ``[0, T]``; ``CTX`` (4, S) int32 rows = ``kctx_lo, kctx_hi, qctx_lo, qctx_hi`` (row 3 first holds the
    group ends, a deterministic integer atomic max); ``OK`` (1,) = :func:`kvtransform.layout.structure_ok` of the raw
    offsets (1 or 0)."""
    carry = 0
    latest = -1
    bad = 0
    for c in range(0, S + 1, SB):
        s = c + tl.arange(0, SB)
        m = s < S + 1
        raw = tl.load(CU + s, mask=m, other=0)
        ms = s < S
        nxt = tl.load(CU + s + 1, mask=ms, other=0)
        sp = tl.load(SP + s, mask=ms, other=-1)
        own = tl.maximum(tl.associative_scan(tl.where(ms & (sp == -1), s, -1), 0, _max_combine), latest)
        wrong = (ms & (nxt <= raw)) | ((s == 0) & (raw != 0)) | ((s == S) & (raw != T)) | (ms & (sp != -1) & (sp != own))
        bad = tl.maximum(bad, tl.max(wrong.to(tl.int32), 0))
        latest = tl.maximum(latest, tl.max(own, 0))
        x = tl.minimum(tl.maximum(raw, 0), T)
        x = tl.maximum(tl.associative_scan(x, 0, _max_combine), carry)
        tl.store(CUB + s, x, mask=m)
        tl.store(CTX + 3 * S + s, tl.zeros([SB], tl.int32), mask=ms)
        carry = tl.maximum(carry, tl.max(x, 0))
    tl.store(OK, 1 - bad)
    tl.debug_barrier()
    for c in range(0, S, SB):
        s = c + tl.arange(0, SB)
        m = s < S
        sp = tl.minimum(tl.maximum(tl.load(SP + s, mask=m, other=-1), -1), S - 1)
        owner = tl.where(sp >= 0, sp, s)
        tl.atomic_max(CTX + 3 * S + owner, tl.load(CUB + s + 1, mask=m, other=0), mask=m)
    tl.debug_barrier()
    for c in range(0, S, SB):
        s = c + tl.arange(0, SB)
        m = s < S
        sp = tl.minimum(tl.maximum(tl.load(SP + s, mask=m, other=-1), -1), S - 1)
        resp = sp >= 0
        p = tl.maximum(sp, 0)
        tl.store(CTX + s, tl.where(resp, tl.load(CUB + p, mask=m, other=0), 0), mask=m)
        tl.store(CTX + S + s, tl.where(resp, tl.load(CUB + p + 1, mask=m, other=0), 0), mask=m)
        tl.store(CTX + 2 * S + s, tl.where(resp, 0, tl.load(CUB + s + 1, mask=m, other=0)), mask=m)
        gend = tl.load(CTX + 3 * S + s, mask=m, other=0)
        tl.store(CTX + 3 * S + s, tl.where(resp, 0, gend), mask=m)


@triton.jit
def _plan_work_kernel(CUB, CTX_LO, CTX_HI, WSEG, WBLK, S, W, BLOCK, SIGN: tl.constexpr, JB: tl.constexpr,
                      SB: tl.constexpr):
    """The work table of ``work_table`` (``kernels/dualkv_reference.py``) without a sort: job ``i`` (blocks of every
    segment in layout order) is written at its rank = jobs of higher cost + jobs of equal cost and lower index, counted
    per segment in closed form (costs within a segment are an arithmetic sequence). Each program places ``JB`` jobs;
    unused entries keep their index and get ``seg = -1``."""
    i = tl.program_id(0) * JB + tl.arange(0, JB)
    seg = tl.zeros([JB], tl.int32)
    bstart = tl.zeros([JB], tl.int32)
    carry = 0
    for c in range(0, S, SB):
        s = c + tl.arange(0, SB)
        m = s < S
        nb = tl.where(m, (tl.load(CUB + s + 1, mask=m, other=0) - tl.load(CUB + s, mask=m, other=0) + BLOCK - 1)
                      // BLOCK, 0)
        incl = carry + tl.cumsum(nb, 0)
        excl = incl - nb
        hit = (excl[None, :] <= i[:, None]) & (i[:, None] < incl[None, :])
        seg += tl.sum(tl.where(hit, s[None, :], 0), 1)
        bstart += tl.sum(tl.where(hit, excl[None, :], 0), 1)
        carry += tl.sum(nb, 0)
    valid = i < carry
    blk = i - bstart
    ln = tl.load(CUB + seg + 1, mask=valid, other=0) - tl.load(CUB + seg, mask=valid, other=0)
    ctx = tl.load(CTX_HI + seg, mask=valid, other=0) - tl.load(CTX_LO + seg, mask=valid, other=0)
    if SIGN > 0:
        cost = ctx + (blk + 1) * BLOCK
    else:
        cost = ctx + ln - blk * BLOCK
    rank = tl.zeros([JB], tl.int32)
    carry = 0
    for c in range(0, S, SB):
        s = c + tl.arange(0, SB)
        m = s < S
        lo = tl.load(CUB + s, mask=m, other=0)
        hi = tl.load(CUB + s + 1, mask=m, other=0)
        nb = tl.where(m, (hi - lo + BLOCK - 1) // BLOCK, 0)
        excl = carry + tl.cumsum(nb, 0) - nb
        cx = tl.load(CTX_HI + s, mask=m, other=0) - tl.load(CTX_LO + s, mask=m, other=0)
        if SIGN > 0:  # cost(b) = cx + (b+1)*BLOCK
            x = cost[:, None] - cx[None, :]
            q = tl.where(x > 0, x // BLOCK, 0)
            gt = nb[None, :] - tl.minimum(q, nb[None, :])
            beq = q - 1
            eq = (x > 0) & (x % BLOCK == 0) & (beq < nb[None, :]) & (excl[None, :] + beq < i[:, None])
        else:  # cost(b) = cx + len - b*BLOCK
            x = (cx + hi - lo)[None, :] - cost[:, None]
            q = tl.where(x > 0, x // BLOCK, 0)
            gt = tl.where(x > 0, tl.minimum((x + BLOCK - 1) // BLOCK, nb[None, :]), 0)
            eq = (x >= 0) & (x % BLOCK == 0) & (q < nb[None, :]) & (excl[None, :] + q < i[:, None])
        rank += tl.sum(tl.where(m[None, :], gt + eq.to(tl.int32), 0), 1)
        carry += tl.sum(nb, 0)
    rank = tl.where(valid, rank, i)
    tl.store(WSEG + rank, tl.where(valid, seg, -1), mask=i < W)
    tl.store(WBLK + rank, tl.where(valid, blk, 0), mask=i < W)


LAYOUT_ASSERT_MSG = ("kvt::dualkv_attention: inconsistent cu_seqlens/segment_prefix (cu_seqlens must start at 0, "
                     "increase and end at T = q.shape[0]; segment_prefix must be -1 or the group's prefix)")


def _plan_layout(cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, total_tokens: int,
                 assert_layout: bool = False):
    """``(cu_bounded, ctx)``: the offsets of ``bounded_layout`` and the four ranges of ``segment_tables``
    (``kernels/dualkv_reference.py``; rows of the int32 ``(4, S)`` ``ctx``), in one launch. ``assert_layout``: also
    ``torch._assert_async`` that the raw layout is consistent (:func:`kvtransform.layout.structure_ok`, computed in the
    same launch; no host sync on CUDA)."""
    s = segment_prefix.numel()
    cub = torch.empty(s + 1, dtype=torch.int32, device=cu_seqlens.device)
    ctx = torch.empty((4, s), dtype=torch.int32, device=cu_seqlens.device)
    ok = torch.empty(1, dtype=torch.int32, device=cu_seqlens.device)
    _plan_layout_kernel[(1,)](cu_seqlens.to(torch.int32), segment_prefix.to(torch.int32), cub, ctx, ok, s,
                              total_tokens, SB=min(1024, next_pow2(s + 1, 16)), num_warps=4)
    if assert_layout:
        torch._assert_async(ok[0], LAYOUT_ASSERT_MSG)
    return cub, ctx


def _plan_work(cub: torch.Tensor, ctx_lo: torch.Tensor, ctx_hi: torch.Tensor, block: int, total_tokens: int,
               per_block_sign: int):
    """``work_table`` of ``kernels/dualkv_reference.py`` (same tables) in one launch, from :func:`_plan_layout`'s
    outputs."""
    s = ctx_lo.numel()
    w = triton.cdiv(total_tokens, block) + s
    wseg = torch.empty(w, dtype=torch.int32, device=cub.device)
    wblk = torch.empty(w, dtype=torch.int32, device=cub.device)
    jb = 64
    _plan_work_kernel[(triton.cdiv(w, jb),)](cub, ctx_lo, ctx_hi, wseg, wblk, s, w, block, SIGN=per_block_sign, JB=jb,
                                              SB=min(32, next_pow2(s, 16)), num_warps=4)
    return wseg, wblk, w


# ====================================================================================================== forward
@triton.jit
def _load_kv_block(k_base, v_base, k_idx, kbound, stride_kt, stride_vt, offs_d, D: tl.constexpr,
                   EVEN_D: tl.constexpr, MASK_K: tl.constexpr):
    """One (BLOCK_N, D_pad) block of K and of V at token indices ``k_idx``; rows ``>= kbound`` and padded head-dim
    columns read as 0 (masks only where the caller says the block can be ragged)."""
    k_off = k_idx.to(tl.int64)
    if MASK_K:
        lm = k_idx[:, None] < kbound
        if not EVEN_D:
            lm = lm & (offs_d[None, :] < D)
        k = tl.load(k_base + k_off[:, None] * stride_kt + offs_d[None, :], mask=lm, other=0.0)
        v = tl.load(v_base + k_off[:, None] * stride_vt + offs_d[None, :], mask=lm, other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_base + k_off[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(v_base + k_off[:, None] * stride_vt + offs_d[None, :])
        else:
            dm = offs_d[None, :] < D
            k = tl.load(k_base + k_off[:, None] * stride_kt + offs_d[None, :], mask=dm, other=0.0)
            v = tl.load(v_base + k_off[:, None] * stride_vt + offs_d[None, :], mask=dm, other=0.0)
    return k, v


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, q_idx, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, lo, hi, kbound,
               qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, MASK_K: tl.constexpr,
               CAUSAL: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr, KD, VD, kcol,
               TMA: tl.constexpr):
    """Online-softmax steps over key blocks ``[lo, hi)``. With ``SCALE_POS`` (a positive scale) the scale is applied
    after the row max and fused into the exponent's argument (one FMA per score instead of a multiply and a
    subtraction, as Triton's fused-attention tutorial does); otherwise the scores are scaled first. With ``TMA``
    the K/V blocks come through the tensor descriptors ``KD``/``VD`` (rows past ``kbound`` are then real rows of the
    next segment, or zeros past T: their scores are masked to -inf, so they add nothing)."""
    for start in range(lo, hi, BLOCK_N):
        k_idx = start + offs_n
        if TMA:
            k = KD.load([start, kcol])
            v = VD.load([start, kcol])
        else:
            k, v = _load_kv_block(k_base, v_base, k_idx, kbound, stride_kt, stride_vt, offs_d, D, EVEN_D, MASK_K)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if not SCALE_POS:
            qk = qk * qk_scale
        if MASK_K:
            keep = k_idx[None, :] < kbound
            if CAUSAL:
                keep = keep & (k_idx[None, :] <= q_idx[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        if SCALE_POS:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_rows(u, blk, ss, se, GROUP, BLOCK_M: tl.constexpr, PACK: tl.constexpr):
    """The query tile of head unit ``u``, query block ``blk`` of the segment ``[ss, se)``: ``(KV head, first query
    token, token per row, query head per row, row valid)``. ``PACK > 1``: rows ``j * BLOCK_M + i`` = query head ``j``
    of KV head ``u``'s group, token ``i`` (heads ``j >= GROUP`` are padding); else ``u`` is the query head."""
    q_start = ss + blk * BLOCK_M
    rows = tl.arange(0, PACK * BLOCK_M)
    if PACK > 1:
        hk = u
        jh = rows // BLOCK_M
        offs_m = q_start + rows % BLOCK_M
        head = hk * GROUP + jh
        rm = (offs_m < se) & (jh < GROUP)
    else:
        hk = u // GROUP
        offs_m = q_start + rows
        head = u + rows * 0
        rm = offs_m < se
    return hk, q_start, offs_m, head, rm


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, CU, KCTX_LO, KCTX_HI, WSEG, WBLK,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                T, H, GROUP, qk_scale,
                D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                PACK: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr = False,
                KD=None, VD=None, TMA: tl.constexpr = False):
    """One program per (work entry, head unit): ``PACK == 1``: one query head, ``BLOCK_M`` query tokens;
    ``PACK > 1`` (a power of two >= GROUP): every query head of one KV head (the GQA group, rows ``j * BLOCK_M + i``
    = head ``j``, token ``i``; rows of heads ``j >= GROUP`` are padding), so K/V blocks are loaded once for the
    group and the tile has ``PACK * BLOCK_M`` rows. ``TMA``: K/V blocks through the host-built tensor descriptors
    ``KD``/``VD`` (2-D ``(T, H_kv*D)`` views, blocks ``(BLOCK_N, D)``)."""
    pid = tl.program_id(0)
    n_units = H // GROUP if PACK > 1 else H
    w = pid // n_units
    u = pid % n_units
    seg = tl.load(WSEG + w)
    if seg < 0:
        return
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + seg)
    se = tl.load(CU + seg + 1)
    cs = tl.load(KCTX_LO + seg)
    ce = tl.load(KCTX_HI + seg)
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
    m_i = tl.full([PACK * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([PACK * BLOCK_M], tl.float32)
    acc = tl.zeros([PACK * BLOCK_M, D_PAD], tl.float32)
    # phase 1: the group prefix (response queries only): whole blocks unmasked, then the tail
    c_full = cs + ((ce - cs) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               cs, c_full, ce, qk_scale, D, BLOCK_N, EVEN_D, False, False, PREC, SCALE_POS, KD, VD, hk * D, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               c_full, ce, ce, qk_scale, D, BLOCK_N, EVEN_D, True, False, PREC, SCALE_POS, KD, VD, hk * D, TMA)
    # phase 2: own segment: whole key blocks strictly below the query block unmasked, then the causal rest
    d_lo = ss + ((q_start - ss) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               ss, d_lo, se, qk_scale, D, BLOCK_N, EVEN_D, False, False, PREC, SCALE_POS, KD, VD, hk * D, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               d_lo, tl.minimum(q_start + BLOCK_M, se), se, qk_scale, D, BLOCK_N, EVEN_D, True,
                               True, PREC, SCALE_POS, KD, VD, hk * D, TMA)
    l_i = tl.where(rm, l_i, 1.0)
    out = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    o_row = offs_m.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(O + o_row[:, None] + offs_d[None, :], out.to(O.dtype.element_ty), mask=qm)
    tl.store(LSE + head.to(tl.int64) * T + offs_m, lse, mask=rm)


# ====================================================================================================== backward
@triton.jit
def _bwd_delta_kernel(O, DO, DLSE, DELTA, stride_ot, stride_oh, stride_dt, stride_dh, T,
                      D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``Delta = rowsum(dO * O) - dLSE`` per (head, token), fp32 ``(H, T)``."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    msk = (offs_m[:, None] < T) & (offs_d[None, :] < D)
    o = tl.load(O + offs_m.to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=msk, other=0.0)
    do = tl.load(DO + offs_m.to(tl.int64)[:, None] * stride_dt + h * stride_dh + offs_d[None, :], mask=msk,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + h.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    tl.store(DELTA + h.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, q_idx, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, lo, hi,
                  kbound, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
                  MASK_K: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr):
    """dQ steps over key blocks ``[lo, hi)`` (``TMA``: K/V blocks through the descriptors, as :func:`_fwd_inner`)."""
    for start in range(lo, hi, BLOCK_N):
        k_idx = start + offs_n
        if TMA:
            k = KD.load([start, kcol])
            v = VD.load([start, kcol])
        else:
            k, v = _load_kv_block(k_base, v_base, k_idx, kbound, stride_kt, stride_vt, offs_d, D, EVEN_D, MASK_K)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.math.exp2(qk - lse2[:, None])
        if MASK_K:
            keep = k_idx[None, :] < kbound
            if CAUSAL:
                keep = keep & (k_idx[None, :] <= q_idx[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, CU, KCTX_LO, KCTX_HI, WSEG, WBLK,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dqt, stride_dqh, T, H, GROUP, qk_scale, sm_scale,
                   D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   EVEN_D: tl.constexpr, PREC: tl.constexpr, PACK: tl.constexpr = 1, KD=None, VD=None,
                   TMA: tl.constexpr = False):
    """One program per (work entry, head unit), the forward's tiling (:func:`_fwd_kernel`: ``PACK > 1`` packs the
    GQA group's query heads into one tile so K/V blocks are loaded once for the group; ``TMA`` loads them through
    tensor descriptors). Each dQ row has one owner program: no atomics."""
    pid = tl.program_id(0)
    n_units = H // GROUP if PACK > 1 else H
    w = pid // n_units
    u = pid % n_units
    seg = tl.load(WSEG + w)
    if seg < 0:
        return
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + seg)
    se = tl.load(CU + seg + 1)
    cs = tl.load(KCTX_LO + seg)
    ce = tl.load(KCTX_HI + seg)
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
    # the group prefix (response queries only): whole blocks unmasked, then the tail
    c_full = cs + ((ce - cs) // BLOCK_N) * BLOCK_N
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                       cs, c_full, ce, qk_scale, D, BLOCK_N, EVEN_D, False, False, PREC, KD, VD, kcol, TMA)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, offs_m, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                       c_full, ce, ce, qk_scale, D, BLOCK_N, EVEN_D, True, False, PREC, KD, VD, kcol, TMA)
    # own segment: whole key blocks strictly below the query block unmasked, then the causal rest
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
def _bwd_dkdv_inner(dk, dv, k, v, k_idx, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                    offs_m, offs_d, lo, hi, qbound, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
                    EVEN_D: tl.constexpr, MASK_Q: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr,
                    QD, DOD, qcol, TMA: tl.constexpr):
    """dK/dV steps over query blocks ``[lo, hi)`` of one query head. ``TMA``: the Q/dO blocks through the tensor
    descriptors ``QD``/``DOD`` at column ``qcol`` (rows past ``qbound`` are then real rows of other segments, or
    zeros past T: their probabilities are masked to 0)."""
    for start in range(lo, hi, BLOCK_M):
        q_idx = start + offs_m
        q_off = q_idx.to(tl.int64)
        if TMA:
            q = QD.load([start, qcol])
            do = DOD.load([start, qcol])
            if MASK_Q:
                rm = q_idx < qbound
                lse2 = tl.load(lse_base + q_idx, mask=rm, other=0.0) * 1.4426950408889634
                delta = tl.load(delta_base + q_idx, mask=rm, other=0.0)
            else:
                lse2 = tl.load(lse_base + q_idx) * 1.4426950408889634
                delta = tl.load(delta_base + q_idx)
        elif MASK_Q:
            rm = q_idx < qbound
            lm = rm[:, None]
            if not EVEN_D:
                lm = lm & (offs_d[None, :] < D)
            q = tl.load(q_base + q_off[:, None] * stride_qt + offs_d[None, :], mask=lm, other=0.0)
            do = tl.load(do_base + q_off[:, None] * stride_dot + offs_d[None, :], mask=lm, other=0.0)
            lse2 = tl.load(lse_base + q_idx, mask=rm, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_base + q_idx, mask=rm, other=0.0)
        else:
            if EVEN_D:
                q = tl.load(q_base + q_off[:, None] * stride_qt + offs_d[None, :])
                do = tl.load(do_base + q_off[:, None] * stride_dot + offs_d[None, :])
            else:
                dm = offs_d[None, :] < D
                q = tl.load(q_base + q_off[:, None] * stride_qt + offs_d[None, :], mask=dm, other=0.0)
                do = tl.load(do_base + q_off[:, None] * stride_dot + offs_d[None, :], mask=dm, other=0.0)
            lse2 = tl.load(lse_base + q_idx) * 1.4426950408889634
            delta = tl.load(delta_base + q_idx)
        # (BLOCK_N, BLOCK_M) orientation: K and V are the A operands, loaded once per program
        qkT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
        pT = tl.math.exp2(qkT - lse2[None, :])
        if MASK_Q:
            keep = q_idx[None, :] < qbound
            if CAUSAL:
                keep = keep & (q_idx[None, :] >= k_idx[:, None])
            pT = tl.where(keep, pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, CU, QCTX_LO, QCTX_HI, WSEG, WBLK,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                     stride_dkt, stride_dkh, stride_dvt, stride_dvh, T, H_KV, GROUP, qk_scale, sm_scale,
                     D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN_D: tl.constexpr, PREC: tl.constexpr, QD=None, DOD=None, TMA: tl.constexpr = False):
    """One program per (work entry = BLOCK_N keys of one segment, KV head): dK/dV over every query head of the GQA
    group and every query that sees these keys; each dK/dV row has one owner program (no atomics). ``TMA``: the
    Q/dO blocks through host tensor descriptors (2-D ``(T, H*D)`` views, blocks ``(BLOCK_M, D)``)."""
    pid = tl.program_id(0)
    w = pid // H_KV
    g = pid % H_KV
    seg = tl.load(WSEG + w)
    if seg < 0:
        return
    blk = tl.load(WBLK + w)
    ss = tl.load(CU + seg)
    se = tl.load(CU + seg + 1)
    cs = tl.load(QCTX_LO + seg)
    ce = tl.load(QCTX_HI + seg)
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
    c_full = cs + ((ce - cs) // BLOCK_M) * BLOCK_M
    for hh in range(0, GROUP):
        h = g * GROUP + hh
        q_base = Q + h * stride_qh
        do_base = DO + h * stride_doh
        lse_base = LSE + h.to(tl.int64) * T
        delta_base = DELTA + h.to(tl.int64) * T
        # own segment: the diagonal (causal, masked), then the queries after it (whole blocks, then the tail)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_m, offs_d, k_start, diag_hi, se, qk_scale, D, BLOCK_M, EVEN_D, True, True, PREC,
                                 QD, DOD, h * D, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_m, offs_d, diag_hi, o_full, se, qk_scale, D, BLOCK_M, EVEN_D, False, False,
                                 PREC, QD, DOD, h * D, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                 offs_m, offs_d, o_full, se, se, qk_scale, D, BLOCK_M, EVEN_D, True, False, PREC,
                                 QD, DOD, h * D, TMA)
        # a prefix key block: every response query of its group (contiguous after the prefix), unmasked
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt,
                                 stride_dot, offs_m, offs_d, cs, c_full, ce, qk_scale, D, BLOCK_M, EVEN_D, False,
                                 False, PREC, QD, DOD, h * D, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, q_base, do_base, lse_base, delta_base, stride_qt,
                                 stride_dot, offs_m, offs_d, c_full, ce, ce, qk_scale, D, BLOCK_M, EVEN_D, True,
                                 False, PREC, QD, DOD, h * D, TMA)
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
        # launch-config probe (H200, GQA 32/8; BENCHMARKS.md, "DualKV attention op"): Q/dO through tensor descriptors,
        # 2 stages: 2.945 / 14.98 ms at P=5059 mb=4 / P=8192 mb=16 against 3.197 / 15.59 for 64/128/8/3 without
        # (dK/dV bitwise equal)
        return dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2, TMA=True)
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


def dualkv_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               segment_prefix: torch.Tensor, scale: float, *, config: Optional[dict] = None,
               assert_layout: bool = False):
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

    Returns:
        ``(out, lse)``: out ``(T, H, D)`` in q.dtype; lse fp32 ``(H, T)``, natural log.
    """
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
    cub, ctx = _plan_layout(cu_seqlens, segment_prefix, t, assert_layout)
    wseg, wblk, w = _plan_work(cub, ctx[0], ctx[1], bm, t, +1)
    kd, vd = _tma_descriptors(k, v, bn) if cfg.get("TMA") else (None, None)
    _fwd_kernel[(w * (h_kv if pack > 1 else h),)](
        q, k, v, out, lse, cub, ctx[0], ctx[1], wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        t, h, group, scale * LOG2E,
        D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, PACK=pack, EVEN_D=(d == d_pad), PREC=prec, SCALE_POS=scale > 0,
        KD=kd, VD=vd, TMA=kd is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


def dualkv_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, scale: float,
               dlse: Optional[torch.Tensor] = None, *, config: Optional[dict] = None, assert_layout: bool = False):
    """Triton DualKV backward, bitwise deterministic (no atomics; every gradient element has one owner program).

    Args:
        do: ``(T, H, D)`` gradient of ``out``; q, k, v, out as in :func:`dualkv_fwd`; lse: fp32 ``(H, T)`` from the
            forward; cu_seqlens, segment_prefix, scale as in :func:`dualkv_fwd`.
        dlse: optional fp32 ``(H, T)`` gradient of ``lse`` (enters as ``Delta = rowsum(dO∘O) - dLSE``).
        config: optional launch configs ``{"dq": {...}, "dkdv": {...}}`` as :func:`dualkv_fwd`'s (dq: the forward's
            tiling, ``PACK`` and ``TMA`` included; dkdv: ``BLOCK_N`` keys per program, ``BLOCK_N % BLOCK_M == 0``).
        assert_layout: as :func:`dualkv_fwd`'s.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of q, k, v; the shared prefix's dK/dV include the contributions of
        every response of its group plus its own causal part.
    """
    q, k, v, out, do = (_lastdim_contig(x) for x in (q, k, v, out, do))
    t, h, d, h_kv, d_pad, prec = _prep(q, k, v)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if t == 0:
        return dq, dk, dv
    lse = lse.contiguous()
    delta = torch.empty((h, t), dtype=torch.float32, device=q.device)
    bmd = 32 if _interpreting() else 64
    has_dlse = dlse is not None
    _bwd_delta_kernel[(triton.cdiv(t, bmd), h)](
        out, do, dlse.contiguous().float() if has_dlse else delta, delta, out.stride(0), out.stride(1),
        do.stride(0), do.stride(1), t, D=d, D_PAD=d_pad, BLOCK_M=bmd, HAS_DLSE=has_dlse)
    cub, ctx = _plan_layout(cu_seqlens, segment_prefix, t, assert_layout)
    _launch_dq(q, k, v, do, dq, lse, delta, cub, ctx[0], ctx[1], t, h, h_kv, d, d_pad, prec, scale,
               _cfg("dq", d_pad, q.dtype, config, h // h_kv))
    _launch_dkdv(q, k, v, do, dk, dv, lse, delta, cub, ctx[2], ctx[3], t, h, h_kv, d, d_pad, prec, scale,
                 _cfg("dkdv", d_pad, q.dtype, config))
    return dq, dk, dv


def _launch_dq(q, k, v, do, dq, lse, delta, cu_seqlens, kctx_lo, kctx_hi, t, h, h_kv, d, d_pad, prec, scale, cfg):
    """The dQ kernel over query blocks in heaviest-first order; returns the launched (compiled) kernel."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    group = h // h_kv
    pack = next_pow2(group) if cfg.get("PACK") and group > 1 else 1
    wseg, wblk, w = _plan_work(cu_seqlens, kctx_lo, kctx_hi, bm, t, +1)
    kd, vd = _tma_descriptors(k, v, bn) if cfg.get("TMA") else (None, None)
    return _bwd_dq_kernel[(w * (h_kv if pack > 1 else h),)](
        q, k, v, do, dq, lse, delta, cu_seqlens, kctx_lo, kctx_hi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dq.stride(0), dq.stride(1), t, h, group, scale * LOG2E, scale,
        D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, EVEN_D=(d == d_pad), PREC=prec, PACK=pack, KD=kd, VD=vd,
        TMA=kd is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _launch_dkdv(q, k, v, do, dk, dv, lse, delta, cu_seqlens, qctx_lo, qctx_hi, t, h, h_kv, d, d_pad, prec, scale,
                 cfg):
    """The dK/dV kernel over key blocks in heaviest-first order. Returns the launched (compiled) kernel (its
    ``n_regs``/``n_spills`` on CUDA)."""
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if bn % bm:
        raise ValueError(f"dkdv launch config: BLOCK_N ({bn} keys per program) must be a multiple of BLOCK_M ({bm} "
                         f"queries per step); e.g. BLOCK_M={bm} BLOCK_N={bm * max(1, bn // bm)}")
    wseg, wblk, w = _plan_work(cu_seqlens, qctx_lo, qctx_hi, bn, t, -1)
    qd, dod = _tma_descriptors(q, do, bm) if cfg.get("TMA") else (None, None)
    return _bwd_dkdv_kernel[(w * h_kv,)](
        q, k, v, do, dk, dv, lse, delta, cu_seqlens, qctx_lo, qctx_hi, wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), t, h_kv, h // h_kv, scale * LOG2E, scale,
        D=d, D_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, EVEN_D=(d == d_pad), PREC=prec, QD=qd, DOD=dod,
        TMA=qd is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


__all__ = ["dualkv_fwd", "dualkv_bwd", "dualkv_attention_reference", "dualkv_attention_reference_backward",
           "KERNELS", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]
