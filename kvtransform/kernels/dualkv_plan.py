"""The DualKV kernels' planning launches (``kernels/dualkv.py``): the layout as the kernels read it and the
heaviest-first work tables, built on the device by two small Triton kernels (no host sync, no sort). Their torch
specifications are ``bounded_layout``, ``segment_tables`` and ``work_table`` in ``kernels/dualkv_reference.py``
(the tests compare them). Source: DualKV (arXiv 2605.15422, §3) for the layout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

__all__ = ["LAYOUT_ASSERT_MSG", "plan_layout", "plan_work"]


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


def plan_layout(cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, total_tokens: int,
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


def plan_work(cub: torch.Tensor, ctx_lo: torch.Tensor, ctx_hi: torch.Tensor, block: int, total_tokens: int,
               per_block_sign: int):
    """``work_table`` of ``kernels/dualkv_reference.py`` (same tables) in one launch, from :func:`plan_layout`'s
    outputs."""
    s = ctx_lo.numel()
    w = triton.cdiv(total_tokens, block) + s
    wseg = torch.empty(w, dtype=torch.int32, device=cub.device)
    wblk = torch.empty(w, dtype=torch.int32, device=cub.device)
    jb = 64
    _plan_work_kernel[(triton.cdiv(w, jb),)](cub, ctx_lo, ctx_hi, wseg, wblk, s, w, block, SIGN=per_block_sign, JB=jb,
                                              SB=min(32, next_pow2(s, 16)), num_warps=4)
    return wseg, wblk, w
