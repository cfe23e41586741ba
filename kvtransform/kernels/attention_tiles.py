"""Tile bodies shared by the DualKV (``kernels/dualkv.py``) and prefix-tree (``kernels/prefix_tree.py``) attention
kernels: K/V block loads, the online-softmax forward step, the dQ and dK/dV steps, the walks over one key (or query)
range with its block-skipping bounds, the forward's epilogue, ``Delta``, and the host tables of the attention
variants.

Attention variants (``kvtransform.ops._common.check_attention_variants``; all off by default, each behind a
``tl.constexpr`` so that the default compiles to the code without them):

* ``WINDOW`` (sliding window, Mistral / Gemma 2-3 / gpt-oss): query at sequence position ``i`` sees keys at
  ``i - window < j <= i``. Positions are each token's position in its own sequence (``POS``, int32 ``(T,)``: a
  response or descendant token continues its prefix's / ancestors' positions). Key (query) blocks wholly outside
  every row's window are skipped: the walks below compute, per range, the first block any row needs, the blocks
  every row sees whole (unmasked) and the last one; only the edge blocks are masked (the flash-attention 2 sliding
  window scheme, Dao 2023, §3.1 and its ``window_size`` argument).
* ``SOFTCAP`` (Gemma 2): ``s = softcap * tanh(scale * q.k / softcap)`` before the mask; the kernels take
  ``qk_scale = scale / softcap`` and ``cap2 = softcap * log2(e)`` (scores in log2 units for ``exp2``); the backward
  multiplies dS by ``1 - tanh^2``. ``FAST_TANH``: the GPU's ``tanh.approx.f32`` (relative error ~2**-11, below a
  16-bit input's rounding; used for fp16/bf16 only), else ``tanh`` from ``exp2`` (fp32 inputs and the interpreter).
* ``HAS_SINKS`` (gpt-oss): one more term ``exp(sinks[h])`` in each row's softmax denominator, added in the forward's
  epilogue with the running max (the LSE includes it, so the backward's probabilities need nothing else); the sinks'
  gradient ``-sum_rows exp(sinks[h] - lse) * Delta`` is a small torch reduction in the launchers (fixed order), with
  the exact ``Delta = rowsum(P * dP) - dLSE`` that the dQ kernel accumulates in fp32 per row (:func:`sinks_grad`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ====================================================================================================== scores
@triton.jit
def _tanh(x, FAST: tl.constexpr):
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        ax = tl.abs(x)
        e = tl.math.exp2(-2.8853900817779268 * ax)  # exp(-2|x|)
        y = (1.0 - e) / (1.0 + e)
        y = tl.where(x < 0, -y, y)
        # near 0, 1 - e cancels (absolute error ~1e-7, which the soft-cap multiplies): the odd series there, whose
        # next term (17/315 x^7) is below 1e-9 relative at |x| < 1/16
        x2 = x * x
        return tl.where(ax < 0.0625, x * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333)), y)


@triton.jit
def _keep(k_idx, kbound, q_idx, qpos, POS, window, KEYS_ON_AXIS1: tl.constexpr, CAUSAL: tl.constexpr,
          WMASK: tl.constexpr):
    """The kept (query, key) pairs of one tile: keys ``< kbound``, causal (key <= query) and within the window
    (``qpos - POS[key] < window``). ``KEYS_ON_AXIS1``: tile ``(queries, keys)`` (forward, dQ), else ``(keys,
    queries)`` (dK/dV; there ``k_idx`` are the fixed keys and ``kbound``/``q_idx`` bound the queries)."""
    if KEYS_ON_AXIS1:
        keep = k_idx[None, :] < kbound
        if CAUSAL:
            keep = keep & (k_idx[None, :] <= q_idx[:, None])
        if WMASK:
            kpos = tl.load(POS + k_idx, mask=k_idx < kbound, other=0)
            keep = keep & (qpos[:, None] - kpos[None, :] < window)
    else:
        keep = q_idx[None, :] < kbound
        if CAUSAL:
            keep = keep & (q_idx[None, :] >= k_idx[:, None])
        if WMASK:
            qp = tl.load(POS + q_idx, mask=q_idx < kbound, other=0)
            keep = keep & (qp[None, :] - qpos[:, None] < window)
    return keep


@triton.jit
def _load_kv_block(k_base, v_base, start, k_idx, kbound, stride_kt, stride_vt, offs_d, D: tl.constexpr,
                   EVEN_D: tl.constexpr, MASK_K: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr):
    """One (BLOCK_N, D_pad) block of K and of V at token indices ``k_idx = start + arange(BLOCK_N)``: with ``TMA``
    through the tensor descriptors ``KD``/``VD`` at column ``kcol`` (rows past ``kbound`` are real rows of the next
    segment, or zeros past T: the caller masks their scores); else by pointer, rows ``>= kbound`` and padded
    head-dim columns read as 0 (masks only where the caller says the block can be ragged)."""
    k_off = k_idx.to(tl.int64)
    if TMA:
        k = KD.load([start, kcol])
        v = VD.load([start, kcol])
    elif MASK_K:
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


# ====================================================================================================== forward
@triton.jit
def _fwd_step(acc, l_i, m_i, q, q_idx, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, start, kbound,
              qk_scale, cap2, POS, window, D: tl.constexpr, EVEN_D: tl.constexpr, MASK_K: tl.constexpr,
              CAUSAL: tl.constexpr, WMASK: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr,
              SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr):
    """One online-softmax step over the key block at ``start`` (:func:`_fwd_inner`)."""
    k_idx = start + offs_n
    k, v = _load_kv_block(k_base, v_base, start, k_idx, kbound, stride_kt, stride_vt, offs_d, D, EVEN_D, MASK_K,
                          KD, VD, kcol, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    if SOFTCAP:
        qk = _tanh(qk * qk_scale, FAST_TANH) * cap2
    elif not SCALE_POS:
        qk = qk * qk_scale
    if MASK_K or WMASK:
        qk = tl.where(_keep(k_idx, kbound, q_idx, qpos, POS, window, True, CAUSAL, WMASK), qk, float("-inf"))
    if SCALE_POS:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
    if WMASK:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if SCALE_POS:
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    else:
        p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, q_idx, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, lo, hi, kbound,
               qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
               MASK_K: tl.constexpr, CAUSAL: tl.constexpr, WMASK: tl.constexpr, PREC: tl.constexpr,
               SCALE_POS: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol,
               TMA: tl.constexpr):
    """Online-softmax steps over key blocks ``[lo, hi)``. With ``SCALE_POS`` (a positive scale, no soft-cap) the
    scale is applied after the row max and fused into the exponent's argument (one FMA per score instead of a
    multiply and a subtraction, as Triton's fused-attention tutorial does); otherwise the scores are scaled (and
    soft-capped) first. With ``TMA`` the K/V blocks come through the tensor descriptors ``KD``/``VD`` (rows past
    ``kbound`` are then real rows of the next segment, or zeros past T: their scores are masked to -inf, so they add
    nothing). ``WMASK`` (window edge blocks): a row may see none of a block's keys before any other, so its running
    max stays -inf (and 0 stands in for it in the exponents)."""
    for start in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, q_idx, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                                  start, kbound, qk_scale, cap2, POS, window, D, EVEN_D, MASK_K, CAUSAL, WMASK, PREC,
                                  SCALE_POS, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)
    return acc, l_i, m_i


@triton.jit
def _ctx_bounds(cs, ce, qmin, qmax, POS, window, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """Blocks of the context range ``[cs, ce)`` (every key before every query; positions linear from ``POS[cs]``)
    that queries at positions ``qmin..qmax`` need: ``(a, b, c_full, te)``: window-masked ``[a, b)``, whole
    ``[b, c_full)``, ragged (and window-masked) tail ``[c_full, te)``; without ``WINDOW`` ``a = b = cs``, ``te =
    ce``."""
    c_full = cs + ((ce - cs) // BLOCK) * BLOCK
    a = cs
    b = cs
    te = ce
    if WINDOW:
        kb = tl.load(POS + cs, mask=cs < ce, other=0)
        lowest = cs + tl.maximum(qmin - window + 1 - kb, 0)  # first key any row sees
        full = cs + tl.maximum(qmax - window + 1 - kb, 0)  # keys from here on are seen by every row
        a = cs + ((tl.minimum(lowest, ce) - cs) // BLOCK) * BLOCK
        b = tl.minimum(tl.maximum(cs + ((full - cs + BLOCK - 1) // BLOCK) * BLOCK, a), c_full)
        te = tl.where(lowest < ce, ce, c_full)
    return a, b, c_full, te


@triton.jit
def _own_bounds(ss, q_start, q_end, window, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """Key blocks of the queries' own segment ``[ss, ...)`` for the query block ``[q_start, q_end)``: ``(a, b,
    d_lo)``: window-masked ``[a, b)``, whole ``[b, d_lo)``, then the causal diagonal ``[d_lo, q_end)``."""
    d_lo = ss + ((q_start - ss) // BLOCK) * BLOCK
    a = ss
    b = ss
    if WINDOW:
        a = ss + ((tl.maximum(q_start - window + 1, ss) - ss) // BLOCK) * BLOCK
        b = ss + ((tl.maximum(q_end - window, ss) - ss + BLOCK - 1) // BLOCK) * BLOCK
        b = tl.minimum(tl.maximum(b, a), d_lo)
    return a, b, d_lo


@triton.jit
def _fwd_walk(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, a, b, mid, end,
              kbound, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
              TAIL_CAUSAL: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr, WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr):
    """One key range walked in three parts: the window's edge blocks ``[a, b)`` (masked; only with ``WINDOW``), the
    whole blocks ``[b, mid)`` (unmasked), then the tail ``[mid, end)`` (keys ``< kbound``; causal with
    ``TAIL_CAUSAL``; window-masked with ``WINDOW``)."""
    if WINDOW:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                                   offs_d, a, b, kbound, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, False, False,
                                   True, PREC, SCALE_POS, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               b, mid, kbound, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, False, False, False,
                               PREC, SCALE_POS, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                               mid, end, kbound, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, True, TAIL_CAUSAL,
                               WINDOW, PREC, SCALE_POS, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)
    return acc, l_i, m_i


@triton.jit
def _fwd_ctx(acc, l_i, m_i, q, offs_m, qpos, qmin, qmax, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, cs,
             ce, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
             PREC: tl.constexpr, SCALE_POS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
             FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr):
    """Forward over one context key range ``[cs, ce)`` (a response's prefix, a node's ancestor range)."""
    a, b, c_full, te = _ctx_bounds(cs, ce, qmin, qmax, POS, window, BLOCK_N, WINDOW)
    return _fwd_walk(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, a, b,
                     c_full, te, ce, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, False, PREC, SCALE_POS, WINDOW,
                     SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)


@triton.jit
def _fwd_own(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, ss, se, q_start,
             qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             EVEN_D: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr, WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr):
    """Forward over the query block's own segment: whole key blocks strictly below the query block unmasked, then
    the causal rest (with ``WINDOW``: from the first block the window reaches, its edge blocks masked)."""
    q_end = tl.minimum(q_start + BLOCK_M, se)
    a, b, d_lo = _own_bounds(ss, q_start, q_end, window, BLOCK_N, WINDOW)
    return _fwd_walk(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, a, b,
                     d_lo, q_end, se, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, True, PREC, SCALE_POS, WINDOW,
                     SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)


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
def _row_positions(POS, offs_m, rm, q_start, se, BLOCK_M: tl.constexpr, WINDOW: tl.constexpr):
    """``(qpos, qmin, qmax)``: each row's sequence position and the block's first / last (0s without ``WINDOW``)."""
    qpos = offs_m * 0
    qmin = 0
    qmax = 0
    if WINDOW:
        qpos = tl.load(POS + offs_m, mask=rm, other=0)
        qmin = tl.load(POS + q_start)
        qmax = tl.load(POS + tl.minimum(q_start + BLOCK_M, se) - 1)
    return qpos, qmin, qmax


@triton.jit
def _fwd_store(acc, l_i, m_i, offs_m, head, rm, qm, offs_d, O, LSE, SINKS, stride_ot, stride_oh, T,
               HAS_SINKS: tl.constexpr):
    """The forward's epilogue: the sink term (``HAS_SINKS``) joins the running max and denominator, then out =
    acc / l and the natural-log LSE are stored for the valid rows."""
    if HAS_SINKS:
        s2 = tl.load(SINKS + head, mask=rm, other=0.0) * 1.4426950408889634
        m_new = tl.maximum(m_i, s2)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(s2 - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
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
def _dq_step(dq, rsum, q, do, lse2, delta, q_idx, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, start,
             kbound, qk_scale, cap2, POS, window, D: tl.constexpr, EVEN_D: tl.constexpr, MASK_K: tl.constexpr,
             CAUSAL: tl.constexpr, WMASK: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr,
             FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One dQ step over the key block at ``start`` (:func:`_bwd_dq_inner`)."""
    k_idx = start + offs_n
    k, v = _load_kv_block(k_base, v_base, start, k_idx, kbound, stride_kt, stride_vt, offs_d, D, EVEN_D, MASK_K, KD,
                          VD, kcol, TMA)
    if SOFTCAP:
        th = _tanh(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale, FAST_TANH)
        qk = th * cap2
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    p = tl.math.exp2(qk - lse2[:, None])
    if MASK_K or WMASK:
        p = tl.where(_keep(k_idx, kbound, q_idx, qpos, POS, window, True, CAUSAL, WMASK), p, 0.0)
    if SOFTCAP:  # d tanh: folded into p before the next dot, so no extra tile stays live across it
        if not HAS_SINKS:
            p = p * (1.0 - th * th)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    if HAS_SINKS:  # rowsum(P * dP) needs P itself: d tanh folded in after the dot
        rsum += tl.sum(p * dp, 1)
        if SOFTCAP:
            p = p * (1.0 - th * th)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq, rsum


@triton.jit
def _bwd_dq_inner(dq, rsum, q, do, lse2, delta, q_idx, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                  lo, hi, kbound, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  EVEN_D: tl.constexpr, MASK_K: tl.constexpr, CAUSAL: tl.constexpr, WMASK: tl.constexpr,
                  PREC: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """dQ steps over key blocks ``[lo, hi)`` (``TMA``: K/V blocks through the descriptors, as :func:`_fwd_inner`).
    ``HAS_SINKS``: also ``rsum += rowsum(P * dP)`` (fp32; the sinks' exact ``Delta``, see :func:`sinks_grad`)."""
    for start in range(lo, hi, BLOCK_N):
        dq, rsum = _dq_step(dq, rsum, q, do, lse2, delta, q_idx, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                            offs_d, start, kbound, qk_scale, cap2, POS, window, D, EVEN_D, MASK_K, CAUSAL, WMASK, PREC,
                            SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
    return dq, rsum


@triton.jit
def _dq_walk(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, a, b,
             mid, end, kbound, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_N: tl.constexpr,
             EVEN_D: tl.constexpr, TAIL_CAUSAL: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr,
             SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr,
             HAS_SINKS: tl.constexpr):
    """dQ (and ``rsum``) over one key range in the three parts of :func:`_fwd_walk`."""
    if WINDOW:
        dq, rsum = _bwd_dq_inner(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt,
                                 offs_n, offs_d, a, b, kbound, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, False,
                                 False, True, PREC, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
    dq, rsum = _bwd_dq_inner(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                             offs_d, b, mid, kbound, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, False, False,
                             False, PREC, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
    dq, rsum = _bwd_dq_inner(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                             offs_d, mid, end, kbound, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, True,
                             TAIL_CAUSAL, WINDOW, PREC, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
    return dq, rsum


@triton.jit
def _dq_ctx(dq, rsum, q, do, lse2, delta, offs_m, qpos, qmin, qmax, k_base, v_base, stride_kt, stride_vt, offs_n,
            offs_d, cs, ce, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
            PREC: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol,
            TMA: tl.constexpr, HAS_SINKS: tl.constexpr):
    """dQ (and ``rsum``, :func:`_bwd_dq_inner`) over one context key range, the blocks of :func:`_fwd_ctx`."""
    a, b, c_full, te = _ctx_bounds(cs, ce, qmin, qmax, POS, window, BLOCK_N, WINDOW)
    return _dq_walk(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                    a, b, c_full, te, ce, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, False, PREC, WINDOW,
                    SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)


@triton.jit
def _dq_own(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, ss, se,
            q_start, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            EVEN_D: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
            FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr, HAS_SINKS: tl.constexpr):
    """dQ (and ``rsum``) over the own segment, the blocks of :func:`_fwd_own`."""
    q_end = tl.minimum(q_start + BLOCK_M, se)
    a, b, d_lo = _own_bounds(ss, q_start, q_end, window, BLOCK_N, WINDOW)
    return _dq_walk(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d,
                    a, b, d_lo, q_end, se, qk_scale, cap2, POS, window, D, BLOCK_N, EVEN_D, True, PREC, WINDOW,
                    SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)


@triton.jit
def _range_span(KLO, KHI, r, valid, qmin, qmax, POS, window, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """``(start, stop, ce)`` of context range ``r`` (``[KLO[r], KHI[r])``; empty where not ``valid``): its blocks
    ``[start, stop)`` are :func:`_ctx_bounds`' ``[a, te)``, its keys end at ``ce``."""
    cs = tl.load(KLO + r, mask=valid, other=0)
    ce = tl.load(KHI + r, mask=valid, other=0)
    a, b, c_full, te = _ctx_bounds(cs, ce, qmin, qmax, POS, window, BLOCK, WINDOW)
    return a, te, ce


@triton.jit
def _ranges_walk(KLO, KHI, r0, r1, qmin, qmax, POS, window, BLOCK: tl.constexpr, WINDOW: tl.constexpr):
    """Start of the windowed flat walk over context ranges ``r0..r1`` (the prefix tree's ancestors): ``(steps, start,
    stop, ce)``, ``steps`` = every range's blocks (at least one step per range, so :func:`_ranges_next` moves on one
    range at a time; a range the window leaves empty costs one fully masked step), then range ``r0``'s span."""
    steps = 0
    for r in range(r0, r1):
        a, te, ce = _range_span(KLO, KHI, r, True, qmin, qmax, POS, window, BLOCK, WINDOW)
        steps += tl.maximum((te - a + BLOCK - 1) // BLOCK, 1)
    start, stop, ce = _range_span(KLO, KHI, r0, r0 < r1, qmin, qmax, POS, window, BLOCK, WINDOW)
    return steps, start, stop, ce


@triton.jit
def _ranges_next(KLO, KHI, r, r1, start, stop, ce, qmin, qmax, POS, window, BLOCK: tl.constexpr,
                 WINDOW: tl.constexpr):
    """The flat walk's next block after the one at ``start`` of range ``r``: ``(r, start, stop, ce)``, moving to range
    ``r + 1`` once ``start`` passes ``stop`` (branch-free: the loop stays one innermost loop)."""
    start += BLOCK
    nxt = start >= stop
    r = tl.where(nxt, r + 1, r)
    ns, nstop, nce = _range_span(KLO, KHI, r, nxt & (r < r1), qmin, qmax, POS, window, BLOCK, WINDOW)
    return r, tl.where(nxt, ns, start), tl.where(nxt, nstop, stop), tl.where(nxt, nce, ce)


@triton.jit
def _whole_span(KLO, KHI, r, valid, BLOCK: tl.constexpr):
    """``(cs, c_full, ce)`` of context range ``r`` (empty where not ``valid``): its whole blocks are ``[cs, c_full)``,
    its ragged tail ``[c_full, ce)``."""
    cs = tl.load(KLO + r, mask=valid, other=0)
    ce = tl.load(KHI + r, mask=valid, other=0)
    return cs, cs + ((ce - cs) // BLOCK) * BLOCK, ce


@triton.jit
def _whole_walk(KLO, KHI, KNXT, r0, r1, BLOCK: tl.constexpr):
    """Start of the walk over the whole blocks of context ranges ``r0..r1``: ``(steps, r, start, stop)``: their
    count, then the first range with one (``KNXT``, :func:`whole_range_next`) and its whole blocks ``[start,
    stop)``."""
    steps = 0
    for r in range(r0, r1):
        steps += (tl.load(KHI + r) - tl.load(KLO + r)) // BLOCK
    r = tl.load(KNXT + r0, mask=r0 < r1, other=0)
    start, stop, ce = _whole_span(KLO, KHI, r, r < r1, BLOCK)
    return steps, r, start, stop


@triton.jit
def _whole_next(KLO, KHI, KNXT, r, r1, start, stop, BLOCK: tl.constexpr):
    """The whole block after the one at ``start`` of range ``r``: ``(r, start, stop)``, moving to the next range with
    a whole block (``KNXT[r + 1]``) once ``start`` reaches ``stop``; branch-free, so the loop stays innermost."""
    start += BLOCK
    nxt = start >= stop
    r = tl.where(nxt, tl.load(KNXT + r + 1, mask=nxt & (r < r1), other=0), r)
    ns, nstop, ce = _whole_span(KLO, KHI, r, nxt & (r < r1), BLOCK)
    return r, tl.where(nxt, ns, start), tl.where(nxt, nstop, stop)


@triton.jit
def _lead_spans(KLO, KHI, r0, r1, BLOCK: tl.constexpr):
    """The whole blocks of the first four context ranges ``r0..min(r1, r0 + 4)`` (a tree node's ancestors, root
    first), addressed from a loop counter by :func:`_lead_block`: ``(steps, lo0, lo1, lo2, lo3, c1, c2, c3)``, their
    count, each range's first key and the blocks before ranges 1-3 (a missing range: no blocks)."""
    v0 = r0 < r1
    v1 = r0 + 1 < r1
    v2 = r0 + 2 < r1
    v3 = r0 + 3 < r1
    lo0 = tl.load(KLO + r0, mask=v0, other=0)
    lo1 = tl.load(KLO + r0 + 1, mask=v1, other=0)
    lo2 = tl.load(KLO + r0 + 2, mask=v2, other=0)
    lo3 = tl.load(KLO + r0 + 3, mask=v3, other=0)
    c1 = (tl.load(KHI + r0, mask=v0, other=0) - lo0) // BLOCK
    c2 = c1 + (tl.load(KHI + r0 + 1, mask=v1, other=0) - lo1) // BLOCK
    c3 = c2 + (tl.load(KHI + r0 + 2, mask=v2, other=0) - lo2) // BLOCK
    steps = c3 + (tl.load(KHI + r0 + 3, mask=v3, other=0) - lo3) // BLOCK
    return steps, lo0, lo1, lo2, lo3, c1, c2, c3


@triton.jit
def _lead_block(i, lo0, lo1, lo2, lo3, c1, c2, c3, BLOCK: tl.constexpr):
    """First key of whole block ``i`` of :func:`_lead_spans`' ranges: a function of the loop counter alone (no
    loop-carried range state, so the software pipeline can address blocks ahead)."""
    start = lo0 + i * BLOCK
    start = tl.where(i >= c1, lo1 + (i - c1) * BLOCK, start)
    start = tl.where(i >= c2, lo2 + (i - c2) * BLOCK, start)
    return tl.where(i >= c3, lo3 + (i - c3) * BLOCK, start)


@triton.jit
def _fwd_ctx_ranges(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n, offs_d, KLO, KHI,
                    KNXT, r0, r1, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_D: tl.constexpr, PREC: tl.constexpr, SCALE_POS: tl.constexpr, SOFTCAP: tl.constexpr,
                    FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr):
    """Forward over the context ranges ``r0..r1`` of ``KLO``/``KHI`` (a tree node's ancestors; no window) in flat
    loops, none nested in a loop over the ranges (nested, ptxas serializes the wgmma pipeline: docs/PREFIX_TREES.md):
    the whole blocks of the first four ranges addressed from the loop counter (:func:`_lead_block`), those of any
    deeper ranges by the walk :func:`_whole_next`, then each range's ragged tail masked (ranges without one
    skipped: a fully masked first step would leave the running max at -inf)."""
    steps, lo0, lo1, lo2, lo3, c1, c2, c3 = _lead_spans(KLO, KHI, r0, r1, BLOCK_N)
    for i in range(0, steps):
        start = _lead_block(i, lo0, lo1, lo2, lo3, c1, c2, c3, BLOCK_N)
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                                  offs_d, start, start + BLOCK_N, qk_scale, cap2, POS, window, D, EVEN_D, False, False,
                                  False, PREC, SCALE_POS, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)
    steps, r, start, stop = _whole_walk(KLO, KHI, KNXT, r0 + 4, r1, BLOCK_N)
    for _ in range(0, steps):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                                  offs_d, start, stop, qk_scale, cap2, POS, window, D, EVEN_D, False, False, False,
                                  PREC, SCALE_POS, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)
        r, start, stop = _whole_next(KLO, KHI, KNXT, r, r1, start, stop, BLOCK_N)
    for r in range(r0, r1):
        cs, c_full, ce = _whole_span(KLO, KHI, r, True, BLOCK_N)
        if c_full < ce:
            acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, offs_m, qpos, k_base, v_base, stride_kt, stride_vt, offs_n,
                                      offs_d, c_full, ce, qk_scale, cap2, POS, window, D, EVEN_D, True, False, False,
                                      PREC, SCALE_POS, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA)
    return acc, l_i, m_i


@triton.jit
def _dq_ctx_ranges(dq, rsum, q, do, lse2, delta, offs_m, qpos, qmin, qmax, k_base, v_base, stride_kt, stride_vt,
                   offs_n, offs_d, KLO, KHI, KNXT, r0, r1, qk_scale, cap2, POS, window, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, KD, VD, kcol, TMA: tl.constexpr,
                   HAS_SINKS: tl.constexpr):
    """dQ (and ``rsum``) over the context ranges ``r0..r1`` of ``KLO``/``KHI`` (a tree node's ancestors) in flat
    loops, none nested in a loop over the ranges: with the dQ accumulator carried through such a loop, ptxas
    serialized the wgmma pipeline (sm_90a, triton 3.6: dQ 17-20 % slower; docs/PREFIX_TREES.md). Without ``WINDOW``:
    every range's whole blocks unmasked (the first four ranges' addressed from the loop counter, :func:`_lead_block`;
    deeper ranges' by the walk that ``KNXT``, :func:`whole_range_next`, steers past ranges without one), then each
    range's ragged tail masked (one step per range; a range without a tail costs a fully masked step). With
    ``WINDOW``: each range's blocks :func:`_ctx_bounds` ``[a, te)`` in one loop, every step masked (keys ``< ce``,
    the window; the windowed forward keeps its loop over ranges)."""
    if WINDOW:
        steps, start, stop, ce = _ranges_walk(KLO, KHI, r0, r1, qmin, qmax, POS, window, BLOCK_N, WINDOW)
        r = r0
        for _ in range(0, steps):
            dq, rsum = _dq_step(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt,
                                offs_n, offs_d, start, ce, qk_scale, cap2, POS, window, D, EVEN_D, True, False, True,
                                PREC, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
            r, start, stop, ce = _ranges_next(KLO, KHI, r, r1, start, stop, ce, qmin, qmax, POS, window, BLOCK_N,
                                              WINDOW)
    else:
        steps, lo0, lo1, lo2, lo3, c1, c2, c3 = _lead_spans(KLO, KHI, r0, r1, BLOCK_N)
        for i in range(0, steps):
            start = _lead_block(i, lo0, lo1, lo2, lo3, c1, c2, c3, BLOCK_N)
            dq, rsum = _dq_step(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt,
                                offs_n, offs_d, start, start + BLOCK_N, qk_scale, cap2, POS, window, D, EVEN_D, False,
                                False, False, PREC, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
        steps, r, start, stop = _whole_walk(KLO, KHI, KNXT, r0 + 4, r1, BLOCK_N)
        for _ in range(0, steps):
            dq, rsum = _dq_step(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt,
                                offs_n, offs_d, start, stop, qk_scale, cap2, POS, window, D, EVEN_D, False, False,
                                False, PREC, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
            r, start, stop = _whole_next(KLO, KHI, KNXT, r, r1, start, stop, BLOCK_N)
        for r in range(r0, r1):
            cs, c_full, ce = _whole_span(KLO, KHI, r, True, BLOCK_N)
            dq, rsum = _dq_step(dq, rsum, q, do, lse2, delta, offs_m, qpos, k_base, v_base, stride_kt, stride_vt,
                                offs_n, offs_d, c_full, ce, qk_scale, cap2, POS, window, D, EVEN_D, True, False,
                                False, PREC, SOFTCAP, FAST_TANH, KD, VD, kcol, TMA, HAS_SINKS)
    return dq, rsum


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, k_idx, kpos, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                    offs_m, offs_d, lo, hi, qbound, qk_scale, cap2, POS, window, D: tl.constexpr,
                    BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, MASK_Q: tl.constexpr, CAUSAL: tl.constexpr,
                    WMASK: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
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
        if SOFTCAP:
            thT = _tanh(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale, FAST_TANH)
            qkT = thT * cap2
        else:
            qkT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
        pT = tl.math.exp2(qkT - lse2[None, :])
        if MASK_Q or WMASK:
            pT = tl.where(_keep(k_idx, qbound, q_idx, kpos, POS, window, False, CAUSAL, WMASK), pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        if SOFTCAP:  # d tanh folded into p once dV has it (the tanh tile is not live across the dpT dot)
            pT = pT * (1.0 - thT * thT)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _dkdv_own(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, offs_m,
              offs_d, k_start, se, qk_scale, cap2, POS, window, D: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr,
              SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, QD, DOD, qcol, TMA: tl.constexpr):
    """dK/dV of the key block ``[k_start, k_start + BLOCK_N)`` from its own segment's queries: the diagonal (causal,
    masked), then the queries after it (whole blocks, then the tail; with ``WINDOW`` only up to the last query whose
    window reaches the block, the blocks past the first key's window masked)."""
    diag_hi = tl.minimum(k_start + BLOCK_N, se)
    o_end = se
    q_hi = se
    if WINDOW:
        o_end = tl.maximum(tl.minimum(se, k_start + window), diag_hi)
        q_hi = tl.maximum(tl.minimum(se, diag_hi - 1 + window), diag_hi)
    o_full = diag_hi + ((o_end - diag_hi) // BLOCK_M) * BLOCK_M
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                             offs_m, offs_d, k_start, diag_hi, se, qk_scale, cap2, POS, window, D, BLOCK_M, EVEN_D,
                             True, True, WINDOW, PREC, SOFTCAP, FAST_TANH, QD, DOD, qcol, TMA)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                             offs_m, offs_d, diag_hi, o_full, se, qk_scale, cap2, POS, window, D, BLOCK_M, EVEN_D,
                             False, False, False, PREC, SOFTCAP, FAST_TANH, QD, DOD, qcol, TMA)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                             offs_m, offs_d, o_full, q_hi, se, qk_scale, cap2, POS, window, D, BLOCK_M, EVEN_D,
                             True, False, WINDOW, PREC, SOFTCAP, FAST_TANH, QD, DOD, qcol, TMA)
    return dk, dv


@triton.jit
def _dkdv_desc_range(dk, dv, k, v, offs_n, kpos, kmin, kmax, q_base, do_base, lse_base, delta_base, stride_qt,
                     stride_dot, offs_m, offs_d, cs, ce, qk_scale, cap2, POS, window, CU, NODE_OF, S,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_D: tl.constexpr, PREC: tl.constexpr,
                     WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, QD, DOD, qcol,
                     TMA: tl.constexpr):
    """dK/dV from a range ``[cs, ce)`` of later segments whose queries see every key of the block (a prefix's
    responses, a node's descendants): whole query blocks, then the ragged tail. With ``WINDOW`` the range is walked
    node by node (``NODE_OF``: token -> segment; positions are linear within a segment only): in each, the queries
    whose window holds the block's first key (``kmin``) whole, then those that reach its last (``kmax``) masked."""
    if WINDOW:
        j = tl.load(NODE_OF + tl.minimum(cs, ce - 1), mask=cs < ce, other=0)
        j = tl.where(cs < ce, j, S)
        go = j < S
        while go:
            ds = tl.maximum(tl.load(CU + j), cs)
            de = tl.minimum(tl.load(CU + j + 1), ce)
            qb = tl.load(POS + ds, mask=ds < de, other=0)
            fe = tl.minimum(de, ds + tl.maximum(kmin + window - qb, 0))
            qh = tl.maximum(tl.minimum(de, ds + tl.maximum(kmax + window - qb, 0)), ds)
            f = ds + (tl.maximum(fe - ds, 0) // BLOCK_M) * BLOCK_M
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt,
                                     stride_dot, offs_m, offs_d, ds, f, de, qk_scale, cap2, POS, window, D, BLOCK_M,
                                     EVEN_D, False, False, False, PREC, SOFTCAP, FAST_TANH, QD, DOD, qcol, TMA)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt,
                                     stride_dot, offs_m, offs_d, f, tl.maximum(qh, f), de, qk_scale, cap2, POS,
                                     window, D, BLOCK_M, EVEN_D, True, False, True, PREC, SOFTCAP, FAST_TANH, QD,
                                     DOD, qcol, TMA)
            j += 1
            go = (j < S) & (tl.load(CU + tl.minimum(j, S)) < ce)
    else:
        c_full = cs + ((ce - cs) // BLOCK_M) * BLOCK_M
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt,
                                 stride_dot, offs_m, offs_d, cs, c_full, ce, qk_scale, cap2, POS, window, D, BLOCK_M,
                                 EVEN_D, False, False, False, PREC, SOFTCAP, FAST_TANH, QD, DOD, qcol, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, offs_n, kpos, q_base, do_base, lse_base, delta_base, stride_qt,
                                 stride_dot, offs_m, offs_d, c_full, ce, ce, qk_scale, cap2, POS, window, D, BLOCK_M,
                                 EVEN_D, True, False, False, PREC, SOFTCAP, FAST_TANH, QD, DOD, qcol, TMA)
    return dk, dv


# ====================================================================================================== host side
def whole_range_next(lo: torch.Tensor, hi: torch.Tensor, block: int) -> torch.Tensor:
    """int32 ``(R+1,)``: for each context range ``r`` the first range ``>= r`` with at least one whole block of
    ``block`` keys (``hi - lo >= block``), ``R`` where none; entry ``R`` is ``R``. What the prefix-tree kernels'
    walk over whole blocks follows (:func:`_whole_next`); built on the device, no host sync."""
    r = lo.numel()
    idx = torch.arange(r, device=lo.device)
    cand = torch.where((hi.long() - lo.long()) >= block, idx, torch.full_like(idx, r))
    nxt = torch.flip(torch.cummin(torch.flip(cand, (0,)), 0).values, (0,)) if r else cand
    return torch.cat([nxt, idx.new_full((1,), r)]).to(torch.int32).contiguous()


def variant_tables(cu: torch.Tensor, ctx_tokens: torch.Tensor, total_tokens: int):
    """The window's int32 ``(T,)`` tables, on the device without a host sync: ``pos`` (each token's position in its
    own sequence: its offset in its segment plus the segment's context tokens) and ``node_of`` (its segment), from
    the bounded offsets ``cu`` ``(S+1,)`` and the context tokens per segment ``ctx_tokens`` ``(S,)``."""
    s = ctx_tokens.numel()
    tok = torch.arange(total_tokens, device=cu.device, dtype=torch.int64)
    node = torch.searchsorted(cu[1:].long().contiguous(), tok, right=True).clamp_(max=s - 1)
    pos = tok - cu.long()[node] + ctx_tokens.long()[node]
    return pos.to(torch.int32).contiguous(), node.to(torch.int32).contiguous()


def variant_args(scale: float, dtype: torch.dtype, window, softcap, sinks, interpreting: bool) -> dict:
    """The kernels' scalar/constexpr arguments of the variants: ``qk_scale`` (``scale * log2 e``, or ``scale /
    softcap`` with a soft-cap), ``cap2``, ``window``, ``SINKS`` (fp32 contiguous or None), ``SCALE_POS``,
    ``WINDOW``, ``SOFTCAP``, ``HAS_SINKS``, ``FAST_TANH``."""
    soft = softcap is not None
    return dict(qk_scale=scale / softcap if soft else scale * LOG2E, cap2=softcap * LOG2E if soft else 1.0,
                window=int(window) if window is not None else 0,
                SINKS=None if sinks is None else sinks.detach().float().contiguous(),
                SCALE_POS=(scale > 0) and not soft, WINDOW=window is not None, SOFTCAP=soft,
                HAS_SINKS=sinks is not None, FAST_TANH=soft and not interpreting and dtype != torch.float32)


def sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, rsum: torch.Tensor, dlse=None) -> torch.Tensor:
    """``dsinks[h] = -sum_t exp(sinks[h] - lse[h, t]) * (rsum[h, t] - dlse[h, t])`` (fp32 reduction in a fixed order:
    torch's deterministic sum, no atomics), in sinks' dtype. ``rsum`` fp32 ``(H, T)`` = ``rowsum(P * dP)`` =
    ``sum_j P_tj (dO_t . V_j)`` as the dQ kernel accumulates it (``HAS_SINKS``); mathematically ``rowsum(dO * O)``,
    but that Delta of the other gradients reads the stored O, rounded twice (P to the value dtype in the forward's PV
    product, then O to bf16/fp16), and those row errors, weighted by ``p_sink`` and summed over every row of a head,
    put bf16 dsinks at up to ~5x PyTorch's own bf16 error; from fp32 P and dP the sum is exact to fp32 rounding."""
    p = torch.exp(sinks.detach().float()[:, None] - lse)
    delta = rsum if dlse is None else rsum - dlse.float()
    return (-(p * delta).sum(1)).to(sinks.dtype)
