"""Probe: the DualKV forward written in Gluon (Triton's lower-level dialect) with explicitly asynchronous wgmma, against
the shipped Triton forward (``kernels/dualkv.py``) in the same process.

The question it answers: does FlashAttention-3's intra-warpgroup overlap (Shah et al. 2024, arXiv 2407.08608, §3.2:
issue the next block's ``Q K^T`` and this block's ``P V`` asynchronously, run the softmax while the tensor cores
work) lift the forward above what the Triton compiler's own pipelining reaches on the H200? Triton 3.6 cannot express
it (docs/DUALKV_BACKWARD.md); Gluon can (``warpgroup_mma(is_async=True)`` / ``warpgroup_mma_wait(num_outstanding)``).

Scope: the plain DualKV forward (no window, soft-cap or sinks), bf16/fp16, head dim 128, one query head per program,
K/V through TMA in a two-stage ring (separate K and V barriers: K is free once ``Q K^T`` completed, V one block
later). The work table, context ranges and bounded offsets are the shipped kernel's (``kernels/dualkv_plan.py``).

    python tools/gluon_fwd_probe.py --compile-only            # sm_90a, no GPU: registers, spills, shared memory
    python tools/gluon_fwd_probe.py                           # H200: checks (float64, shipped kernel), then timing
"""
from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if "--compile-only" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,  # noqa: E402
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

# triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 renamed it async_load (the old name raises)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# and the CTA-wide barrier thread_barrier (3.9: barrier)
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@gluon.jit
def _kstart(j, n_ctx, cs, ss, BLOCK_N: gl.constexpr):
    """First key of key block ``j``: the context range's blocks, then the own segment's."""
    return gl.where(j < n_ctx, cs + j * BLOCK_N, ss + (j - n_ctx) * BLOCK_N)


@gluon.jit
def _issue(desc, smem, bars, j, n_ctx, cs, ss, col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    s = j % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, desc.block_type.nbytes)
    _tma_load(desc, [_kstart(j, n_ctx, cs, ss, BLOCK_N), col], bar, smem.index(s))


@gluon.jit
def _logits(s, qk_scale, cap2, SOFTCAP: gl.constexpr):
    """Scores as the softmax takes them: raw (the scale is applied with the row max, one FMA) or, soft-capped (Gemma
    2), ``cap2 * tanh(s * qk_scale)`` in log2 units (``qk_scale = scale / softcap``, ``cap2 = softcap * log2(e)``)."""
    if SOFTCAP:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [s * qk_scale], dtype=gl.float32,
                                      is_pure=True, pack=1)
        s = t * cap2
    return s


@gluon.jit
def _masked(s, j, n_ctx, cs, ce, ss, se, q_start, offs_m, offs_n, BLOCK_N: gl.constexpr):
    """Scores of key block ``j`` with the keys a row must not see at -inf: past the context range (its last block)
    or, in the own segment, after the query (causal)."""
    kb = _kstart(j, n_ctx, cs, ss, BLOCK_N)
    in_ctx = j < n_ctx
    need = gl.where(in_ctx, kb + BLOCK_N > ce, kb + BLOCK_N - 1 > q_start)
    if need:
        k_idx = kb + offs_n
        kbound = gl.where(in_ctx, ce, se)
        keep = (k_idx[None, :] < kbound) & ((k_idx[None, :] <= offs_m[:, None]) | in_ctx)
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def gluon_fwd_kernel(Q, k_desc, v_desc, O, LSE, CU, KLO, KHI, WSEG, WBLK, stride_qt, stride_qh, stride_ot, stride_oh, T,
                     H, GROUP, qk_scale, cap2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                     STAGES: gl.constexpr, PACK: gl.constexpr, num_warps: gl.constexpr, SOFTCAP: gl.constexpr = False):
    """One program per (work entry, head unit). ``PACK == 1``: one query head, ``BLOCK_M`` tokens; ``PACK == GROUP``
    (the GQA group, a power of two): the group's query heads share the tile, row ``r`` = head ``r // (BLOCK_M /
    PACK)``, token ``r % (BLOCK_M / PACK)``, so each K/V block is loaded once for the group."""
    TOK: gl.constexpr = BLOCK_M // PACK  # query tokens per tile
    pid = gl.program_id(0)
    n_units = H // PACK
    w = pid // n_units
    u = pid % n_units
    seg = gl.load(WSEG + w)
    if seg >= 0:
        blk = gl.load(WBLK + w)
        ss = gl.load(CU + seg)
        se = gl.load(CU + seg + 1)
        cs = gl.load(KLO + seg)
        ce = gl.load(KHI + seg)
        hk = u if PACK > 1 else u // GROUP
        q_start = ss + blk * TOK
        q_end = gl.minimum(q_start + TOK, se)
        n_ctx = (ce - cs + BLOCK_N - 1) // BLOCK_N
        n = n_ctx + (q_end - ss + BLOCK_N - 1) // BLOCK_N
        dtype: gl.constexpr = k_desc.dtype
        e_scale = 1.0 if SOFTCAP else qk_scale  # the exponent's multiplier of the scores _logits returns

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], k_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        col = hk * HEAD_DIM
        for i in gl.static_range(STAGES):
            if i < n:
                _issue(k_desc, k_smem, k_bars, i, n_ctx, cs, ss, col, BLOCK_N, STAGES)
                _issue(v_desc, v_smem, v_bars, i, n_ctx, cs, ss, col, BLOCK_N, STAGES)

        # Q once per program, by pointer, into shared memory for the wgmma
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        r_ld = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        tok_ld = q_start + r_ld % TOK
        head_ld = (hk * GROUP + r_ld // TOK) if PACK > 1 else (u + r_ld * 0)
        d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        q_ptrs = Q + (tok_ld.to(gl.int64) * stride_qt + head_ld.to(gl.int64) * stride_qh)[:, None] + d_ld[None, :]
        q_smem.store(gl.load(q_ptrs, mask=(tok_ld < se)[:, None], other=0.0))
        fence_async_shared()
        _cta_barrier()
        offs_m = q_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout)) % TOK
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

        # block 0: Q K^T, then its softmax
        mbarrier.wait(k_bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if num_warps > 4:  # a warpgroup waits for its own wgmma only: both must be done with a stage before TMA
            # refills it
            _cta_barrier()
        if STAGES < n:
            _issue(k_desc, k_smem, k_bars, STAGES, n_ctx, cs, ss, col, BLOCK_N, STAGES)
        s = _masked(_logits(s, qk_scale, cap2, SOFTCAP), 0, n_ctx, cs, ce, ss, se, q_start, offs_m, offs_n, BLOCK_N)
        m_i = gl.max(s, axis=1)
        p = gl.exp2(s * e_scale - (m_i * e_scale)[:, None])
        l_i = gl.sum(p, axis=1)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        # block j: issue Q K_j^T and P_{j-1} V_{j-1}; the softmax of block j runs while P V is on the tensor cores
        for j in range(1, n):
            st = j % STAGES
            mbarrier.wait(k_bars.index(st), (j // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            pst = (j - 1) % STAGES
            mbarrier.wait(v_bars.index(pst), ((j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem.index(pst), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            s = _masked(_logits(s, qk_scale, cap2, SOFTCAP), j, n_ctx, cs, ce, ss, se, q_start, offs_m, offs_n, BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2((m_i - m_new) * e_scale)
            p = gl.exp2(s * e_scale - (m_new * e_scale)[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            if num_warps > 4:
                _cta_barrier()
            if j + STAGES < n:  # K_j and V_{j-1} are consumed
                _issue(k_desc, k_smem, k_bars, j + STAGES, n_ctx, cs, ss, col, BLOCK_N, STAGES)
            if j - 1 + STAGES < n:
                _issue(v_desc, v_smem, v_bars, j - 1 + STAGES, n_ctx, cs, ss, col, BLOCK_N, STAGES)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]

        lst = (n - 1) % STAGES
        mbarrier.wait(v_bars.index(lst), ((n - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(lst), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        l_o = gl.convert_layout(l_i, o_rows)
        out = acc / l_o[:, None]
        r_o = gl.arange(0, BLOCK_M, layout=o_rows)
        rows = q_start + r_o % TOK
        head = (hk * GROUP + r_o // TOK) if PACK > 1 else (u + r_o * 0)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = O + (rows.to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh)[:, None] + offs_d[None, :]
        gl.store(ptrs, out.to(dtype), mask=(rows < se)[:, None])
        lse = (gl.convert_layout(m_i, o_rows) * e_scale + gl.log2(l_o)) * 0.6931471805599453
        gl.store(LSE + head.to(gl.int64) * T + rows, lse, mask=rows < se)


# BLOCK_M (rows: tokens x packed heads), BLOCK_N, stages, warps, GQA heads packed into a tile
CONFIGS = ((128, 64, 3, 8, True), (128, 64, 2, 8, True), (128, 128, 2, 8, True), (64, 64, 3, 4, True),
           (64, 128, 2, 4, True), (64, 64, 3, 4, False))


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def descriptors(k, v, block_n: int):
    """TMA descriptors of K and V (blocks ``(block_n, D)``) as 2-D ``(T, H_kv * D)`` views."""
    t, h_kv, d = k.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], _gl_dtype(k.dtype))
    return [TensorDescriptor.from_tensor(x.reshape(t, h_kv * d), [block_n, d], layout) for x in (k, v)]


def gluon_fwd(q, k, v, cu_seqlens, segment_prefix, scale, block_m=128, block_n=128, stages=2, num_warps=8,
              softcap=None, pack=True):
    """``(out, lse)`` as ``kernels.dualkv.dualkv_fwd`` (plain or soft-capped; q ``(T, H, 128)`` bf16/fp16
    contiguous). ``pack``: the GQA group's query heads share a tile (the group must be a power of two)."""
    from kvtransform.kernels.dualkv import _dualkv_plan
    t, h, d = q.shape
    group = h // k.shape[1]
    pk = group if pack and group > 1 else 1
    cub, ctx, plan = _dualkv_plan(cu_seqlens, segment_prefix, t, False)
    wseg, wblk, w = plan(block_m // pk, +1)
    out = torch.empty_like(q)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    kd, vd = descriptors(k, v, block_n)
    gluon_fwd_kernel[(w * (h // pk),)](q, kd, vd, out, lse, cub, ctx[0], ctx[1], wseg, wblk, q.stride(0), q.stride(1),
                                       out.stride(0), out.stride(1), t, h, group,
                                       scale / softcap if softcap else scale * LOG2E, (softcap or 1.0) * LOG2E,
                                       BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, PACK=pk,
                                       num_warps=num_warps, SOFTCAP=bool(softcap))
    return out, lse


# ---------------------------------------------------------------------------------------------------- warp-specialized
@gluon.jit
def _ws_loader(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, n, n_ctx, cs, ss, col,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K and V blocks into the ring, each stage refilled once both consumers released it."""
    for j in range(n):
        st = j % STAGES
        mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)  # a fresh mbarrier passes phase 1 at once
        _issue(k_desc, k_smem, k_ready, j, n_ctx, cs, ss, col, BLOCK_N, STAGES)
        _issue(v_desc, v_smem, v_ready, j, n_ctx, cs, ss, col, BLOCK_N, STAGES)


@gluon.jit
def _ws_consumer(c, Q, O, LSE, q_smem, k_smem, v_smem, k_ready, v_ready, empty, turn, n, n_ctx, cs, ce, ss, se,
                 q_start, hk, u, stride_qt, stride_qh, stride_ot, stride_oh, T, GROUP, qk_scale, cap2,
                 ROWS: gl.constexpr, TOK: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr, PACK: gl.constexpr, SOFTCAP: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup: tile rows ``[c * ROWS, (c + 1) * ROWS)`` (of the packed ``PACK * TOK`` rows) against every key
    block, with the intra-warpgroup overlap of :func:`gluon_fwd_kernel`. ``PINGPONG`` (FlashAttention-3's
    inter-warpgroup schedule, §3.1): the two warpgroups take turns issuing their products (mbarriers ``turn``), so
    one's softmax runs while the other's products are on the tensor cores."""
    if n > 0:
        dtype: gl.constexpr = k_smem.dtype
        e_scale = 1.0 if SOFTCAP else qk_scale
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r_ld = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        tok_ld = q_start + r_ld % TOK
        head_ld = (hk * GROUP + r_ld // TOK) if PACK > 1 else (u + r_ld * 0)
        d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        q_ptrs = Q + (tok_ld.to(gl.int64) * stride_qt + head_ld.to(gl.int64) * stride_qh)[:, None] + d_ld[None, :]
        q_smem.store(gl.load(q_ptrs, mask=(tok_ld < se)[:, None], other=0.0))
        fence_async_shared()
        _cta_barrier()
        offs_m = q_start + (c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))) % TOK
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        s = _masked(_logits(s, qk_scale, cap2, SOFTCAP), 0, n_ctx, cs, ce, ss, se, q_start, offs_m, offs_n, BLOCK_N)
        m_i = gl.max(s, axis=1)
        p = gl.exp2(s * e_scale - (m_i * e_scale)[:, None])
        l_i = gl.sum(p, axis=1)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        for j in range(1, n):
            st = j % STAGES
            pst = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
            mbarrier.wait(v_ready.index(pst), ((j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            if PINGPONG:  # warpgroup 0 goes first: a fresh mbarrier passes phase 1 at once
                mbarrier.wait(turn.index(c), ((j - 1) & 1) ^ (1 - c))
            s = warpgroup_mma(q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(pst), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - c), count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            s = _masked(_logits(s, qk_scale, cap2, SOFTCAP), j, n_ctx, cs, ce, ss, se, q_start, offs_m, offs_n,
                        BLOCK_N)
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2((m_i - m_new) * e_scale)
            p = gl.exp2(s * e_scale - (m_new * e_scale)[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            mbarrier.arrive(empty.index(pst), count=1)  # this warpgroup is done with K_{j-1} and V_{j-1}
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        lst = (n - 1) % STAGES
        mbarrier.wait(v_ready.index(lst), ((n - 1) // STAGES) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(lst), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        mbarrier.arrive(empty.index(lst), count=1)

        l_o = gl.convert_layout(l_i, o_rows)
        out = acc / l_o[:, None]
        r_o = c * ROWS + gl.arange(0, ROWS, layout=o_rows)
        rows = q_start + r_o % TOK
        head = (hk * GROUP + r_o // TOK) if PACK > 1 else (u + r_o * 0)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = O + (rows.to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh)[:, None] + offs_d[None, :]
        gl.store(ptrs, out.to(dtype), mask=(rows < se)[:, None])
        lse = (gl.convert_layout(m_i, o_rows) * e_scale + gl.log2(l_o)) * 0.6931471805599453
        gl.store(LSE + head.to(gl.int64) * T + rows, lse, mask=rows < se)


@gluon.jit
def gluon_ws_fwd_kernel(Q, k_desc, v_desc, O, LSE, CU, KLO, KHI, WSEG, WBLK, stride_qt, stride_qh, stride_ot,
                        stride_oh, T, H, GROUP, qk_scale, cap2, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PACK: gl.constexpr, num_warps: gl.constexpr,
                        SOFTCAP: gl.constexpr = False, CONSUMER_REGS: gl.constexpr = 232,
                        PINGPONG: gl.constexpr = False):
    """FlashAttention-3's warp specialisation (arXiv 2407.08608, §3.1): a loader warp fills the K/V ring through TMA,
    two consumer warpgroups (``num_warps`` = 4 each) take half of the ``BLOCK_M`` tile rows each; stages are
    released through mbarriers (two arrivals), so no CTA-wide barrier runs in the loop."""
    TOK: gl.constexpr = BLOCK_M // PACK
    ROWS: gl.constexpr = BLOCK_M // 2
    pid = gl.program_id(0)
    n_units = H // PACK
    w = pid // n_units
    u = pid % n_units
    seg_raw = gl.load(WSEG + w)
    seg = gl.maximum(seg_raw, 0)
    blk = gl.load(WBLK + w)
    ss = gl.load(CU + seg)
    se = gl.load(CU + seg + 1)
    cs = gl.load(KLO + seg)
    ce = gl.load(KHI + seg)
    hk = u if PACK > 1 else u // GROUP
    q_start = ss + blk * TOK
    q_end = gl.minimum(q_start + TOK, se)
    n_ctx = (ce - cs + BLOCK_N - 1) // BLOCK_N
    n = gl.where(seg_raw >= 0, n_ctx + (q_end - ss + BLOCK_N - 1) // BLOCK_N, 0)
    dtype: gl.constexpr = k_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], k_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    col = hk * HEAD_DIM
    gl.warp_specialize([
        (_ws_consumer, (0, Q, O, LSE, q_smem.index(0), k_smem, v_smem, k_ready, v_ready, empty, turn, n, n_ctx, cs,
                        ce, ss, se, q_start, hk, u, stride_qt, stride_qh, stride_ot, stride_oh, T, GROUP, qk_scale,
                        cap2, ROWS, TOK, BLOCK_N, HEAD_DIM, STAGES, PACK, SOFTCAP, PINGPONG)),
        (_ws_consumer, (1, Q, O, LSE, q_smem.index(1), k_smem, v_smem, k_ready, v_ready, empty, turn, n, n_ctx, cs,
                        ce, ss, se, q_start, hk, u, stride_qt, stride_qh, stride_ot, stride_oh, T, GROUP, qk_scale,
                        cap2, ROWS, TOK, BLOCK_N, HEAD_DIM, STAGES, PACK, SOFTCAP, PINGPONG)),
        (_ws_loader, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, empty, n, n_ctx, cs, ss, col, BLOCK_N,
                      STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


def gluon_ws_fwd(q, k, v, cu_seqlens, segment_prefix, scale, block_m=128, block_n=128, stages=2, softcap=None,
                 pack=True, consumer_regs=232, maxnreg=168, pingpong=False):
    """:func:`gluon_fwd` with :func:`gluon_ws_fwd_kernel` (two consumer warpgroups and a loader warp)."""
    from kvtransform.kernels.dualkv import _dualkv_plan
    t, h, d = q.shape
    group = h // k.shape[1]
    pk = group if pack and group > 1 else 1
    cub, ctx, plan = _dualkv_plan(cu_seqlens, segment_prefix, t, False)
    wseg, wblk, w = plan(block_m // pk, +1)
    out = torch.empty_like(q)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    kd, vd = descriptors(k, v, block_n)
    gluon_ws_fwd_kernel[(w * (h // pk),)](q, kd, vd, out, lse, cub, ctx[0], ctx[1], wseg, wblk, q.stride(0),
                                          q.stride(1), out.stride(0), out.stride(1), t, h, group,
                                          scale / softcap if softcap else scale * LOG2E, (softcap or 1.0) * LOG2E,
                                          BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, PACK=pk,
                                          num_warps=4, SOFTCAP=bool(softcap), CONSUMER_REGS=consumer_regs,
                                          PINGPONG=pingpong, maxnreg=maxnreg)
    return out, lse


# ---------------------------------------------------------------------------------------------------- compile only
def compile_only(block_m, block_n, stages, num_warps, dtype="bf16", softcap=False, pack=4, ws=False,
                 pingpong=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    dt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    kl = gl.NVMMASharedLayout.get_default_for([block_n, 128], dt)
    sig = {"Q": f"*{dtype}", "k_desc": f"tensordesc<{dtype}[{block_n},128],{kl!r}>",
           "v_desc": f"tensordesc<{dtype}[{block_n},128],{kl!r}>", "O": f"*{dtype}", "LSE": "*fp32", "CU": "*i32",
           "KLO": "*i32", "KHI": "*i32", "WSEG": "*i32", "WBLK": "*i32", "stride_qt": "i32", "stride_qh": "i32",
           "stride_ot": "i32", "stride_oh": "i32", "T": "i32", "H": "i32", "GROUP": "i32", "qk_scale": "fp32",
           "cap2": "fp32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HEAD_DIM": "constexpr",
           "STAGES": "constexpr", "PACK": "constexpr", "num_warps": "constexpr", "SOFTCAP": "constexpr"}
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": 128, "STAGES": stages, "num_warps": num_warps,
              "SOFTCAP": softcap, "PACK": pack}
    opts = {"num_warps": num_warps}
    if ws:
        sig["CONSUMER_REGS"] = sig["PINGPONG"] = "constexpr"
        consts["CONSUMER_REGS"] = 232
        consts["PINGPONG"] = pingpong
        opts["maxnreg"] = 168
    src = GluonASTSource(gluon_ws_fwd_kernel if ws else gluon_fwd_kernel, sig, constexprs=consts)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_resources import resources
    r = resources(ck)
    ptx = ck.asm["ptx"]
    print(f"{'ws ' if ws else ''}{block_m}/{block_n}/{stages}/{num_warps} pack {pack} softcap {softcap}: {r} "
          f"wgmma {ptx.count('wgmma.mma_async')} "
          f"wait_group {ptx.count('wgmma.wait_group')}", flush=True)
    return ck


# ---------------------------------------------------------------------------------------------------- on the GPU
def _layout(p, rs, device):
    from kvtransform.layout import DualKVLayout
    lay = DualKVLayout.from_lengths([(p, rs)], device=device)
    return lay


def check(device, dtype, softcap=None, fwd=None):
    """Worst error against float64 divided by the shipped kernel's, over odd layouts (GQA 32/8)."""
    from kvtransform.kernels.dualkv import dualkv_fwd
    from kvtransform.kernels.dualkv_reference import dualkv_attention_reference
    worst = 0.0
    for p, rs in ((1, [1]), (77, [5, 130, 1]), (300, [129, 128, 257]), (1029, [333, 64, 1000]), (4099, [131, 2048])):
        lay = _layout(p, rs, device)
        t = lay.total_tokens
        g = torch.Generator(device=device).manual_seed(t)
        q = torch.randn(t, 32, 128, device=device, dtype=dtype, generator=g)
        k = torch.randn(t, 8, 128, device=device, dtype=dtype, generator=g)
        v = torch.randn(t, 8, 128, device=device, dtype=dtype, generator=g)
        sc = 1 / math.sqrt(128)
        ref, ref_lse = dualkv_attention_reference(q.double(), k.double(), v.double(), lay.cu_seqlens,
                                                  lay.segment_prefix, sc, softcap=softcap)
        o1, l1 = dualkv_fwd(q, k, v, lay.cu_seqlens, lay.segment_prefix, sc, softcap=softcap)
        o2, l2 = (fwd or gluon_fwd)(q, k, v, lay.cu_seqlens, lay.segment_prefix, sc, softcap=softcap)
        e1 = (o1.double() - ref).abs().max().item()
        e2 = (o2.double() - ref).abs().max().item()
        le = (l2.double() - ref_lse.reshape(l2.shape)).abs().max().item() if ref_lse is not None else float("nan")
        r = e2 / max(e1, 1e-6)
        worst = max(worst, r)
        print(f"check softcap={softcap} P={p} R={rs}: gluon err {e2:.3e} shipped {e1:.3e} ratio {r:.2f} "
              f"lse err {le:.2e}", flush=True)
    return worst


# BLOCK_M, BLOCK_N, stages, ping-pong
WS_CONFIGS = ((128, 64, 4, False), (128, 64, 4, True), (128, 64, 5, True), (128, 128, 2, True))


def timing(device, dtype, shapes, reps, softcap_shapes=(), ws=False):
    from kvtransform.kernels.dualkv import dualkv_fwd
    from kvtransform.bench.runner import response_lengths
    for p, mb in shapes:
        rs = response_lengths(mb)
        lay = _layout(p, rs, device)
        t = lay.total_tokens
        q = torch.randn(t, 32, 128, device=device, dtype=dtype)
        k = torch.randn(t, 8, 128, device=device, dtype=dtype)
        v = torch.randn(t, 8, 128, device=device, dtype=dtype)
        sc = 1 / math.sqrt(128)
        flops = 4.0 * 128 * 32 * lay.visible_pairs()
        res = {}
        fns = {"shipped": lambda: dualkv_fwd(q, k, v, lay.cu_seqlens, lay.segment_prefix, sc)}
        for bm, bn, st, pp in (WS_CONFIGS if ws else ()):
            name = f"gluon ws {bm}/{bn}/{st}{' ping-pong' if pp else ''}"
            fns[name] = (lambda bm=bm, bn=bn, st=st, pp=pp: gluon_ws_fwd(
                q, k, v, lay.cu_seqlens, lay.segment_prefix, sc, block_m=bm, block_n=bn, stages=st, pingpong=pp))
            if (p, mb) in softcap_shapes:
                fns[name + " softcap 50"] = (lambda bm=bm, bn=bn, st=st, pp=pp: gluon_ws_fwd(
                    q, k, v, lay.cu_seqlens, lay.segment_prefix, sc, block_m=bm, block_n=bn, stages=st, softcap=50.0,
                    pingpong=pp))
        for bm, bn, st, nw, pk in (() if ws else CONFIGS):
            fns[f"gluon {bm}/{bn}/{st}/{nw}{' packed' if pk else ''}"] = (
                lambda bm=bm, bn=bn, st=st, nw=nw, pk=pk: gluon_fwd(q, k, v, lay.cu_seqlens, lay.segment_prefix, sc,
                                                                    block_m=bm, block_n=bn, stages=st, num_warps=nw,
                                                                    pack=pk))
        if (p, mb) in softcap_shapes:
            fns["shipped softcap 50"] = lambda: dualkv_fwd(q, k, v, lay.cu_seqlens, lay.segment_prefix, sc,
                                                           softcap=50.0)
            for bm, bn, st, nw, pk in (() if ws else CONFIGS):
                fns[f"gluon {bm}/{bn}/{st}/{nw}{' packed' if pk else ''} softcap 50"] = (
                    lambda bm=bm, bn=bn, st=st, nw=nw, pk=pk: gluon_fwd(q, k, v, lay.cu_seqlens, lay.segment_prefix,
                                                                        sc, block_m=bm, block_n=bn, stages=st,
                                                                        num_warps=nw, softcap=50.0, pack=pk))
        for name, fn in fns.items():
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=reps)
            except Exception as e:  # noqa: BLE001 - a probe reports every candidate
                print(f"P={p} mb={mb} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            res[name] = ms
            print(f"P={p} mb={mb} T={t} {name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        o1, _ = fns["shipped"]()
        o2, _ = (gluon_ws_fwd if ws else gluon_fwd)(q, k, v, lay.cu_seqlens, lay.segment_prefix, sc)
        print(f"P={p} mb={mb}: max |gluon - shipped| {(o1.float() - o2.float()).abs().max().item():.3e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shapes", default="8192:16,32768:4,5059:4,16384:16")
    ap.add_argument("--softcap-shapes", default="32768:4", help="shapes also timed soft-capped (50)")
    ap.add_argument("--ws", action="store_true", help="the warp-specialized kernel (gluon_ws_fwd_kernel)")
    ap.add_argument("--reps", type=int, default=300, help="do_bench rep time, ms")
    a = ap.parse_args(argv)
    if a.compile_only:
        for cfg in CONFIGS:
            try:
                bm, bn, st, nw, pk = cfg
                compile_only(bm, bn, st, nw, pack=4 if pk else 1)
                compile_only(bm, bn, st, nw, softcap=True, pack=4 if pk else 1)
            except Exception as e:  # noqa: BLE001
                print(f"{cfg}: {type(e).__name__}: {e}")
        return
    dev = torch.device("cuda")
    fwd = (lambda *args, **kw: gluon_ws_fwd(*args, block_n=64, stages=4, pingpong=True, **kw)) if a.ws else gluon_fwd
    worst = max(check(dev, torch.bfloat16, fwd=fwd), check(dev, torch.bfloat16, softcap=50.0, fwd=fwd))
    print(f"checks: worst gluon/shipped error ratio {worst:.2f}", flush=True)

    def parse(text):
        return [tuple(int(x) for x in s.split(":")) for s in text.split(",") if s]
    timing(dev, torch.bfloat16, parse(a.shapes), a.reps, parse(a.softcap_shapes), a.ws)


if __name__ == "__main__":
    main()
