"""Probe: the DualKV dK/dV kernel written in Gluon with explicitly asynchronous wgmma, against the shipped Triton
dK/dV kernel (``kernels/dualkv.py``) in the same process.

The shipped backward executes 7 matmuls for 5 useful ones and its dK/dV kernel runs its own at ~485-503 TFLOP/s
where the dQ kernel reaches ~620 (BENCHMARKS.md, "DualKV attention op"). This probe asks whether issuing the
products asynchronously (FlashAttention-3, Shah et al. 2024, arXiv 2407.08608, §3.2: ``S^T = K Q^T`` and
``dP^T = V dO^T`` in flight together, ``P^T`` computed while ``dP^T`` runs, ``dV += P^T dO`` and ``dK += dS^T Q``
left in flight into the next query block) lifts the dK/dV kernel. Deterministic as the shipped one: each dK/dV row
has one owner program, accumulated in a fixed order, no atomics.

Scope: plain DualKV (no window, soft-cap or sinks), bf16/fp16, head dim 128; one program per (``BLOCK_N`` keys of a
segment, KV head), looping over the GQA group's query heads and every query that sees the keys (its own segment's,
causally, then a prefix's responses); Q/dO blocks through TMA in a ring of ``STAGES``.

    python tools/gluon_dkdv_probe.py --compile-only            # sm_90a, no GPU: registers, spills, shared memory
    python tools/gluon_dkdv_probe.py                           # H200: checks (float64, shipped kernel), timing
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
                                                              warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# triton 3.6 names the TMA load async_copy_global_to_shared (3.9: async_load; the old name raises) and the CTA-wide
# barrier thread_barrier (3.9: barrier)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]

LOG2E = 1.4426950408889634


@gluon.jit
def _qstart(i, per_head, n_own, k_start, cs, BLOCK_M: gl.constexpr):
    """First query of step ``i``: per query head, the own segment's blocks from the key block on, then the context
    range's (a prefix's responses)."""
    jj = i % per_head
    return gl.where(jj < n_own, k_start + jj * BLOCK_M, cs + (jj - n_own) * BLOCK_M)


@gluon.jit
def _issue_q(q_desc, do_desc, q_smem, do_smem, q_bars, do_bars, i, per_head, n_own, k_start, cs, g, GROUP,
             BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    s = i % STAGES
    row = _qstart(i, per_head, n_own, k_start, cs, BLOCK_M)
    col = (g * GROUP + i // per_head) * HEAD_DIM
    mbarrier.expect(q_bars.index(s), q_desc.block_type.nbytes)
    _tma_load(q_desc, [row, col], q_bars.index(s), q_smem.index(s))
    mbarrier.expect(do_bars.index(s), do_desc.block_type.nbytes)
    _tma_load(do_desc, [row, col], do_bars.index(s), do_smem.index(s))


@gluon.jit
def gluon_dkdv_kernel(K, V, q_desc, do_desc, DK, DV, LSE, DELTA, CU, QLO, QHI, WSEG, WBLK, stride_kt, stride_kh,
                      stride_vt, stride_vh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, T, H_KV, GROUP, qk_scale,
                      sm_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    w = pid // H_KV
    g = pid % H_KV
    seg = gl.load(WSEG + w)
    if seg >= 0:
        blk = gl.load(WBLK + w)
        ss = gl.load(CU + seg)
        se = gl.load(CU + seg + 1)
        cs = gl.load(QLO + seg)
        ce = gl.load(QHI + seg)
        k_start = ss + blk * BLOCK_N
        n_own = (se - k_start + BLOCK_M - 1) // BLOCK_M
        per_head = n_own + (ce - cs + BLOCK_M - 1) // BLOCK_M
        n = GROUP * per_head
        dtype: gl.constexpr = q_desc.dtype

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], q_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], q_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(q_bars.index(i), count=1)
            mbarrier.init(do_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            if i < n:
                _issue_q(q_desc, do_desc, q_smem, do_smem, q_bars, do_bars, i, per_head, n_own, k_start, cs, g, GROUP,
                         BLOCK_M, HEAD_DIM, STAGES)

        # K and V once per program, by pointer (rows past the segment read as 0)
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        r_ld = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        kv_mask = (r_ld < se)[:, None]
        k_smem.store(gl.load(K + (r_ld.to(gl.int64) * stride_kt + g * stride_kh)[:, None] + d_ld[None, :],
                             mask=kv_mask, other=0.0))
        v_smem.store(gl.load(V + (r_ld.to(gl.int64) * stride_vt + g * stride_vh)[:, None] + d_ld[None, :],
                             mask=kv_mask, other=0.0))
        fence_async_shared()
        _cta_barrier()

        offs_k = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        offs_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        # dK and dV stay in flight from one step into the next: wgmma accumulators from the start
        dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, o_layout))
        dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, o_layout))
        p_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
        ds_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, a_layout)
        for i in range(n):
            st = i % STAGES
            ph = (i // STAGES) & 1
            jj = i % per_head
            h = g * GROUP + i // per_head
            in_own = jj < n_own
            q0 = _qstart(i, per_head, n_own, k_start, cs, BLOCK_M)
            q_idx = q0 + offs_q
            lse2 = gl.load(LSE + h.to(gl.int64) * T + q_idx, mask=q_idx < T, other=0.0) * 1.4426950408889634
            delta = gl.load(DELTA + h.to(gl.int64) * T + q_idx, mask=q_idx < T, other=0.0)
            mbarrier.wait(q_bars.index(st), ph)
            s_t = warpgroup_mma(k_smem, q_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_bars.index(st), ph)
            dp_t = warpgroup_mma(v_smem, do_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # in flight: dV, dK of step i - 1, then S^T, dP^T: all but dP^T done after this wait
            s_t, p_op, ds_op = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, p_op, ds_op))
            if num_warps > 4:  # a warpgroup waits for its own wgmma only
                _cta_barrier()
            if (i >= 1) & (i - 1 + STAGES < n):  # step i - 1's stage is free
                _issue_q(q_desc, do_desc, q_smem, do_smem, q_bars, do_bars, i - 1 + STAGES, per_head, n_own, k_start,
                         cs, g, GROUP, BLOCK_M, HEAD_DIM, STAGES)
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            bound = gl.where(in_own, se, ce)
            need = (q0 + BLOCK_M > bound) | (in_own & (q0 < k_start + BLOCK_N - 1))
            if need:
                keep = (q_idx[None, :] < bound) & ((q_idx[None, :] >= offs_k[:, None]) | (jj >= n_own))
                p_t = gl.where(keep, p_t, 0.0)
            p_op = gl.convert_layout(p_t.to(dtype), a_layout)
            dv = warpgroup_mma(p_op, do_smem.index(st), dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
            ds_t = p_t * (dp_t - delta[None, :])
            ds_op = gl.convert_layout(ds_t.to(dtype), a_layout)
            dk = warpgroup_mma(ds_op, q_smem.index(st), dk, is_async=True)
        dk, dv, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p_op, ds_op))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_bars.index(i))
            mbarrier.invalidate(do_bars.index(i))

        rows = k_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        rmask = (rows < se)[:, None]
        r64 = rows.to(gl.int64)
        gl.store(DK + (r64 * stride_dkt + g * stride_dkh)[:, None] + offs_d[None, :], (dk * sm_scale).to(dtype),
                 mask=rmask)
        gl.store(DV + (r64 * stride_dvt + g * stride_dvh)[:, None] + offs_d[None, :], dv.to(dtype), mask=rmask)


def gluon_dkdv(q, k, v, do, lse, delta, cu_seqlens, segment_prefix, scale, block_m=64, block_n=64, stages=2,
               num_warps=4):
    """``(dk, dv)`` of the plain DualKV attention (q ``(T, H, 128)`` bf16/fp16; lse, delta fp32 ``(H, T)``, delta
    = rowsum(dO * O))."""
    from kvtransform.kernels.dualkv import _dualkv_plan
    t, h, d = q.shape
    h_kv = k.shape[1]
    cub, ctx, plan = _dualkv_plan(cu_seqlens, segment_prefix, t, False)
    wseg, wblk, w = plan(block_n, -1)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    layout = gl.NVMMASharedLayout.get_default_for([block_m, d], _gl_dtype(q.dtype))
    qd, dod = (TensorDescriptor.from_tensor(x.reshape(t, h * d), [block_m, d], layout) for x in (q, do))
    gluon_dkdv_kernel[(w * h_kv,)](k, v, qd, dod, dk, dv, lse, delta, cub, ctx[2], ctx[3], wseg, wblk,
                                   k.stride(0), k.stride(1), v.stride(0), v.stride(1), dk.stride(0), dk.stride(1),
                                   dv.stride(0), dv.stride(1), t, h_kv, h // h_kv, scale * LOG2E, scale,
                                   BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, num_warps=num_warps)
    return dk, dv


# ---------------------------------------------------------------------------------------------------- warp-specialized
@gluon.jit
def _ws_dkdv_loader(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, empty, n, per_head, n_own, k_start, cs, g,
                    GROUP, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the Q and dO blocks of every step into the ring, a stage refilled once both consumers released it."""
    for i in range(n):
        st = i % STAGES
        mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # a fresh mbarrier passes phase 1 at once
        _issue_q(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, i, per_head, n_own, k_start, cs, g, GROUP,
                 BLOCK_M, HEAD_DIM, STAGES)


@gluon.jit
def _ws_dkdv_consumer(c, K, V, DK, DV, LSE, DELTA, k_smem, v_smem, q_smem, do_smem, q_ready, do_ready, empty, n,
                      per_head, n_own, k_start, ss, se, cs, ce, g, GROUP, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_dkt, stride_dkh, stride_dvt, stride_dvh, T, qk_scale, sm_scale, KEYS: gl.constexpr,
                      BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """One warpgroup: dK/dV of keys ``[k_start + c * KEYS, + KEYS)`` over every step, products as in
    :func:`gluon_dkdv_kernel`; it releases a stage once its dV and dK products of that step completed."""
    if n > 0:
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        k0 = k_start + c * KEYS
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r_ld = k0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, ld))
        d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        kv_mask = (r_ld < se)[:, None]
        k_smem.store(gl.load(K + (r_ld.to(gl.int64) * stride_kt + g * stride_kh)[:, None] + d_ld[None, :],
                             mask=kv_mask, other=0.0))
        v_smem.store(gl.load(V + (r_ld.to(gl.int64) * stride_vt + g * stride_vh)[:, None] + d_ld[None, :],
                             mask=kv_mask, other=0.0))
        fence_async_shared()
        _cta_barrier()
        offs_k = k0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
        offs_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
        dk = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, o_layout))
        dv = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, o_layout))
        p_op = gl.zeros([KEYS, BLOCK_M], dtype, a_layout)
        ds_op = gl.zeros([KEYS, BLOCK_M], dtype, a_layout)
        for i in range(n):
            st = i % STAGES
            ph = (i // STAGES) & 1
            jj = i % per_head
            h = g * GROUP + i // per_head
            in_own = jj < n_own
            q0 = _qstart(i, per_head, n_own, k_start, cs, BLOCK_M)
            q_idx = q0 + offs_q
            lse2 = gl.load(LSE + h.to(gl.int64) * T + q_idx, mask=q_idx < T, other=0.0) * 1.4426950408889634
            delta = gl.load(DELTA + h.to(gl.int64) * T + q_idx, mask=q_idx < T, other=0.0)
            mbarrier.wait(q_ready.index(st), ph)
            s_t = warpgroup_mma(k_smem, q_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(st), ph)
            dp_t = warpgroup_mma(v_smem, do_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_t, p_op, ds_op = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, p_op, ds_op))
            if i >= 1:  # step i - 1's dV and dK products are done: its stage goes back to the loader
                mbarrier.arrive(empty.index((i - 1) % STAGES), count=1)
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            bound = gl.where(in_own, se, ce)
            need = (q0 + BLOCK_M > bound) | (in_own & (q0 < k0 + KEYS - 1))
            if need:
                keep = (q_idx[None, :] < bound) & ((q_idx[None, :] >= offs_k[:, None]) | (jj >= n_own))
                p_t = gl.where(keep, p_t, 0.0)
            p_op = gl.convert_layout(p_t.to(dtype), a_layout)
            dv = warpgroup_mma(p_op, do_smem.index(st), dv, is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))
            ds_t = p_t * (dp_t - delta[None, :])
            ds_op = gl.convert_layout(ds_t.to(dtype), a_layout)
            dk = warpgroup_mma(ds_op, q_smem.index(st), dk, is_async=True)
        dk, dv, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv, p_op, ds_op))
        mbarrier.arrive(empty.index((n - 1) % STAGES), count=1)
        rows = k0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        rmask = (rows < se)[:, None]
        r64 = rows.to(gl.int64)
        gl.store(DK + (r64 * stride_dkt + g * stride_dkh)[:, None] + offs_d[None, :], (dk * sm_scale).to(dtype),
                 mask=rmask)
        gl.store(DV + (r64 * stride_dvt + g * stride_dvh)[:, None] + offs_d[None, :], dv.to(dtype), mask=rmask)


@gluon.jit
def gluon_ws_dkdv_kernel(K, V, q_desc, do_desc, DK, DV, LSE, DELTA, CU, QLO, QHI, WSEG, WBLK, stride_kt, stride_kh,
                         stride_vt, stride_vh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, T, H_KV, GROUP,
                         qk_scale, sm_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         STAGES: gl.constexpr, num_warps: gl.constexpr, CONSUMER_REGS: gl.constexpr = 240):
    """FlashAttention-3's warp specialisation for the dK/dV kernel: a loader warp streams Q/dO blocks through TMA,
    two consumer warpgroups (``num_warps`` = 4 each) own half of the ``BLOCK_N`` keys each, with up to
    ``CONSUMER_REGS`` registers (``setmaxnreg``) for their dK/dV accumulators."""
    KEYS: gl.constexpr = BLOCK_N // 2
    pid = gl.program_id(0)
    w = pid // H_KV
    g = pid % H_KV
    seg_raw = gl.load(WSEG + w)
    seg = gl.maximum(seg_raw, 0)
    blk = gl.load(WBLK + w)
    ss = gl.load(CU + seg)
    se = gl.load(CU + seg + 1)
    cs = gl.load(QLO + seg)
    ce = gl.load(QHI + seg)
    k_start = ss + blk * BLOCK_N
    n_own = (se - k_start + BLOCK_M - 1) // BLOCK_M
    per_head = n_own + (ce - cs + BLOCK_M - 1) // BLOCK_M
    n = gl.where(seg_raw >= 0, GROUP * per_head, 0)
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], q_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, KEYS, HEAD_DIM], q_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_ws_dkdv_consumer, (0, K, V, DK, DV, LSE, DELTA, k_smem.index(0), v_smem.index(0), q_smem, do_smem, q_ready,
                             do_ready, empty, n, per_head, n_own, k_start, ss, se, cs, ce, g, GROUP, stride_kt,
                             stride_kh, stride_vt, stride_vh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, T,
                             qk_scale, sm_scale, KEYS, BLOCK_M, HEAD_DIM, STAGES)),
        (_ws_dkdv_consumer, (1, K, V, DK, DV, LSE, DELTA, k_smem.index(1), v_smem.index(1), q_smem, do_smem, q_ready,
                             do_ready, empty, n, per_head, n_own, k_start, ss, se, cs, ce, g, GROUP, stride_kt,
                             stride_kh, stride_vt, stride_vh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, T,
                             qk_scale, sm_scale, KEYS, BLOCK_M, HEAD_DIM, STAGES)),
        (_ws_dkdv_loader, (q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, empty, n, per_head, n_own, k_start,
                           cs, g, GROUP, BLOCK_M, HEAD_DIM, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


def gluon_ws_dkdv(q, k, v, do, lse, delta, cu_seqlens, segment_prefix, scale, block_m=64, block_n=128, stages=3,
                  consumer_regs=240, maxnreg=168):
    """:func:`gluon_dkdv` with :func:`gluon_ws_dkdv_kernel`."""
    from kvtransform.kernels.dualkv import _dualkv_plan
    t, h, d = q.shape
    h_kv = k.shape[1]
    cub, ctx, plan = _dualkv_plan(cu_seqlens, segment_prefix, t, False)
    wseg, wblk, w = plan(block_n, -1)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    layout = gl.NVMMASharedLayout.get_default_for([block_m, d], _gl_dtype(q.dtype))
    qd, dod = (TensorDescriptor.from_tensor(x.reshape(t, h * d), [block_m, d], layout) for x in (q, do))
    gluon_ws_dkdv_kernel[(w * h_kv,)](k, v, qd, dod, dk, dv, lse, delta, cub, ctx[2], ctx[3], wseg, wblk,
                                      k.stride(0), k.stride(1), v.stride(0), v.stride(1), dk.stride(0), dk.stride(1),
                                      dv.stride(0), dv.stride(1), t, h_kv, h // h_kv, scale * LOG2E, scale,
                                      BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, num_warps=4,
                                      CONSUMER_REGS=consumer_regs, maxnreg=maxnreg)
    return dk, dv


def shipped_dkdv(q, k, v, do, lse, delta, cu_seqlens, segment_prefix, scale):
    """The shipped dK/dV kernel alone, launched as ``kernels.dualkv.launch_bwd`` launches it (default config)."""
    from kvtransform.kernels import dualkv as K
    t, h, d, h_kv, d_pad, prec = K._prep(q, k, v)
    cub, ctx, plan = K._dualkv_plan(cu_seqlens, segment_prefix, t, False)
    cfg = K._cfg("dkdv", d_pad, q.dtype, None)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    wseg, wblk, w = plan(bn, -1)
    qd, dod = K._tma_descriptors(q, do, bm) if cfg.get("TMA") else (None, None)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    va = K._variants(q, cub, None, scale, None, None, None)
    K._bwd_dkdv_kernel[(w * h_kv,)](
        q, k, v, do, dk, dv, lse, delta, cub, ctx[2], ctx[3], wseg, wblk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), t, h_kv, h // h_kv, va.pop("qk_scale"), scale,
        BLOCK_M=bm, BLOCK_N=bn, QD=qd, DOD=dod, TMA=qd is not None, D=d, D_PAD=d_pad, EVEN_D=(d == d_pad), PREC=prec,
        **K._only(K._bwd_dkdv_kernel, va), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dk, dv


# ---------------------------------------------------------------------------------------------------- compile only
def compile_only(block_m, block_n, stages, num_warps, dtype="bf16", ws=False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from kernel_resources import resources
    dt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    ql = gl.NVMMASharedLayout.get_default_for([block_m, 128], dt)
    desc = f"tensordesc<{dtype}[{block_m},128],{ql!r}>"
    sig = {"K": f"*{dtype}", "V": f"*{dtype}", "q_desc": desc, "do_desc": desc, "DK": f"*{dtype}",
           "DV": f"*{dtype}", "LSE": "*fp32", "DELTA": "*fp32", "CU": "*i32", "QLO": "*i32", "QHI": "*i32",
           "WSEG": "*i32", "WBLK": "*i32"}
    for name in ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_dkt", "stride_dkh", "stride_dvt",
                 "stride_dvh", "T", "H_KV", "GROUP"):
        sig[name] = "i32"
    sig.update(qk_scale="fp32", sm_scale="fp32")
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": 128, "STAGES": stages, "num_warps": num_warps}
    sig.update({name: "constexpr" for name in consts})
    opts = {"num_warps": num_warps}
    if ws:
        sig["CONSUMER_REGS"] = "constexpr"
        consts["CONSUMER_REGS"] = 240
        opts["maxnreg"] = 168
    src = GluonASTSource(gluon_ws_dkdv_kernel if ws else gluon_dkdv_kernel, sig, constexprs=consts)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    print(f"dkdv {'ws ' if ws else ''}{block_m}/{block_n}/{stages}/{num_warps}: {resources(ck)}", flush=True)


# BLOCK_M (queries per step), BLOCK_N (keys per program), stages, warps
CONFIGS = ((32, 64, 3, 4),)
WS_CONFIGS = ((64, 128, 3), (64, 128, 2), (32, 128, 4))  # BLOCK_M, BLOCK_N (two warpgroups of BLOCK_N / 2), stages


def _inputs(p, rs, device, dtype, heads=32, kv_heads=8, seed=0):
    from kvtransform.layout import DualKVLayout
    lay = DualKVLayout.from_lengths([(p, rs)], device=device)
    t = lay.total_tokens
    g = torch.Generator(device=device).manual_seed(seed + t)
    q = torch.randn(t, heads, 128, device=device, dtype=dtype, generator=g)
    k = torch.randn(t, kv_heads, 128, device=device, dtype=dtype, generator=g)
    v = torch.randn(t, kv_heads, 128, device=device, dtype=dtype, generator=g)
    do = torch.randn(t, heads, 128, device=device, dtype=dtype, generator=g)
    return lay, q, k, v, do


def _fwd_stats(lay, q, k, v, do, scale):
    from kvtransform.kernels.dualkv import dualkv_fwd
    out, lse = dualkv_fwd(q, k, v, lay.cu_seqlens, lay.segment_prefix, scale)
    delta = (out.float() * do.float()).sum(-1).t().contiguous()
    return lse.contiguous(), delta


def check(device, dtype):
    """Worst error of dK, dV against float64 autograd through the reference, divided by the shipped kernel's."""
    from kvtransform.kernels.dualkv_reference import dualkv_attention_reference
    worst = 0.0
    for p, rs in ((1, [1]), (77, [5, 130, 1]), (300, [129, 128, 257]), (1029, [333, 64, 1000]), (4099, [131, 2048])):
        lay, q, k, v, do = _inputs(p, rs, device, dtype)
        sc = 1 / math.sqrt(128)
        lse, delta = _fwd_stats(lay, q, k, v, do, sc)
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        ref, _ = dualkv_attention_reference(q64, k64, v64, lay.cu_seqlens, lay.segment_prefix, sc)
        rdk, rdv = torch.autograd.grad(ref, (k64, v64), do.double())
        sdk, sdv = shipped_dkdv(q, k, v, do, lse, delta, lay.cu_seqlens, lay.segment_prefix, sc)
        for cfg in WS_CONFIGS:
            gdk, gdv = gluon_ws_dkdv(q, k, v, do, lse, delta, lay.cu_seqlens, lay.segment_prefix, sc, *cfg)
            gdk2, gdv2 = gluon_ws_dkdv(q, k, v, do, lse, delta, lay.cu_seqlens, lay.segment_prefix, sc, *cfg)
            bitwise = torch.equal(gdk, gdk2) and torch.equal(gdv, gdv2)
            ratios = []
            for gx, sx, rx in ((gdk, sdk, rdk), (gdv, sdv, rdv)):
                eg = (gx.double() - rx).abs().max().item()
                es = (sx.double() - rx).abs().max().item()
                ratios.append(eg / max(es, 1e-6))
            worst = max(worst, *ratios)
            print(f"check P={p} R={rs} {cfg}: dK/dV error vs shipped {ratios[0]:.2f} / {ratios[1]:.2f}, "
                  f"bitwise across runs {bitwise}", flush=True)
    return worst


def timing(device, dtype, shapes, reps):
    from kvtransform.bench.runner import response_lengths
    for p, mb in shapes:
        lay, q, k, v, do = _inputs(p, response_lengths(mb), device, dtype)
        sc = 1 / math.sqrt(128)
        lse, delta = _fwd_stats(lay, q, k, v, do, sc)
        flops = 4.0 * 128 * 32 * lay.visible_pairs() * 2  # the dK/dV kernel's four products: 2x the forward's
        fns = {"shipped": lambda: shipped_dkdv(q, k, v, do, lse, delta, lay.cu_seqlens, lay.segment_prefix, sc)}
        for cfg in CONFIGS:
            fns[f"gluon {'/'.join(map(str, cfg))}"] = (
                lambda cfg=cfg: gluon_dkdv(q, k, v, do, lse, delta, lay.cu_seqlens, lay.segment_prefix, sc, *cfg))
        for cfg in WS_CONFIGS:
            fns[f"gluon ws {'/'.join(map(str, cfg))}"] = (
                lambda cfg=cfg: gluon_ws_dkdv(q, k, v, do, lse, delta, lay.cu_seqlens, lay.segment_prefix, sc, *cfg))
        for name, fn in fns.items():
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=reps)
            except Exception as e:  # noqa: BLE001 - a probe reports every candidate
                print(f"P={p} mb={mb} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            print(f"P={p} mb={mb} T={lay.total_tokens} {name}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s executed",
                  flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--shapes", default="8192:16,32768:4,5059:4")
    ap.add_argument("--reps", type=int, default=200, help="do_bench rep time, ms")
    a = ap.parse_args(argv)
    if a.compile_only:
        for cfg in WS_CONFIGS:
            try:
                compile_only(cfg[0], cfg[1], cfg[2], 4, ws=True)
            except Exception as e:  # noqa: BLE001
                print(f"{cfg}: {type(e).__name__}: {e}")
        return
    dev = torch.device("cuda")
    print(f"checks: worst gluon/shipped error ratio {check(dev, torch.bfloat16):.2f}", flush=True)
    timing(dev, torch.bfloat16, [tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")], a.reps)


if __name__ == "__main__":
    main()
