"""Attention masks for the baselines (FlexAttention and the dense reference), one factory each, in the style of
attention-gym's mask files: the shared-prefix mask of the DualKV layout (DualKV, arXiv 2605.15422, §2) and the
prefix-tree mask of a ``PrefixTreeLayout`` (Tree Training, arXiv 2511.00413; the ``tree_*`` factories, at the end).

The ``shared_prefix_*`` factories take a :class:`~kvtransform.layout.DualKVLayout` (one or more groups
``[prefix][response_1]..[response_N]`` packed on one token axis of ``T`` tokens): query ``q`` sees key ``kv`` iff
``kv <= q`` and ``kv`` is in ``q``'s own segment or in the prefix of ``q``'s group.
"""
from __future__ import annotations

import torch

__all__ = ["segment_ids", "context_segment", "shared_prefix_mask_mod", "shared_prefix_dense_mask",
           "shared_prefix_block_masks", "shared_prefix_block_mask", "tree_node_ids", "tree_mask_mod", "tree_dense_mask",
           "tree_block_masks", "tree_block_mask"]


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


def _block_masks(T: int, block: int, device, coverage):
    """(partial, full) bool ``(nQ, nKV)`` block masks from ``coverage(r0, r1, kb_lo, kb_hi)``: the int
    ``(r1 - r0, nKV)`` count of visible keys of each key block ``[kb_lo, kb_hi]`` for query rows ``r0..r1-1``. A block
    is *full* when every query row of it (inside ``T``) sees every key of the key block, *partial* when some pair is
    visible and it is not full. Rows in chunks: ``O(T * nKV)`` work, never ``O(T^2)`` memory."""
    nb = (T + block - 1) // block
    kb_lo = torch.arange(nb, device=device) * block
    kb_hi = torch.clamp(kb_lo + block - 1, max=T - 1)
    kb_size = torch.full_like(kb_lo, block)  # a ragged last block is never full (as create_block_mask pads it)
    anyv = torch.zeros(nb, nb, dtype=torch.int32, device=device)  # query rows of the block seeing some key
    notfull = torch.zeros(nb, nb, dtype=torch.int32, device=device)  # query rows of the block missing some key
    rows_per_chunk = max(block, (1 << 24) // max(nb, 1) // block * block)
    for r0 in range(0, T, rows_per_chunk):
        r1 = min(T, r0 + rows_per_chunk)
        cov = coverage(r0, r1, kb_lo, kb_hi)
        qb = torch.arange(r0, r1, device=device) // block
        anyv.index_add_(0, qb, (cov > 0).int())
        notfull.index_add_(0, qb, (cov < kb_size[None]).int())
    if T % block:
        notfull[-1] += 1  # the padded query rows of the last block see nothing
    full = notfull == 0
    return (anyv > 0) & ~full, full


def _overlap(lo, hi, kb_lo, kb_hi):
    """Keys of the closed interval ``[lo, hi]`` (per row) in each key block ``[kb_lo, kb_hi]``."""
    return (torch.minimum(hi[:, None], kb_hi[None]) - torch.maximum(lo[:, None], kb_lo[None]) + 1).clamp_min(0)


def shared_prefix_block_masks(layout, block: int = 128):
    """Block-level (partial, full) bool masks ``(nQ, nKV)`` of the shared-prefix mask, from the layout.

    Query row ``q`` sees keys ``[ctx_lo, ctx_hi)`` (its group's prefix; empty on a prefix) and ``[start(q), q]``
    (its own segment, causally); see :func:`_block_masks` for full / partial.
    """
    cu = layout.cu_seqlens.long()
    T = int(layout.total_tokens)
    seg, ctx = segment_ids(layout), context_segment(layout)
    q = torch.arange(T, device=cu.device)
    own_lo = cu[seg]  # start of the query's own segment
    has_ctx = ctx >= 0
    ctx_c = ctx.clamp(min=0)
    ctx_lo = torch.where(has_ctx, cu[ctx_c], torch.zeros_like(q))
    ctx_hi = torch.where(has_ctx, cu[ctx_c + 1] - 1, torch.full_like(q, -1))  # interval 1: [ctx_lo, ctx_hi]

    def coverage(r0, r1, kb_lo, kb_hi):  # the two intervals are disjoint
        return (_overlap(ctx_lo[r0:r1], ctx_hi[r0:r1], kb_lo, kb_hi)
                + _overlap(own_lo[r0:r1], q[r0:r1], kb_lo, kb_hi))

    return _block_masks(T, block, cu.device, coverage)


def _from_blocks(partial, full, T: int, block: int, mask_mod):
    """FlexAttention ``BlockMask`` from (partial, full) block masks. ``TypeError`` on a torch whose
    ``BlockMask.from_kv_blocks`` has no ``seq_lengths``."""
    from torch.nn.attention.flex_attention import BlockMask

    def dense_to_ordered(m):
        num = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = dense_to_ordered(partial)
    fkv_num, fkv_idx = dense_to_ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, fkv_num, fkv_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


def shared_prefix_block_mask(layout, block: int = 128, mask_mod=None):
    """FlexAttention ``BlockMask`` built from :func:`shared_prefix_block_masks` (what a trainer that knows its
    layout does instead of evaluating ``mask_mod`` on all ``T^2`` pairs). ``mask_mod`` defaults to
    :func:`shared_prefix_mask_mod`. Raises ``TypeError`` on a torch whose ``BlockMask.from_kv_blocks`` has no
    ``seq_lengths``."""
    T = int(layout.total_tokens)
    partial, full = shared_prefix_block_masks(layout, block)
    return _from_blocks(partial, full, T, block, mask_mod or shared_prefix_mask_mod(layout))


# ------------------------------------------------------------------------------------------- prefix-tree mask
# A PrefixTreeLayout (kvtransform.tree_layout; Tree Training, arXiv 2511.00413): query q of node n sees every key of
# n's ancestor nodes and the keys of n up to q.


def tree_node_ids(layout) -> torch.Tensor:
    """int64 ``(T,)``: the node of each token of a :class:`~kvtransform.tree_layout.PrefixTreeLayout`."""
    cu = layout.cu_seqlens.long()
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])


def tree_mask_mod(layout):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` of the prefix-tree layout (an ``(N, N)`` ancestor table)."""
    node = tree_node_ids(layout)
    n = layout.num_nodes
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        anc[i, layout.ancestors_of(i)] = True
    anc = anc.to(node.device)

    def prefix_tree(b, h, q_idx, kv_idx):
        nq, nk = node[q_idx], node[kv_idx]
        return anc[nq, nk] | ((nq == nk) & (kv_idx <= q_idx))

    return prefix_tree


def tree_dense_mask(layout) -> torch.Tensor:
    """bool ``(T, T)`` mask (True = visible) for SDPA's ``attn_mask``; ``T^2`` bytes: tiny shapes only."""
    return layout.dense_mask()


def tree_block_masks(layout, block: int = 128):
    """Block-level (partial, full) bool masks ``(nQ, nKV)`` of the prefix-tree mask from the layout's merged
    ancestor token ranges (``key_range_ptr``/``key_ranges``): the keys a node's ancestors put in each key block
    (``O(ranges * nKV)``), plus each row's own ``[start(node), q]``; see :func:`_block_masks`."""
    cu = layout.cu_seqlens.long()
    T, device = int(layout.total_tokens), cu.device
    node = tree_node_ids(layout)
    ptr, rng = layout.key_range_ptr.long(), layout.key_ranges.long().reshape(-1, 2)
    range_node = torch.repeat_interleave(torch.arange(ptr.numel() - 1, device=device), ptr[1:] - ptr[:-1])
    q = torch.arange(T, device=device)
    own_lo = cu[node]
    cache = {}

    def coverage(r0, r1, kb_lo, kb_hi):
        if "anc" not in cache:  # keys of each node's ancestors in each key block, (N, nKV)
            anc = torch.zeros(ptr.numel() - 1, kb_lo.numel(), dtype=torch.long, device=device)
            if rng.shape[0]:
                anc.index_add_(0, range_node, _overlap(rng[:, 0], rng[:, 1] - 1, kb_lo, kb_hi))
            cache["anc"] = anc
        return cache["anc"][node[r0:r1]] + _overlap(own_lo[r0:r1], q[r0:r1], kb_lo, kb_hi)

    return _block_masks(T, block, device, coverage)


def tree_block_mask(layout, block: int = 128, mask_mod=None):
    """FlexAttention ``BlockMask`` of the prefix-tree layout from :func:`tree_block_masks` (no ``T^2`` evaluation of
    ``mask_mod``; ``mask_mod`` defaults to :func:`tree_mask_mod`). ``TypeError`` as :func:`shared_prefix_block_mask`."""
    T = int(layout.total_tokens)
    partial, full = tree_block_masks(layout, block)
    return _from_blocks(partial, full, T, block, mask_mod or tree_mask_mod(layout))
