"""Shared-prefix attention masks of the DualKV layout for the baselines (FlexAttention and the dense reference),
one factory each, in the style of attention-gym's mask files. Source: DualKV (arXiv 2605.15422) §2.

All take a :class:`~kvtransform.layout.DualKVLayout` (one or more groups ``[prefix][response_1]..[response_N]``
packed on one token axis of ``T`` tokens). Query ``q`` sees key ``kv`` iff ``kv <= q`` and ``kv`` is in ``q``'s own
segment or in the prefix of ``q``'s group.
"""
from __future__ import annotations

import torch

__all__ = ["segment_ids", "context_segment", "shared_prefix_mask_mod", "shared_prefix_dense_mask",
           "shared_prefix_block_masks", "shared_prefix_block_mask"]


def segment_ids(layout) -> torch.Tensor:
    """int64 ``(T,)``: the segment of each token (packing order: a group's prefix, then its responses)."""
    cu = layout.cu_seqlens.long()
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])


def context_segment(layout) -> torch.Tensor:
    """int64 ``(T,)``: the prefix segment each token's query also sees (``-1`` on a prefix token)."""
    return layout.segment_prefix.long()[segment_ids(layout)]


def shared_prefix_mask_mod(layout):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` of the layout (evaluated per pair by ``create_block_mask``)."""
    seg, ctx = segment_ids(layout), context_segment(layout)

    def shared_prefix(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (seg[kv_idx] == seg[q_idx])) | (ctx[q_idx] == seg[kv_idx])

    return shared_prefix


def shared_prefix_dense_mask(layout) -> torch.Tensor:
    """bool ``(T, T)`` mask (True = visible) for SDPA's ``attn_mask``; ``T^2`` bytes: tiny shapes only."""
    seg, ctx = segment_ids(layout), context_segment(layout)
    i = torch.arange(seg.numel(), device=seg.device)
    own = (i[None, :] <= i[:, None]) & (seg[None, :] == seg[:, None])
    return own | (ctx[:, None] == seg[None, :])


def shared_prefix_block_masks(layout, block: int = 128):
    """Block-level (partial, full) bool masks ``(nQ, nKV)`` of the shared-prefix mask, from the layout.

    Query row ``q`` sees keys ``[ctx_lo, ctx_hi)`` (its group's prefix; empty on a prefix) and ``[start(q), q]``
    (its own segment, causally). A block is *full* when every query row of it (inside ``T``) sees every key of the
    key block, *partial* when some pair is visible and it is not full. Work ``O(T * nKV)`` in chunks, never
    ``O(T^2)``.
    """
    cu = layout.cu_seqlens.long()
    T = int(layout.total_tokens)
    device = cu.device
    nb = (T + block - 1) // block
    seg, ctx = segment_ids(layout), context_segment(layout)
    q = torch.arange(T, device=device)
    own_lo = cu[seg]  # start of the query's own segment
    has_ctx = ctx >= 0
    ctx_c = ctx.clamp(min=0)
    ctx_lo = torch.where(has_ctx, cu[ctx_c], torch.zeros_like(q))
    ctx_hi = torch.where(has_ctx, cu[ctx_c + 1] - 1, torch.full_like(q, -1))  # interval 1: [ctx_lo, ctx_hi]
    kb_lo = torch.arange(nb, device=device) * block
    kb_hi = torch.clamp(kb_lo + block - 1, max=T - 1)
    kb_size = torch.full_like(kb_lo, block)  # a ragged last block is never full (as create_block_mask pads it)
    anyv = torch.zeros(nb, nb, dtype=torch.int32, device=device)  # query rows of the block seeing some key
    notfull = torch.zeros(nb, nb, dtype=torch.int32, device=device)  # query rows of the block missing some key
    rows_per_chunk = max(block, (1 << 24) // max(nb, 1) // block * block)
    for r0 in range(0, T, rows_per_chunk):
        r1 = min(T, r0 + rows_per_chunk)
        c1 = (torch.minimum(ctx_hi[r0:r1, None], kb_hi[None]) - torch.maximum(ctx_lo[r0:r1, None], kb_lo[None])
              + 1).clamp_min(0)
        c2 = (torch.minimum(q[r0:r1, None], kb_hi[None]) - torch.maximum(own_lo[r0:r1, None], kb_lo[None])
              + 1).clamp_min(0)
        cov = c1 + c2  # visible keys of each key block, per query row (the two intervals are disjoint)
        qb = torch.arange(r0, r1, device=device) // block
        anyv.index_add_(0, qb, (cov > 0).int())
        notfull.index_add_(0, qb, (cov < kb_size[None]).int())
    if T % block:
        notfull[-1] += 1  # the padded query rows of the last block see nothing
    full = notfull == 0
    partial = (anyv > 0) & ~full
    return partial, full


def shared_prefix_block_mask(layout, block: int = 128, mask_mod=None):
    """FlexAttention ``BlockMask`` built from :func:`shared_prefix_block_masks` (what a trainer that knows its
    layout does instead of evaluating ``mask_mod`` on all ``T^2`` pairs). ``mask_mod`` defaults to
    :func:`shared_prefix_mask_mod`. Raises ``TypeError`` on a torch whose ``BlockMask.from_kv_blocks`` has no
    ``seq_lengths``."""
    from torch.nn.attention.flex_attention import BlockMask

    T = int(layout.total_tokens)
    partial, full = shared_prefix_block_masks(layout, block)

    def dense_to_ordered(m):
        num = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = dense_to_ordered(partial)
    fkv_num, fkv_idx = dense_to_ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, fkv_num, fkv_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod or shared_prefix_mask_mod(layout), seq_lengths=(T, T))
