"""``kvt::prefix_tree_attention``: attention over the packed prefix-tree layout (any depth of shared prefix).

``torch.ops.kvt.prefix_tree_attention(q, k, v, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr,
query_ranges, softmax_scale, window=None, softcap=None, sinks=None) -> (out, lse)``

* q ``(T, H, D)``, k/v ``(T, H_kv, D)`` (GQA: query head ``h`` reads KV head ``h // (H // H_kv)``), fp16/bf16/fp32;
* the layout tensors of :class:`kvtransform.tree_layout.PrefixTreeLayout` (int32; ``PrefixTreeLayout.kernel_tensors()``
  in this order): ``cu_seqlens (N+1,)``, ``parent (N,)``, ``key_range_ptr (N+1,)``, ``key_ranges (RK, 2)`` (the
  ancestors as token ranges), ``query_range_ptr (N+1,)``, ``query_ranges (RQ, 2)`` (the descendants);
* out ``(T, H, D)`` in q.dtype; lse fp32 ``(H, T)`` (fp64 for fp64 inputs, the CPU reference), natural log of the
  softmax denominator (scaled scores; with sinks, their term included);
* the attention variants (``kvtransform.ops._common.check_attention_variants``): ``window`` (over each token's
  position on its root-to-node path), ``softcap``, ``sinks`` ``(H,)`` (differentiable); all off by default.

A token attends to every token of its node's ancestors and causally within its node (Tree Training, arXiv
2511.00413; the one-level case is DualKV, arXiv 2605.15422, ``kvt::dualkv_attention``). CUDA tensors run the Triton
kernels of ``kvtransform.kernels.prefix_tree`` (deterministic backward); CPU tensors the plain-PyTorch reference (the
tests flip :data:`USE_TRITON_ON_CPU` to run the kernels under ``TRITON_INTERPRET=1``). The fake implementation needs
no data (an opaque node under export/compile). Autograd: q, k, v, with the gradient of ``lse`` honoured; the
backward is its own op, ``kvt::prefix_tree_attention_backward``.

Inconsistent inputs to the raw ops: shapes, dtypes and devices raise ``ValueError`` on the host. Values: on CPU the
layout is read on the host, rebuilt from ``cu_seqlens``/``parent`` and compared with the range tensors (``ValueError``
naming the problem); on CUDA the structural conditions (offsets from 0 to T, increasing; ``-1 <= parent[n] < n``;
range pointers from 0 to R, non-decreasing; ranges inside ``[0, T]``) are asserted on the device
(``torch._assert_async``, no host sync), and the kernels clamp every offset, so nothing outside the tensors is
touched. That the ranges are exactly the ancestors/descendants of ``parent`` is checked on CUDA only by the public
wrapper's :class:`PrefixTreeLayout` (built and validated on the host).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels import prefix_tree as _k
from ..kernels.layout_memo import memo
from ..tree_layout import PrefixTreeLayout
from ._common import (as_scale, autocast_inputs, check_attention_variants, check_backward_shapes, check_dtype_path,
                      kernel_path, no_sinks_grad, refuse_double_backward, variant_kwargs)

__all__ = ["prefix_tree_attention", "check_shapes", "PrefixTreeLayout"]

# Tests flip this to run the Triton kernels on CPU tensors under TRITON_INTERPRET=1.
USE_TRITON_ON_CPU = False

LAYOUT_ASSERT_MSG = ("kvt::prefix_tree_attention: inconsistent layout (cu_seqlens must start at 0, increase and end "
                     "at T; -1 <= parent[n] < n; range pointers from 0 to R, non-decreasing; ranges inside [0, T])")

_LAYOUT_NAMES = ("cu_seqlens", "parent", "key_range_ptr", "key_ranges", "query_range_ptr", "query_ranges")


def _use_triton(t: torch.Tensor) -> bool:
    return kernel_path(t, USE_TRITON_ON_CPU)


def check_shapes(q, k, v, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges) -> None:
    """The checks that need no data: ranks, shapes, head counts, dtypes, devices, int32 layout tensors of
    consistent sizes. ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (T, heads, head_dim); got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    lay = (cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges)
    devs = {str(x.device) for x in (q, k, v, *lay)}
    if len(devs) != 1:
        raise ValueError(f"tensors on different devices: {sorted(devs)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k/v must be (T={t}, H_kv, D={d}); got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"query heads H={h} must be divisible by KV heads H_kv={k.shape[1]}")
    for name, x in zip(_LAYOUT_NAMES, lay):
        if x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32; got {x.dtype}")
    n = parent.numel()
    if parent.dim() != 1 or n == 0:
        raise ValueError(f"parent must be (N,) with N >= 1 nodes; got {tuple(parent.shape)}")
    for name, x in (("cu_seqlens", cu_seqlens), ("key_range_ptr", key_range_ptr),
                    ("query_range_ptr", query_range_ptr)):
        if tuple(x.shape) != (n + 1,):
            raise ValueError(f"{name} must be (N+1,) = ({n + 1},); got {tuple(x.shape)}")
    for name, x in (("key_ranges", key_ranges), ("query_ranges", query_ranges)):
        if x.dim() != 2 or x.shape[1] != 2:
            raise ValueError(f"{name} must be (R, 2) token ranges [lo, hi); got {tuple(x.shape)}")


def check_kernel_support(q: torch.Tensor) -> None:
    """ValueError unless the kernels support q's dtype (fp16/bf16/fp32) and head_dim (1..256)."""
    if q.dtype not in _k.SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}: prefix-tree attention takes float16, bfloat16 or float32 "
                         f"(float64 on CPU tensors, the reference): cast the model or its inputs")
    if not 1 <= q.shape[-1] <= _k.MAX_HEAD_DIM:
        raise ValueError(f"unsupported head_dim {q.shape[-1]}: supported are 1 to {_k.MAX_HEAD_DIM} (padded to the "
                         f"next power of two)")


def _check_values_host(total_tokens, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr,
                       query_ranges) -> PrefixTreeLayout:
    """Read the layout on the host, rebuild it from cu_seqlens/parent and compare the range tensors; ValueError."""
    lay = PrefixTreeLayout.from_tensors(cu_seqlens, parent, total_tokens=total_tokens)
    for name, x in zip(_LAYOUT_NAMES[2:], (key_range_ptr, key_ranges, query_range_ptr, query_ranges)):
        if not torch.equal(x.cpu(), getattr(lay, name).cpu()):
            raise ValueError(f"{name} does not match cu_seqlens/parent (build the layout with "
                             f"PrefixTreeLayout.from_parents / from_tensors and pass its kernel_tensors())")
    return lay


def structure_ok(total_tokens, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges):
    """0-dim bool tensor on the layout's device, no host sync: the structural conditions of the module docstring."""
    cu, par = cu_seqlens.long(), parent.long()
    ok = (cu[0] == 0) & (cu[-1] == int(total_tokens)) & ((cu[1:] - cu[:-1]) > 0).all()
    ok = ok & (par >= -1).all() & (par < torch.arange(par.numel(), device=par.device)).all()
    for ptr, rng in ((key_range_ptr, key_ranges), (query_range_ptr, query_ranges)):
        p, r = ptr.long(), rng.long()
        ok = ok & (p[0] == 0) & (p[-1] == r.shape[0]) & ((p[1:] - p[:-1]) >= 0).all()
        if r.shape[0]:
            ok = ok & (r[:, 0] >= 0).all() & (r[:, 1] <= int(total_tokens)).all() & (r[:, 0] < r[:, 1]).all()
    return ok


def _check_op_inputs(q, k, v, layout_tensors, kernels: bool) -> None:
    check_shapes(q, k, v, *layout_tensors)
    if kernels:
        check_kernel_support(q)
    if layout_tensors[0].device.type == "cpu":
        _check_values_host(q.shape[0], *layout_tensors)
    else:  # once per layout tensors (kernels/layout_memo.py): every layer's forward and backward share them
        checked = memo(*layout_tensors, key=("prefix-tree structure", q.shape[0]))
        if not checked:
            torch._assert_async(structure_ok(q.shape[0], *layout_tensors), LAYOUT_ASSERT_MSG)
            checked["asserted"] = True


@torch.library.custom_op("kvt::prefix_tree_attention", mutates_args=())
def _tree_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, parent: torch.Tensor,
             key_range_ptr: torch.Tensor, key_ranges: torch.Tensor, query_range_ptr: torch.Tensor,
             query_ranges: torch.Tensor, softmax_scale: float, window: Optional[int] = None,
             softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _use_triton(q)
    lay = (cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges)
    _check_op_inputs(q, k, v, lay, kernels)
    var = variant_kwargs(q, window, softcap, sinks)
    if kernels:
        return _k.prefix_tree_fwd(q, k, v, cu_seqlens, key_range_ptr, key_ranges, softmax_scale, **var)
    with torch.no_grad():
        out, lse = _k.prefix_tree_attention_reference(q, k, v, (cu_seqlens, key_range_ptr, key_ranges),
                                                      softmax_scale, **var)
    return out.contiguous(), lse.to(_lse_dtype(q)).contiguous()


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (the CPU reference computes in fp64), else fp32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@_tree_op.register_fake
def _(q, k, v, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges, softmax_scale,
      window=None, softcap=None, sinks=None):
    check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))


@torch.library.custom_op("kvt::prefix_tree_attention_backward", mutates_args=())
def _tree_bwd_op(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
                 parent: torch.Tensor, key_range_ptr: torch.Tensor, key_ranges: torch.Tensor,
                 query_range_ptr: torch.Tensor, query_ranges: torch.Tensor, softmax_scale: float,
                 window: Optional[int] = None, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)``; dsinks ``(H,)`` in sinks' dtype, an empty fp32 ``(0,)`` without sinks."""
    kernels = _use_triton(q)
    check_backward_shapes("kvt::prefix_tree_attention_backward", q, grad_out, out, lse, grad_lse)
    lay = (cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges)
    _check_op_inputs(q, k, v, lay, kernels)
    var = variant_kwargs(q, window, softcap, sinks)
    if kernels:
        grads = _k.prefix_tree_bwd(grad_out, q, k, v, out, lse, cu_seqlens, key_range_ptr, key_ranges,
                                   query_range_ptr, query_ranges, softmax_scale, grad_lse, **var)
    else:
        grads = _k.prefix_tree_attention_reference_backward(grad_out, grad_lse, q, k, v,
                                                            (cu_seqlens, key_range_ptr, key_ranges), softmax_scale,
                                                            **var)
    return tuple(x.contiguous() for x in grads) + (() if sinks is not None else (no_sinks_grad(q),))


@_tree_bwd_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr,
      query_ranges, softmax_scale, window=None, softcap=None, sinks=None):
    ds = no_sinks_grad(q) if sinks is None else torch.empty_like(sinks, memory_format=torch.contiguous_format)
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)) + (ds,)


def _setup_ctx(ctx, inputs, output):
    q, k, v, *lay, softmax_scale, window, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, *lay)
    ctx.scale, ctx.window, ctx.softcap = softmax_scale, window, softcap


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, sinks, *lay = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks = torch.ops.kvt.prefix_tree_attention_backward(
        grad_out.contiguous(), grad_lse, q, k, v, out, lse, *lay, ctx.scale, ctx.window, ctx.softcap, sinks)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, (dsinks if sinks is not None else None)


_tree_op.register_autograd(_backward, setup_context=_setup_ctx)
refuse_double_backward(_tree_bwd_op)


def prefix_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PrefixTreeLayout,
                          softmax_scale: Optional[float] = None, return_lse: bool = False, *,
                          window: Optional[int] = None, softcap: Optional[float] = None,
                          sinks: Optional[torch.Tensor] = None):
    """Prefix-tree attention (validating wrapper of ``torch.ops.kvt.prefix_tree_attention``).

    Args:
        q: ``(T, H, D)`` float16/bfloat16/float32 (float64 on CPU: the reference).
        k, v: ``(T, H_kv, D)``, same dtype and device; ``H % H_kv == 0`` (under ``torch.autocast`` all three are
            cast to the autocast dtype first, as SDPA's are).
        layout: a :class:`~kvtransform.tree_layout.PrefixTreeLayout` (moved to q's device if needed; validated when
            it was built, so no device sync here).
        softmax_scale: a finite real number; default ``D ** -0.5``.
        return_lse: also return the ``(H, T)`` natural-log LSE: fp32 (fp64 for fp64 inputs, computed in fp64).
        window, softcap, sinks: the attention variants as ``kvtransform.ops.dualkv.dualkv_attention``'s (a token's
            position is its position on its root-to-node path); all off by default.

    Returns:
        out ``(T, H, D)`` in q.dtype, or ``(out, lse)``.

    Raises:
        ValueError: a layout that is not a PrefixTreeLayout or whose nodes do not sum to T, an unsupported head_dim
            (outside 1..256; 0 on every path) or dtype, H not divisible by H_kv, q/k/v dtypes or shapes that
            disagree, meta tensors, a softmax_scale that is not a finite real number, a bad window / softcap /
            sinks (one line each).
    """
    if not isinstance(layout, PrefixTreeLayout):
        raise ValueError(f"layout must be a PrefixTreeLayout (PrefixTreeLayout.from_parents(lengths, parents)); got "
                         f"{type(layout).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a 3-D tensor (T, heads, head_dim)")
    if q.device.type == "meta":
        raise ValueError("q is on the meta device (no data): prefix_tree_attention needs real tensors (under "
                         "torch.compile/export use FakeTensors, which trace through the op)")
    if layout.device != q.device:
        layout = layout.to(q.device)
    if layout.total_tokens != q.shape[0]:
        raise ValueError(f"the layout's nodes sum to {layout.total_tokens} tokens but q has T={q.shape[0]}")
    tensors = layout.kernel_tensors()
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        q, k, v = autocast_inputs(q, k, v)
    check_shapes(q, k, v, *tensors)
    check_dtype_path(q, check_kernel_support)
    window, softcap, sinks = check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale)
    out, lse = torch.ops.kvt.prefix_tree_attention(q, k, v, *tensors, scale, window, softcap, sinks)
    return (out, lse) if return_lse else out
