"""Gather-attention decode for SpeContext (arXiv 2512.00722, §4.3): Triton split-K kernel + PyTorch reference.

One new token per row attends to the ``B`` cached tokens that retrieval selected for its KV head (plus, optionally,
its own K/V, which need not be in the cache yet):

    out[b, h] = softmax_j( q[b, h] · K[b, k, j] · scale ) · V[b, k, j],   j ∈ sel[b, k] ∪ {new},  k = h // (H // H_kv)

Two modes share one kernel:

* **gather** (``indices`` given): ``K``/``V`` are the full caches ``(batch, H_kv, S_max, D)``, ``indices`` is
  ``(batch, H_kv, B)`` int32 (int64 accepted) positions into them. An entry is used iff ``0 <= idx < min(lengths[b],
  S_max)``; ``-1`` is the padding value (anything else out of range is masked too: never read). A position listed
  twice is counted twice (the op's Python wrapper rejects duplicates where it validates).
* **slots** (``indices`` is None): ``K``/``V`` are dense budget-sized slot buffers ``(batch, H_kv, B, D)`` (the
  selected tokens already copied there, e.g. from CPU); slots ``[0, min(lengths[b], B))`` are used.

Flash-decoding: the grid is ``(batch * H_kv, num_splits)``; each program streams its share of the selected tokens
of one KV head, loading each gathered K/V row once for all ``G = H / H_kv`` query heads of the group (a
``(G_pad x D) @ (D x BLOCK_N)`` dot), and writes a normalised partial output and its LSE (fp32, natural log). In
gather mode a split is a fixed range of the ``B`` indices; in slot mode the splits share each row's own length (the
grid is sized for the buffer's ``S``, a static bound that CUDA graphs need, but a row's tokens spread over all its
splits however short it is: with one range per split of ``S``, a row shorter than ``S / num_splits`` left every split
after the first idle).
A second kernel merges the splits and the new token's own score with the usual LSE rescaling.

Rows with nothing to attend (no valid entry and no new token) output zeros.

Attention variants (:func:`sparse_decode_reference` defines them): a ``window`` limits both modes to the cache
positions ``j > lengths[b] - window`` (in gather mode, a window whose cache part fits in ``B`` runs the positional
loop over it instead of the indices, so blocks outside the window are never visited); ``softcap`` caps the scores in
the split and merge kernels; ``sinks`` add one term per query head to the merged denominator.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import dot_precision, last_dim_contiguous, next_pow2, num_sms

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    """tanh from exp2 (exact limits ±1 for large |x|; absolute error ~1 ulp of 1 near 0)."""
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _sparse_decode_split_kernel(
    Q, K, V, IDX, LEN, O_PART, LSE_PART,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ib, stride_ih,
    H, H_KV, S_MAX, N_SEL, TOK_PER_SPLIT, NUM_SPLITS, qk_scale, WINDOW, cap2,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    GATHER: tl.constexpr, DOT_PREC: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    b64 = b.to(tl.int64)
    length = tl.minimum(tl.load(LEN + b), S_MAX)
    lo = 0  # first cache position a window layer may attend: the new token (position length) sees WINDOW keys
    if HAS_WINDOW:
        lo = tl.maximum(tl.load(LEN + b) - WINDOW + 1, 0)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(Q + b64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    i_base = IDX + b64 * stride_ib + kvh.to(tl.int64) * stride_ih

    if GATHER:
        start = split * TOK_PER_SPLIT
        end = tl.minimum(start + TOK_PER_SPLIT, N_SEL)
    else:  # positions [lo, length): the splits share this row's own range (the grid is sized by a static bound)
        tok = tl.cdiv(tl.cdiv(tl.maximum(length - lo, 0), BLOCK_N), NUM_SPLITS) * BLOCK_N
        start = lo + split * tok
        end = tl.minimum(start + tok, length)

    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        if GATHER:
            pos = tl.load(i_base + offs_n, mask=nmask, other=-1)
            valid = nmask & (pos >= lo) & (pos < length)
        else:
            pos = offs_n
            valid = nmask
        pos = tl.where(valid, pos, 0).to(tl.int64)
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_base + pos[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # log2 domain
        if SOFTCAP:  # c·tanh(s/c) in the natural domain is (c·log2 e)·tanh(s2/(c·log2 e)) in the log2 one
            s = cap2 * _tanh(s / cap2)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    row = b64 * H + heads  # (G_PAD,)
    tl.store(O_PART + (row[:, None] * NUM_SPLITS + split) * D + offs_d[None, :], o,
             mask=gmask[:, None] & dmask[None, :])
    tl.store(LSE_PART + row * NUM_SPLITS + split, lse2, mask=gmask)


@triton.jit
def _sparse_decode_merge_kernel(
    O_PART, LSE_PART, Q, KN, VN, OUT, SINKS,
    stride_qb, stride_qh, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_ob, stride_oh,
    H, NUM_SPLITS, qk_scale, cap2,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, NS_PAD: tl.constexpr, HAS_NEW: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)  # b * H + h
    b = pid // H
    h = pid % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)  # q / k_new / v_new may be strided views: 64-bit head offsets, as for the cache
    offs_d = tl.arange(0, D_PAD)
    offs_s = tl.arange(0, NS_PAD)
    dmask = offs_d < D
    smask = offs_s < NUM_SPLITS
    lse = tl.load(LSE_PART + pid.to(tl.int64) * NUM_SPLITS + offs_s, mask=smask, other=float("-inf"))
    o = tl.load(O_PART + (pid.to(tl.int64) * NUM_SPLITS + offs_s[:, None]) * D + offs_d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    m = tl.max(lse, axis=0)
    if HAS_NEW:
        kvh64 = (h // G).to(tl.int64)
        qv = tl.load(Q + b64 * stride_qb + h64 * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        kn = tl.load(KN + b64 * stride_knb + kvh64 * stride_knh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        s_new = tl.sum(qv * kn, axis=0) * qk_scale
        if SOFTCAP:
            s_new = cap2 * _tanh(s_new / cap2)
        m = tl.maximum(m, s_new)
    if HAS_SINKS:  # a virtual key of value 0 with logit sinks[h] (natural log): one more term of the denominator
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    den = tl.sum(w, axis=0)
    num = tl.sum(w[:, None] * o, axis=0)
    if HAS_NEW:
        w_new = tl.exp2(s_new - m_safe)
        vn = tl.load(VN + b64 * stride_vnb + kvh64 * stride_vnh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        den = den + w_new
        num = num + w_new * vn
    if HAS_SINKS:
        den = den + tl.exp2(sink - m_safe)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(OUT + b64 * stride_ob + h64 * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


def default_config(n_sel: int, programs: int, device: torch.device, gather: bool = False, head_dim: int = 128,
                   itemsize: int = 2) -> dict:
    """Launch config: BLOCK_N, warps, stages and the number of splits (about 2 programs per SM).

    Tuned on an H200 (batch 32, H 32, H_kv 8, D 128, B 2048, bf16; BENCHMARKS.md): BLOCK_N 64, 4 warps, 2 stages,
    2 splits (512 programs) reached 90% of the copy bandwidth; 3 splits (the earlier 4-per-SM rule) 78%.

    Gather mode with 16-bit K/V of ``head_dim <= 128`` takes BLOCK_N 128 when the grid fits in one wave of three
    such programs per SM (``programs * splits <= 3 * SMs``), else BLOCK_N 64 (H200, H 32 / H_kv 8, B 2048, one
    process, ``tools/gather_split_probe.py``; ms per layer, BLOCK_N 64 → 128 at the same splits: batch 22 (352
    programs) 0.057 → 0.052, 43 (344) 0.105 → 0.092, 48 (384) 0.111 → 0.102; but batch 26 (416 programs, a second
    wave of a few) 0.064 → above 0.064, 0.080 in another process; the three-per-SM limit is inferred from where
    the gain turns)."""
    n_blocks = max(1, triton.cdiv(n_sel, 64))
    if device.type == "cuda":
        splits = max(1, min(n_blocks, triton.cdiv(2 * num_sms(device), max(programs, 1))))
    else:
        splits = 1
    block_n = 64
    if gather and head_dim <= 128 and itemsize <= 2 and (device.type != "cuda"
                                                          or programs * splits <= 3 * num_sms(device)):
        block_n = 128
        splits = max(1, min(splits, triton.cdiv(n_sel, block_n)))
    return dict(block_n=block_n, num_splits=splits, num_warps=4, num_stages=2)


def sparse_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: Optional[torch.Tensor],
                         lengths: torch.Tensor, k_new: Optional[torch.Tensor] = None,
                         v_new: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                         block_n: Optional[int] = None, num_splits: Optional[int] = None,
                         num_warps: Optional[int] = None, num_stages: Optional[int] = None, *,
                         window: Optional[int] = None, softcap: Optional[float] = None,
                         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton ``kvt::sparse_decode_attention`` (no input validation: the op wrapper does that).

    Args:
        q: ``(batch, H, D)``; k, v: ``(batch, H_kv, S, D)`` with contiguous last dim (S = S_max in gather mode,
        the slot count B in slot mode); indices: ``(batch, H_kv, B)`` int32/int64 with contiguous last dim, or
        None for slot mode; lengths: ``(batch,)`` int; k_new, v_new: ``(batch, H_kv, D)`` or None; scale: softmax
        scale (default ``D ** -0.5``). block_n / num_splits / num_warps / num_stages override the launch config.
        window, softcap, sinks: the attention variant (:func:`sparse_decode_reference`); a gather-mode window whose
        cache part (``window - 1`` tokens) fits in ``B`` runs the positional loop over the window, not the indices.

    Returns:
        ``(batch, H, D)`` in ``q.dtype``.
    """
    bsz, h, d = q.shape
    h_kv, s_max = k.shape[1], k.shape[2]
    g = h // h_kv
    gather = indices is not None and not dense_window(window, indices)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "K/V: the last (head_dim) dim must be contiguous"
    q = last_dim_contiguous(q)  # the kernels take q / k_new / v_new batch and head strides
    if gather:
        indices = indices.contiguous()
    if k_new is not None:
        k_new, v_new = last_dim_contiguous(k_new), last_dim_contiguous(v_new)
    n_sel = indices.shape[-1] if gather else s_max if window is None else max(1, min(s_max, window - 1))
    scale = d ** -0.5 if scale is None else float(scale)
    cfg = default_config(n_sel, bsz * h_kv, q.device, gather, d, k.element_size())
    block_n = block_n or cfg["block_n"]
    n_blocks = max(1, triton.cdiv(n_sel, block_n))
    splits = min(num_splits or cfg["num_splits"], n_blocks)
    tok_per_split = triton.cdiv(n_blocks, splits) * block_n
    splits = max(1, triton.cdiv(n_sel, tok_per_split))
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]

    o_part = torch.empty((bsz, h, splits, d), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((bsz, h, splits), device=q.device, dtype=torch.float32)
    lengths = lengths.to(device=q.device, dtype=torch.int32).contiguous()  # the kernels read LEN + b
    idx = indices if gather else lengths  # dummy pointer in slot mode (never read)
    qk_scale = scale * _LOG2E
    cap2 = float(softcap) * _LOG2E if softcap is not None else 1.0
    _sparse_decode_split_kernel[(bsz * h_kv, splits)](
        q, k, v, idx, lengths, o_part, lse_part,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        idx.stride(0) if gather else 0, idx.stride(1) if gather else 0,
        h, h_kv, s_max, n_sel, tok_per_split, splits, qk_scale, int(window or 0), cap2,
        G=g, G_PAD=next_pow2(g, 16), D=d, D_PAD=next_pow2(d, 16), BLOCK_N=block_n,
        GATHER=gather, DOT_PREC=dot_precision(q.dtype), HAS_WINDOW=window is not None, SOFTCAP=softcap is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty((bsz, h, d), device=q.device, dtype=q.dtype)
    has_new = k_new is not None
    kn = k_new if has_new else q
    vn = v_new if has_new else q
    sk = sinks.contiguous() if sinks is not None else q
    _sparse_decode_merge_kernel[(bsz * h,)](
        o_part, lse_part, q, kn, vn, out, sk,
        q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        out.stride(0), out.stride(1),
        h, splits, qk_scale, cap2,
        G=g, D=d, D_PAD=next_pow2(d, 16), NS_PAD=next_pow2(splits, 2), HAS_NEW=has_new,
        SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, num_warps=4,
    )
    return out


def sparse_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: Optional[torch.Tensor],
                            lengths: torch.Tensor, k_new: Optional[torch.Tensor] = None,
                            v_new: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                            dtype: Optional[torch.dtype] = None, *, window: Optional[int] = None,
                            softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain-PyTorch ``kvt::sparse_decode_attention`` (``torch.gather`` + masked softmax), computed in ``dtype``
    (default: fp64 for fp64 inputs, else fp32), output in ``q.dtype``. Same masking contract as the kernel:
    entries outside ``[0, min(lengths[b], S))`` are ignored (never contribute, whatever the cache holds there, NaN
    and inf included), duplicates count twice; a row with nothing to attend gives ``v_new`` with the new token, zeros
    without. The CPU path of the op.

    Attention variants (HF semantics; ``docs/ARCHITECTURE.md``): ``window`` (int >= 1): the new token, at position
    ``lengths[b]``, sees the cache positions ``j > lengths[b] - window`` only (``window`` keys with itself); in gather
    mode, when those ``window - 1`` cache tokens fit in the ``B`` entries (:func:`dense_window`), all of them are
    attended and ``indices`` is not read, else the selected ones inside the window. ``softcap``: scores
    ``c · tanh(s / c)`` before the softmax (Gemma 2). ``sinks`` ``(H,)``: one extra logit per query head in the
    denominator, a virtual key of value 0 (gpt-oss)."""
    bsz, h, d = q.shape
    h_kv, s_max = k.shape[1], k.shape[2]
    g = h // h_kv
    dtype = dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    scale = d ** -0.5 if scale is None else float(scale)
    raw = lengths.to(device=q.device, dtype=torch.int64)
    lens = raw.clamp(max=s_max)
    if indices is None or dense_window(window, indices):
        pos = torch.arange(s_max, device=q.device).expand(bsz, h_kv, s_max)
    else:
        pos = indices.to(torch.int64)
    lo = torch.zeros_like(raw) if window is None else (raw - int(window) + 1).clamp(min=0)
    valid = (pos >= lo[:, None, None]) & (pos < lens[:, None, None])
    safe = torch.where(valid, pos, torch.zeros_like(pos))
    # rows of the flattened (batch * H_kv * S_max, D) cache: whole D-rows copied (index_select), ~4x faster on a CPU
    # than an element-wise gather with a (batch, H_kv, B, D) index
    rows = (safe + torch.arange(bsz * h_kv, device=q.device).view(bsz, h_kv, 1) * s_max).reshape(-1)
    # a masked entry reads position 0 (or, in slot mode, an unused slot), which may hold anything, NaN/inf included
    # (a freshly allocated or freed cache): zero it, as the kernel's masked loads do, since 0 * NaN is NaN.
    drop = ~valid[..., None]
    kg = k.reshape(-1, d).index_select(0, rows).view(bsz, h_kv, -1, d).to(dtype).masked_fill_(drop, 0)
    vg = v.reshape(-1, d).index_select(0, rows).view(bsz, h_kv, -1, d).to(dtype).masked_fill_(drop, 0)
    qf = q.to(dtype).view(bsz, h_kv, g, d)
    s = torch.einsum("bkgd,bknd->bkgn", qf, kg) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    if k_new is not None:
        s_new = torch.einsum("bkgd,bkd->bkg", qf, k_new.to(dtype)) * scale
        if softcap is not None:
            s_new = softcap * torch.tanh(s_new / softcap)
        s = torch.cat([s, s_new[..., None]], dim=-1)
        vg = torch.cat([vg, v_new.to(dtype)[:, :, None, :]], dim=2)
    if sinks is not None:  # the sink's value is 0: a score column whose value row is zeros
        s = torch.cat([s, sinks.to(device=q.device, dtype=dtype).view(1, h_kv, g, 1).expand(bsz, -1, -1, 1)], -1)
        vg = torch.cat([vg, vg.new_zeros(bsz, h_kv, 1, d)], dim=2)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # empty rows: 0; a NaN stays NaN
    p = torch.exp(s - m)
    den = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(den == 0, torch.ones_like(den), den)
    out = torch.einsum("bkgn,bknd->bkgd", p, vg)
    return out.reshape(bsz, h, d).to(q.dtype)


def dense_window(window: Optional[int], indices: Optional[torch.Tensor]) -> bool:
    """Whether a gather-mode call with ``window`` attends densely to the window instead of reading ``indices``
    ``(batch, H_kv, B)``: its cache part, ``window - 1`` tokens, fits in the ``B`` entries (SpeContext's budget)."""
    return window is not None and indices is not None and int(window) - 1 <= indices.shape[-1]
