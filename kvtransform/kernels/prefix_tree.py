"""Prefix-tree attention: Triton forward, deterministic Triton backward, and the plain-PyTorch reference.

Layout (:class:`kvtransform.tree_layout.PrefixTreeLayout`): nodes ``[cu_seqlens[n], cu_seqlens[n+1])`` of the
packed token axis; a query of node ``n`` attends to every token of its ancestor nodes and causally within ``n``.
The kernels read the ancestors and descendants as merged token ranges (CSR ``key_range_ptr``/``key_ranges`` and
``query_range_ptr``/``query_ranges``, int32; ranges ``(R, 2)`` rows ``[lo, hi)``). Source: Tree Training (arXiv
2511.00413) for packing trajectories as a tree; the kernels generalise the DualKV ones (arXiv 2605.15422, §2–3,
``kernels/dualkv.py``) from one shared level to any depth.

Kernels (one launch each, every tree and node at once): the DualKV kernels of ``kernels/dualkv.py`` with ``CSR``
set (their tile bodies are in ``kernels/attention_tiles.py``): only the loop over context ranges differs (DualKV has
at most one per segment).

* forward: one program per (query block of a node, query head) (or, config ``PACK``, per query block and KV head
  with the GQA group packed), from a heaviest-first work table built on the device. Keys: every ancestor range
  (whole blocks unmasked, the ragged tail masked), then the own node (blocks below the diagonal unmasked, the
  diagonal causal). Online softmax in fp32 (exp2), fp32 natural-log LSE.
* backward: ``Delta = rowsum(dO∘O) - dLSE``; dQ (the forward's iteration) and dK/dV (one program per key block of
  node ``m`` and KV head: the own node's queries causally, then every descendant range fully, over the ``H/H_kv``
  query heads of the KV head). Every gradient element has one owner program and is accumulated in fp32 registers
  in a fixed order: bitwise deterministic, no atomics.
* the attention variants (sliding window over each token's position on its root-to-node path, soft-capping,
  sinks): ``kernels/attention_tiles.py``.

GQA: query head ``h`` reads KV head ``h // (H // H_kv)``. Head dims 1..256 padded to the next power of two (>= 16)
with masks. Token offsets are int64 inside the kernels (``T * stride`` can pass 2**31); layout values are int32.
"""
from __future__ import annotations

from typing import Optional

import torch

from .dualkv_reference import packed_reference, packed_reference_backward, work_table
from .attention_tiles import whole_range_next
from .dualkv import MAX_HEAD_DIM, SUPPORTED_DTYPES, launch_bwd, launch_fwd
from .layout_memo import memo

__all__ = ["prefix_tree_fwd", "prefix_tree_bwd", "prefix_tree_attention_reference",
           "prefix_tree_attention_reference_backward", "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]


# ====================================================================================================== reference
def _layout_lists(layout):
    """``(cu, key_ranges per node)`` python lists from a PrefixTreeLayout or a tuple ``(cu_seqlens, key_range_ptr,
    key_ranges)`` of tensors (a host read)."""
    if hasattr(layout, "key_range_ptr"):
        cu_t, ptr_t, rng_t = layout.cu_seqlens, layout.key_range_ptr, layout.key_ranges
    else:
        cu_t, ptr_t, rng_t = layout
    cu = [int(x) for x in cu_t.tolist()]
    ptr = [int(x) for x in ptr_t.tolist()]
    rng = [(int(a), int(b)) for a, b in rng_t.reshape(-1, 2).tolist()]
    return cu, [rng[ptr[n]:ptr[n + 1]] for n in range(len(cu) - 1)]


def prefix_tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout,
                                    softmax_scale: Optional[float] = None, upcast: bool = True, *,
                                    window: Optional[int] = None, softcap: Optional[float] = None,
                                    sinks: Optional[torch.Tensor] = None):
    """Plain-PyTorch (differentiable, also in ``sinks``) prefix-tree attention, node by node.

    Each node's queries attend to ``cat(ancestor keys, own keys)`` with the bottom-right aligned causal mask (every
    ancestor token plus own tokens ``0..r``); memory per node ``H * len * (context + len)`` scores.

    Args:
        q: ``(T, H, D)``; k, v: ``(T, H_kv, D)``, ``H % H_kv == 0``; any float dtype.
        layout: a :class:`~kvtransform.tree_layout.PrefixTreeLayout`, or ``(cu_seqlens, key_range_ptr,
            key_ranges)`` int tensors.
        softmax_scale: default ``D ** -0.5``.
        upcast: compute in fp32 (fp64 for fp64 inputs); False: the matmuls in the input dtype and the softmax in
            fp32 (PyTorch's own low-precision error, the numerics rule's yardstick).
        window, softcap, sinks: the attention variants (``kvtransform.ops._common.check_attention_variants``), a
            token's position being its position on its root-to-node path.

    Returns:
        ``(out, lse)``: out ``(T, H, D)`` in q.dtype; lse ``(H, T)`` fp32 (fp64 for fp64 inputs), natural log.

    Reads the layout on the host; not for tracing.
    """
    cu, kr = _layout_lists(layout)
    return packed_reference(q, k, v, cu, [kr[n] + [(cu[n], cu[n + 1])] for n in range(len(cu) - 1)], softmax_scale,
                            upcast, window, softcap, sinks)


def prefix_tree_attention_reference_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                                             q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout,
                                             softmax_scale: Optional[float] = None, *, window: Optional[int] = None,
                                             softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
    """Explicit gradients of :func:`prefix_tree_attention_reference` (fp32, fp64 for fp64 inputs), node by node: an
    ancestor's dK/dV sum its own causal part and the parts of every descendant.

    Args:
        grad_out: ``(T, H, D)``; grad_lse: optional ``(H, T)``; the rest as the reference.

    Returns:
        ``(dq, dk, dv)`` in the dtypes and shapes of q, k, v; with ``sinks`` also ``dsinks`` ``(H,)``.
    """
    cu, kr = _layout_lists(layout)
    return packed_reference_backward(grad_out, grad_lse, q, k, v, cu,
                                     [kr[n] + [(cu[n], cu[n + 1])] for n in range(len(cu) - 1)], softmax_scale,
                                     window, softcap, sinks)


# ====================================================================================================== work tables
def _bounded(cu_seqlens, range_ptr, ranges, total_tokens):
    """The layout as the kernels read it, on the device without a host sync: offsets clamped into ``[0, T]`` and
    non-decreasing, range pointers clamped into ``[0, R]`` and non-decreasing, range ends clamped into ``[0, T]``
    (``lo <= hi``). A valid layout is unchanged; any other never makes the kernels index outside their tensors.
    Returns ``(cu, ptr, lo, hi)`` int32 (``lo``/``hi`` at least one entry long)."""
    cu = torch.cummax(cu_seqlens.clamp(0, total_tokens), 0).values.to(torch.int32)
    r = ranges.reshape(-1, 2)
    ptr = torch.cummax(range_ptr.clamp(0, r.shape[0]), 0).values.to(torch.int32)
    if r.shape[0] == 0:
        z = torch.zeros(1, dtype=torch.int32, device=cu.device)
        return cu, ptr, z, z
    lo = r[:, 0].clamp(0, total_tokens)
    hi = torch.maximum(r[:, 1].clamp(0, total_tokens), lo)
    return cu, ptr, lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def _context_tokens(ptr: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """int64 ``(N,)``: tokens in each node's ranges (segment sums of ``hi - lo`` over the CSR), on the device."""
    lens = (hi.long() - lo.long())
    csum = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    p = ptr.long()
    return csum[p[1:]] - csum[p[:-1]]


# ====================================================================================================== launchers
def check_launch(q, k, v, cu_seqlens, range_ptr, ranges, what: str) -> None:
    """Host checks of the launchers (no data read): ranks, dtypes, head counts, devices, int32 layout tensors of
    consistent sizes. ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{what}: {name} must be a 3-D tensor (T, heads, head_dim)")
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{what}: q, k, v must share one of {SUPPORTED_DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}")
    t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"{what}: k/v must be (T={t}, H_kv, D={d}) with H={h} divisible by H_kv; got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{what}: head_dim {d} outside 1..{MAX_HEAD_DIM}")
    for name, x in (("cu_seqlens", cu_seqlens), ("range_ptr", range_ptr), ("ranges", ranges)):
        if x.dtype != torch.int32 or x.device != q.device:
            raise ValueError(f"{what}: {name} must be int32 on {q.device}; got {x.dtype} on {x.device}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or range_ptr.shape != cu_seqlens.shape:
        raise ValueError(f"{what}: cu_seqlens and the range pointers must be (N+1,) with N >= 1; got "
                         f"{tuple(cu_seqlens.shape)}, {tuple(range_ptr.shape)}")
    if ranges.dim() != 2 or ranges.shape[1] != 2:
        raise ValueError(f"{what}: ranges must be (R, 2); got {tuple(ranges.shape)}")


class _SidePlan:
    """One side of the layout (the ancestors' key ranges, or the descendants' query ranges) as the launchers of
    ``kernels/dualkv.py`` take it: ``cu``, ``ptr``, ``lo``, ``hi`` (:func:`_bounded`), ``ctx`` (tokens per node,
    :func:`_context_tokens`), ``work(block, sign)`` (``work_table`` of ``kernels/dualkv_reference.py``: heaviest blocks first, on the device) and ``ranges_next(block)``
    (:func:`~.attention_tiles.whole_range_next`). Everything is built on the device without a host sync, once per
    layout tensors (``kernels/layout_memo.py``: the forward, the backward and every layer share it)."""

    def __init__(self, cu_seqlens, range_ptr, ranges, total_tokens: int):
        self.t = int(total_tokens)
        self.tables = memo(cu_seqlens, range_ptr, ranges, key=("prefix-tree side", self.t))
        if "bounded" not in self.tables:
            bounded = _bounded(cu_seqlens, range_ptr, ranges, self.t)
            self.tables["bounded"] = bounded + (_context_tokens(*bounded[1:]),)
        self.cu, self.ptr, self.lo, self.hi, self.ctx = self.tables["bounded"]

    def work(self, block: int, sign: int):
        key = ("work", block, sign)
        if key not in self.tables:
            self.tables[key] = work_table(self.cu, block, self.t, self.ctx, sign)
        return self.tables[key]

    def ranges_next(self, block: int):
        key = ("ranges_next", block)
        if key not in self.tables:
            self.tables[key] = whole_range_next(self.lo, self.hi, block)
        return self.tables[key]


def prefix_tree_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    key_range_ptr: torch.Tensor, key_ranges: torch.Tensor, scale: float, *,
                    config: Optional[dict] = None, window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None):
    """Triton prefix-tree forward (one launch for every tree and node; the DualKV kernels of ``kernels/dualkv.py``
    with the ancestors as CSR context ranges).

    Args:
        q: ``(T, H, D)`` fp16/bf16/fp32 (last dim contiguous, else copied); k, v: ``(T, H_kv, D)``, same dtype.
        cu_seqlens: int32 ``(N+1,)``; key_range_ptr: int32 ``(N+1,)``; key_ranges: int32 ``(RK, 2)`` (the layout's
            ancestors as token ranges). Values are not validated here (``kvt::prefix_tree_attention`` does that
            on CPU; the public wrapper's layout was validated when built) but clamped, so the kernels never
            read or write outside their tensors.
        scale: softmax scale.
        config: optional ``{"fwd": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "PACK", "TMA"}}``, defaults as
            ``kernels/dualkv.py`` (tuned there on an H200).
        window, softcap, sinks: the attention variants (``kernels/attention_tiles.py``; a token's position is its
            position on its root-to-node path).

    Returns:
        ``(out, lse)``: out ``(T, H, D)`` in q.dtype; lse fp32 ``(H, T)``, natural log (the sink term included).

    Raises:
        ValueError: shapes, dtypes or devices that disagree (:func:`check_launch`).
    """
    check_launch(q, k, v, cu_seqlens, key_range_ptr, key_ranges, "prefix_tree_fwd")
    side = _SidePlan(cu_seqlens, key_range_ptr, key_ranges, q.shape[0])
    return launch_fwd(q, k, v, side.cu, side.lo, side.hi, side.ptr, lambda: side.ctx, side.work, scale, config,
                      window, softcap, sinks, ranges_next=side.ranges_next)


def prefix_tree_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu_seqlens: torch.Tensor, key_range_ptr: torch.Tensor,
                    key_ranges: torch.Tensor, query_range_ptr: torch.Tensor, query_ranges: torch.Tensor,
                    scale: float, dlse: Optional[torch.Tensor] = None, *, config: Optional[dict] = None,
                    window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None):
    """Triton prefix-tree backward, bitwise deterministic (every gradient element has one owner program).

    Args:
        do: ``(T, H, D)`` gradient of ``out``; q, k, v, out, cu_seqlens, key_range_ptr, key_ranges, scale as in
            :func:`prefix_tree_fwd`; lse: fp32 ``(H, T)`` from the forward.
        query_range_ptr: int32 ``(N+1,)``; query_ranges: int32 ``(RQ, 2)`` (the descendants as token ranges).
        dlse: optional fp32 ``(H, T)`` gradient of ``lse`` (enters as ``Delta = rowsum(dO∘O) - dLSE``).
        config: optional ``{"dq": {...}, "dkdv": {...}}`` (keys as ``kernels/dualkv.py``'s; dkdv's ``BLOCK_N`` a
            multiple of its ``BLOCK_M``).
        window, softcap, sinks: as the forward's.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtypes of q, k, v (with ``sinks`` also ``dsinks`` ``(H,)``): an
        ancestor's dK/dV include every descendant's queries.

    Raises:
        ValueError: as :func:`prefix_tree_fwd`; a dkdv ``BLOCK_N`` that is not a multiple of its ``BLOCK_M``.
    """
    check_launch(q, k, v, cu_seqlens, key_range_ptr, key_ranges, "prefix_tree_bwd")
    check_launch(q, k, v, cu_seqlens, query_range_ptr, query_ranges, "prefix_tree_bwd")
    keys = _SidePlan(cu_seqlens, key_range_ptr, key_ranges, q.shape[0])
    queries = _SidePlan(cu_seqlens, query_range_ptr, query_ranges, q.shape[0])

    def plan(block, sign):
        return (keys if sign > 0 else queries).work(block, sign)

    dq, dk, dv, dsinks = launch_bwd(do, q, k, v, out, lse, dlse, keys.cu, keys.lo, keys.hi, keys.ptr, queries.lo,
                                    queries.hi, queries.ptr, lambda: keys.ctx, plan, scale, config, window, softcap,
                                    sinks, ranges_next=keys.ranges_next)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)
