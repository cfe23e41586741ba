"""Retrieval scoring for SpeContext sparse decode (arXiv 2512.00722, §4.3): Triton scoring kernels + PyTorch reference.

Once per decode step a small retrieval head scores every cached token; the B best tokens of each KV head are then
attended in every layer (``kernels/sparse_decode.py``). The score of token ``j`` for KV head ``k`` is

    g[b, k, j] = max over query heads h of group k of  softmax_j(q[b, h] · K[b, k, j] · scale)

i.e. the per-query-head attention probability, element-wise max over the GQA group (query head ``h`` belongs to
KV head ``h // (H_r // H_r_kv)``). ``exp`` is monotonic, so the kernels rank by the log-probability
``max_h (s[h, j] - lse[h])`` instead; the top-B set is the same.

Layouts:
    q        ``(batch, H_r, D_r)``            retrieval queries of the new token (fp32 / fp16 / bf16)
    k        ``(batch, H_r_kv, S_max, D_r)``  retrieval key cache, same dtype; the last dim must be contiguous
    lengths  ``(batch,)`` int32               valid keys per row: positions ``[0, lengths[b])``; values above
                                               ``S_max`` are clamped to ``S_max`` by the kernels
    returns  ``(batch, H_r_kv, budget)`` int32 token positions; see :func:`select_topk` for order and padding.

On CUDA the scoring is two Triton kernels (scores + per-block softmax partials, then LSE-normalised group max),
the selection is ``torch.topk``. The reference (:func:`retrieval_scores_reference`) computes the same in fp64.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import dot_precision, next_pow2

_NEG_INF = float("-inf")
# positions per program of the group-max pass (an element-wise pass: wide blocks, so a 35K-slot cache is ~70
# programs per (row, KV head) instead of ~550 of the scoring kernel's 64)
GROUP_MAX_BLOCK = 512


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _retrieval_score_kernel(
    Q, K, LEN, SCORES, PART_M, PART_L,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks,
    H_R, H_KV, S_MAX, NUM_BLOCKS, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCKS_PER_PROG: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program = one (row, KV head) and BLOCKS_PER_PROG consecutive blocks of BLOCK_S positions (a loop, so
    the K loads pipeline). Each K block is loaded once for the whole GQA group; the program writes raw scaled scores
    (fp32) and per-head, per-block softmax partials (max, sum of exp) for the LSE. Only blocks holding positions
    below the row's length are visited: scores past the length and the partials of blocks past it are left
    unwritten (the group max never reads the former; the host masks the latter), so a cache sized for the whole
    generation costs no work per slot past each row's length."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    length = tl.minimum(tl.load(LEN + b), S_MAX)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kvh * G + offs_g
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    row = b.to(tl.int64) * H_R + heads
    first = pid_s * BLOCKS_PER_PROG
    live = tl.minimum(tl.maximum(tl.cdiv(length, BLOCK_S) - first, 0), BLOCKS_PER_PROG)
    for i in range(0, live):
        blk = first + i
        offs_s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
        smask = offs_s < length
        k = tl.load(k_base + offs_s[:, None].to(tl.int64) * stride_ks + offs_d[None, :],
                    mask=smask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale  # (G_PAD, BLOCK_S) fp32
        s = tl.where(smask[None, :], s, float("-inf"))
        tl.store(SCORES + row[:, None] * S_MAX + offs_s[None, :], s, mask=gmask[:, None] & smask[None, :])
        m = tl.max(s, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l = tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
        pmask = gmask & ((offs_g * 0 + blk) < NUM_BLOCKS)
        tl.store(PART_M + row * NUM_BLOCKS + blk, m, mask=pmask)
        tl.store(PART_L + row * NUM_BLOCKS + blk, l, mask=pmask)


@triton.jit
def _group_max_kernel(
    SCORES, LSE, LEN, OUT,
    H_R, H_KV, S_MAX, SINK, RECENT,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """OUT[b, k, j] = max_h (scores[b, h, j] - lse[b, h]) over the group of KV head k; +inf for forced (sink /
    recent) positions, -inf at and past the row's length."""
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    length = tl.minimum(tl.load(LEN + b), S_MAX)

    offs_g = tl.arange(0, G_PAD)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    gmask = offs_g < G
    valid = offs_s < length
    row = b.to(tl.int64) * H_R + kvh * G + offs_g
    s = tl.load(SCORES + row[:, None] * S_MAX + offs_s[None, :], mask=gmask[:, None] & valid[None, :],
                other=float("-inf"))
    lse = tl.load(LSE + row, mask=gmask, other=0.0)
    g = tl.max(s - lse[:, None], axis=0)
    forced = valid & ((offs_s < SINK) | (offs_s >= length - RECENT))
    g = tl.where(forced, float("inf"), g)
    g = tl.where(valid, g, float("-inf"))
    tl.store(OUT + pid_bh.to(tl.int64) * S_MAX + offs_s, g, mask=offs_s < S_MAX)


def retrieval_scores_triton(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                            sink: int = 0, recent: int = 0, block_s: int = 64,
                            num_warps: int = 4, blocks_per_prog: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Group-max retrieval scores with Triton: ``(batch, H_r_kv, S_max)`` fp32 log-probabilities (group max of
    ``s - lse``), ``+inf`` at forced sink/recent positions, ``-inf`` at positions ``>= lengths[b]``.

    Shapes as the module docstring. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
    ``block_s`` / ``num_warps`` / ``blocks_per_prog`` / ``num_stages`` are the scoring kernel's launch config; the
    defaults were the best of an 18-config sweep on an H200 (batch 32, 32/8 heads, D 128, S 32K, bf16: 0.679 ms,
    3.16 TB/s of K read, against 0.738 ms for one 128-block per program; BENCHMARKS.md, "SpeContext decode ops")."""
    b, h_r, d = q.shape
    h_kv, s_max = k.shape[1], k.shape[2]
    g = h_r // h_kv
    assert k.stride(-1) == 1, "retrieval key cache: last dim must be contiguous"
    nb = triton.cdiv(s_max, block_s)
    scores = torch.empty((b, h_r, s_max), device=q.device, dtype=torch.float32)
    part_m = torch.empty((b, h_r, nb), device=q.device, dtype=torch.float32)
    part_l = torch.empty((b, h_r, nb), device=q.device, dtype=torch.float32)
    lengths = lengths.to(device=q.device, dtype=torch.int32).contiguous()  # the kernels read LEN + b
    bpp = max(1, min(int(blocks_per_prog), nb))
    _retrieval_score_kernel[(triton.cdiv(nb, bpp), b * h_kv)](
        q, k, lengths, scores, part_m, part_l,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        h_r, h_kv, s_max, nb, float(scale),
        G=g, G_PAD=next_pow2(g, 16), D=d, D_PAD=next_pow2(d, 16), BLOCK_S=block_s, BLOCKS_PER_PROG=bpp,
        DOT_PREC=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    # LSE per query head from the block partials (tiny: batch * H_r * S_max / block_s floats); the kernel wrote
    # those of the blocks below each row's length only
    live = torch.arange(nb, device=q.device) < ((lengths.clamp(max=s_max) + block_s - 1) // block_s)[:, None]
    part_m = torch.where(live[:, None, :], part_m, float("-inf"))
    part_l = torch.where(live[:, None, :], part_l, 0.0)
    m_all = part_m.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    lse = (m_safe + torch.log((part_l * torch.exp(part_m - m_safe)).sum(dim=-1, keepdim=True))).squeeze(-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # empty rows: every score is -inf anyway
    out = torch.empty((b, h_kv, s_max), device=q.device, dtype=torch.float32)
    gm_block = min(GROUP_MAX_BLOCK, next_pow2(s_max, 16))
    _group_max_kernel[(triton.cdiv(s_max, gm_block), b * h_kv)](
        scores, lse.contiguous(), lengths, out,
        h_r, h_kv, s_max, int(sink), int(recent),
        G=g, G_PAD=next_pow2(g, 2), BLOCK_S=gm_block, num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Reference and shared selection
# ----------------------------------------------------------------------------------------------------------------
def retrieval_scores_reference(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float,
                               sink: int = 0, recent: int = 0,
                               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Plain-PyTorch group-max retrieval scores, same contract as :func:`retrieval_scores_triton`, computed in
    ``dtype`` (fp64 by default)."""
    b, h_r, d = q.shape
    h_kv, s_max = k.shape[1], k.shape[2]
    g = h_r // h_kv
    qf = q.to(dtype).view(b, h_kv, g, d)
    s = torch.einsum("bkgd,bksd->bkgs", qf, k.to(dtype)) * scale
    pos = torch.arange(s_max, device=q.device)
    lens = lengths.to(device=q.device, dtype=torch.int64).clamp(max=s_max)
    valid = pos[None, :] < lens[:, None]  # (b, S_max)
    s = s.masked_fill(~valid[:, None, None, :], _NEG_INF)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    gm = (s - lse).amax(dim=2)  # (b, H_kv, S_max)
    forced = valid & ((pos[None, :] < sink) | (pos[None, :] >= (lens[:, None] - recent)))
    gm = gm.masked_fill(forced[:, None, :], float("inf"))
    return gm.masked_fill(~valid[:, None, :], _NEG_INF)


def select_topk(scores: torch.Tensor, budget: int, ordered: bool = True) -> torch.Tensor:
    """Top-``budget`` positions per (row, KV head) of a score tensor ``(batch, H_kv, S_max)`` whose invalid
    positions are ``-inf``.

    Returns int32 ``(batch, H_kv, budget)``: positions in descending score order (ties: unspecified), followed by
    ``-1`` padding where the row has fewer than ``budget`` valid positions (so a row with ``lengths[b] <= budget``
    gets exactly its positions ``0 .. lengths[b]-1``, in some order, then ``-1``). Never repeats a position.
    ``ordered=False``: the same set, in no particular order, the ``-1`` padding anywhere among it (what sparse
    decode takes: the runtime sorts each step's selection by position anyway), without the sort of ``torch.topk``
    (H200, 256 rows, 2048 of 32K: 0.168 instead of 0.202 ms; BENCHMARKS.md, "SpeContext decode ops")."""
    b, h_kv, s_max = scores.shape
    kk = min(int(budget), s_max)
    if kk > 0:
        vals, idx = torch.topk(scores, kk, dim=-1, largest=True, sorted=bool(ordered))
        idx = torch.where(vals == _NEG_INF, torch.full_like(idx, -1), idx).to(torch.int32)
    else:
        idx = torch.empty((b, h_kv, 0), device=scores.device, dtype=torch.int32)
    if kk < budget:
        pad = torch.full((b, h_kv, budget - kk), -1, device=scores.device, dtype=torch.int32)
        idx = torch.cat([idx, pad], dim=-1)
    return idx.contiguous()


def retrieval_topk_reference(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, budget: int,
                             sink: int = 0, recent: int = 0, scale: Optional[float] = None) -> torch.Tensor:
    """Reference ``kvt::retrieval_topk`` (fp64 scoring + ``torch.topk``); the CPU path of the op."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return select_topk(retrieval_scores_reference(q, k, lengths, scale, sink, recent), budget)


def retrieval_topk_triton(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, budget: int,
                          sink: int = 0, recent: int = 0, scale: Optional[float] = None,
                          **launch) -> torch.Tensor:
    """Triton ``kvt::retrieval_topk``: Triton scoring + ``torch.topk``; the CUDA path of the op. ``launch``: the
    scoring launch config (see :func:`retrieval_scores_triton`)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not math.isfinite(scale):
        raise ValueError("retrieval scale must be finite")
    return select_topk(retrieval_scores_triton(q, k, lengths, scale, sink, recent, **launch), budget)
