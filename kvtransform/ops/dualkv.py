"""``kvt::dualkv_attention``: attention over the packed shared-prefix (DualKV) layout.

``torch.ops.kvt.dualkv_attention(q, k, v, cu_seqlens, segment_prefix, softmax_scale, window=None, softcap=None,
sinks=None) -> (out, lse)``

* q ``(T, H, D)``, k/v ``(T, H_kv, D)`` (GQA: query head ``h`` reads KV head ``h // (H // H_kv)``), fp16/bf16/fp32;
* cu_seqlens int32 ``(S+1,)``, segment_prefix int32 ``(S,)``: the layout of :class:`kvtransform.layout.DualKVLayout`;
* out ``(T, H, D)`` in q.dtype; lse fp32 ``(H, T)``, natural log of the softmax denominator (scaled scores; with
  sinks, their term included);
* the attention variants (``kvtransform.ops._common.check_attention_variants``): ``window`` (int >= 1, a sliding
  window over each token's position in its own sequence: a response token continues its prefix's positions),
  ``softcap`` (float > 0, Gemma 2's logit soft-capping) and ``sinks`` (``(H,)`` float, gpt-oss's per-head sink
  logits); all off by default.

A prefix token attends causally within its prefix; token ``r`` of a response attends to its group's whole prefix
plus tokens ``0..r`` of its own response (DualKV, arXiv 2605.15422, §2–3).

CUDA tensors run the Triton kernels of ``kvtransform.kernels.dualkv`` (forward in one launch; deterministic
backward); CPU tensors run the plain-PyTorch reference. The fake implementation needs no data, so the op is an opaque
node under ``torch.export``/``torch.compile`` with cu_seqlens/segment_prefix as ordinary tensor inputs.

Autograd: gradients for q, k, v (and sinks). The gradient of ``lse`` is honoured exactly (it enters the backward as
``Delta = rowsum(dO∘O) - dLSE``); the offsets get none. The backward is its own op,
``kvt::dualkv_attention_backward``, so AOT autograd traces it as an opaque node too.

Inconsistent inputs (the transformed graph calls both registered ops directly, past :func:`dualkv_attention`'s
checks). Both ops refuse them on every device and never read or write outside their tensors:

* shapes, dtypes and devices (no data needed) raise ``ValueError`` on the host, as the wrapper does;
* the offsets' *values* (``cu_seqlens`` starting at 0, increasing, ending at ``T = q.shape[0]``; every
  ``segment_prefix`` entry ``-1`` or its group's prefix): on CPU (reference and interpreter paths) they are read on
  the host and raise the wrapper's ``ValueError``; on CUDA they are checked on the device with
  ``torch._assert_async`` (no host sync), so a bad layout is a device-side assert (``RuntimeError`` at the next
  synchronisation; the CUDA context is then unusable). The kernels clamp the offsets into ``[0, T]`` (non-decreasing)
  and the prefix indices into ``[-1, S-1]`` before launching (``kvtransform.kernels.dualkv``), so even before the
  assert surfaces nothing outside ``q``/``k``/``v`` and the outputs is touched.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..kernels import dualkv as _k
from ..layout import DualKVLayout, _check_structure, structure_ok
from ._common import (as_scale, autocast_inputs, check_attention_variants, check_backward_shapes, check_dtype_path,
                      is_tracing, kernel_path, no_sinks_grad, refuse_double_backward, variant_kwargs)

# Tests flip this to run the Triton kernels on CPU tensors under TRITON_INTERPRET=1.
USE_TRITON_ON_CPU = False


def _use_triton(t: torch.Tensor) -> bool:
    return kernel_path(t, USE_TRITON_ON_CPU)


def _reference_fwd(q, k, v, cu_seqlens, segment_prefix, scale, variants: dict):
    out, lse = _k.dualkv_attention_reference(q, k, v, cu_seqlens, segment_prefix, scale, **variants)
    return out.contiguous(), lse.float().contiguous()


# The kernels pad the head dim to max(16, next power of two) with masks (tl.dot needs >= 16 on that axis), so every
# head_dim from 1 to MAX_HEAD_DIM computes correctly; above it the padded tiles do not fit.
SUPPORTED_HEAD_DIMS = (f"1 to {_k.MAX_HEAD_DIM} (padded to the next power of two, at least 16; 64, 80, 96, 128 and 256 "
                       f"are the tuned ones)")


def check_head_dim(d: int) -> None:
    """ValueError unless the DualKV kernels support head_dim ``d`` (1..256)."""
    if not 1 <= d <= _k.MAX_HEAD_DIM:
        raise ValueError(f"unsupported head_dim {d}: supported are {SUPPORTED_HEAD_DIMS}; a model with a larger "
                         f"head_dim cannot use DualKV attention")


def assert_layout_async(cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, total_tokens: int) -> None:
    """Device-side check of the layout's values (:func:`kvtransform.layout.structure_ok`) with
    ``torch._assert_async``: no host sync on CUDA (a failure is a device-side assert, seen at the next
    synchronisation); on CPU tensors it raises ``RuntimeError`` at once."""
    torch._assert_async(structure_ok(cu_seqlens, segment_prefix, total_tokens), _k.LAYOUT_ASSERT_MSG)


def _check_op_inputs(q, k, v, cu_seqlens, segment_prefix, kernels: bool) -> bool:
    """What both registered ops check before computing (see the module docstring): shapes always, the supported
    dtypes and head dims on the kernel path, the offsets' values on the host for CPU tensors and on the device for
    CUDA ones. Returns whether the kernels must assert the layout themselves (CUDA kernel path: their planning
    kernel computes the same check, so no separate launches here)."""
    check_shapes(q, k, v, cu_seqlens, segment_prefix)
    if kernels:
        check_kernel_support(q)
    if cu_seqlens.device.type == "cpu":
        _check_layout_values(cu_seqlens, segment_prefix, q.shape[0])
        return False
    if kernels:
        return True
    assert_layout_async(cu_seqlens, segment_prefix, q.shape[0])
    return False


@torch.library.custom_op("kvt::dualkv_attention", mutates_args=())
def _dualkv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               segment_prefix: torch.Tensor, softmax_scale: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    kernels = _use_triton(q)
    in_kernel_check = _check_op_inputs(q, k, v, cu_seqlens, segment_prefix, kernels)
    var = variant_kwargs(q, window, softcap, sinks)
    if kernels:
        return _k.dualkv_fwd(q, k, v, cu_seqlens, segment_prefix, softmax_scale, assert_layout=in_kernel_check,
                             **var)
    with torch.no_grad():
        return _reference_fwd(q, k, v, cu_seqlens, segment_prefix, softmax_scale, var)


@_dualkv_op.register_fake
def _(q, k, v, cu_seqlens, segment_prefix, softmax_scale, window=None, softcap=None, sinks=None):
    check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # the op returns contiguous tensors
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("kvt::dualkv_attention_backward", mutates_args=())
def _dualkv_bwd_op(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
                   segment_prefix: torch.Tensor, softmax_scale: float, window: Optional[int] = None,
                   softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)``; dsinks ``(H,)`` in sinks' dtype, an empty fp32 ``(0,)`` without sinks."""
    kernels = _use_triton(q)
    check_backward_shapes("kvt::dualkv_attention_backward", q, grad_out, out, lse, grad_lse)
    in_kernel_check = _check_op_inputs(q, k, v, cu_seqlens, segment_prefix, kernels)
    var = variant_kwargs(q, window, softcap, sinks)
    if kernels:
        grads = _k.dualkv_bwd(grad_out, q, k, v, out, lse, cu_seqlens, segment_prefix, softmax_scale, grad_lse,
                              assert_layout=in_kernel_check, **var)
    else:
        grads = _k.dualkv_attention_reference_backward(grad_out, grad_lse, q, k, v, cu_seqlens, segment_prefix,
                                                       softmax_scale, **var)
    return tuple(x.contiguous() for x in grads) + (() if sinks is not None else (no_sinks_grad(q),))


@_dualkv_bwd_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens, segment_prefix, softmax_scale, window=None, softcap=None,
      sinks=None):
    ds = no_sinks_grad(q) if sinks is None else torch.empty_like(sinks, memory_format=torch.contiguous_format)
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)) + (ds,)


def _setup_ctx(ctx, inputs, output):
    q, k, v, cu_seqlens, segment_prefix, softmax_scale, window, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, segment_prefix, sinks)
    ctx.scale, ctx.window, ctx.softcap = softmax_scale, window, softcap


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens, segment_prefix, sinks = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks = torch.ops.kvt.dualkv_attention_backward(
        grad_out.contiguous(), grad_lse, q, k, v, out, lse, cu_seqlens, segment_prefix, ctx.scale, ctx.window,
        ctx.softcap, sinks)
    return dq, dk, dv, None, None, None, None, None, (dsinks if sinks is not None else None)


_dualkv_op.register_autograd(_backward, setup_context=_setup_ctx)
refuse_double_backward(_dualkv_bwd_op)


# ====================================================================================================== wrapper
def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 segment_prefix: torch.Tensor, check_data: bool = True) -> None:
    """Validate DualKV inputs; raises ValueError naming the problem (see :func:`dualkv_attention`)."""
    check_shapes(q, k, v, cu_seqlens, segment_prefix)
    check_dtype_path(q, check_kernel_support)
    if check_data:
        _check_layout_values(cu_seqlens, segment_prefix, q.shape[0])


def _check_layout_values(cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, total_tokens: int) -> None:
    """The layout's values read on the host (one sync on CUDA, free on CPU); ValueError naming the problem."""
    _check_structure([int(x) for x in cu_seqlens.tolist()], [int(x) for x in segment_prefix.tolist()], total_tokens)


def check_kernel_support(q: torch.Tensor) -> None:
    """ValueError unless the kernels support q's dtype (fp16/bf16/fp32) and head_dim (1..256)."""
    if q.dtype not in _k.SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}: DualKV attention takes float16, bfloat16 or float32 (float64 "
                         f"on CPU tensors, the reference): cast the model or its inputs")
    check_head_dim(q.shape[-1])


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 segment_prefix: torch.Tensor) -> None:
    """The checks that need no data: ranks, shapes, head counts, dtypes that must agree, devices, int32 offsets of
    sizes ``(S+1,)`` and ``(S,)`` with ``S >= 1``. Raises ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (T, heads, head_dim); got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    devs = {str(t.device) for t in (q, k, v, cu_seqlens, segment_prefix)}
    if len(devs) != 1:
        raise ValueError(f"tensors on different devices: q {q.device}, k {k.device}, v {v.device}, cu_seqlens "
                         f"{cu_seqlens.device}, segment_prefix {segment_prefix.device}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    t, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k/v must be (T={t}, H_kv, D={d}); got {tuple(k.shape)}")
    h_kv = k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"query heads H={h} must be divisible by KV heads H_kv={h_kv}")
    if cu_seqlens.dtype != torch.int32 or segment_prefix.dtype != torch.int32:
        raise ValueError(f"cu_seqlens and segment_prefix must be int32; got {cu_seqlens.dtype}, "
                         f"{segment_prefix.dtype}")
    if cu_seqlens.dim() != 1 or segment_prefix.dim() != 1 or cu_seqlens.numel() != segment_prefix.numel() + 1:
        raise ValueError(f"cu_seqlens must be (S+1,) and segment_prefix (S,); got {tuple(cu_seqlens.shape)} and "
                         f"{tuple(segment_prefix.shape)}")
    if segment_prefix.numel() == 0:
        raise ValueError("the layout has no segments (segment_prefix is empty)")


def dualkv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     layout: Union[DualKVLayout, torch.Tensor], segment_prefix: Optional[torch.Tensor] = None,
                     softmax_scale: Optional[float] = None, return_lse: bool = False, *,
                     window: Optional[int] = None, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None):
    """DualKV attention over the packed shared-prefix layout (validating wrapper of ``torch.ops.kvt.dualkv_attention``).

    Args:
        q: ``(T, H, D)`` float16/bfloat16/float32 (float64 on CPU tensors: the reference).
        k, v: ``(T, H_kv, D)``, same dtype and device; ``H % H_kv == 0`` (under ``torch.autocast`` all three are
            cast to the autocast dtype first, as SDPA's are).
        layout: a :class:`DualKVLayout` (moved to q's device if needed), or the int32 ``cu_seqlens`` ``(S+1,)``
            tensor, in which case ``segment_prefix`` (int32 ``(S,)``) is required.
        softmax_scale: a finite real number; default ``D ** -0.5``.
        return_lse: also return the fp32 ``(H, T)`` natural-log LSE (with sinks, their term included).
        window: sliding window (HF ``sliding_window``): the query at position ``i`` of its sequence sees keys at
            ``i - window < j <= i``; a response token's positions continue its prefix's. None: full causal.
        softcap: Gemma 2 logit soft-capping ``s = softcap * tanh(s / softcap)`` on the scaled scores (before the
            mask). None: off.
        sinks: gpt-oss learned sinks, ``(H,)`` float on q's device (one logit per query head; an extra
            ``exp(sinks[h])`` in each softmax denominator); differentiable. None: off.

    Returns:
        out ``(T, H, D)`` in q.dtype, or ``(out, lse)``.

    Raises:
        ValueError: offsets not starting at 0 or not monotone, offsets that do not sum to T, a prompt or response of
            length 0, a response not directly after its prefix, an unsupported head_dim (outside 1..256) or
            dtype, H not divisible by H_kv, q/k/v dtypes or shapes that disagree, or tensors on
            different devices, a window that is not an int >= 1, a softcap that is not a finite float > 0, sinks
            that are not ``(H,)`` floats on q's device, a softmax_scale that is not a finite real number (one line
            each). The data checks (offset values) are skipped while tracing (export/compile).
    """
    check_data = True
    if isinstance(layout, DualKVLayout):
        if segment_prefix is not None:
            raise ValueError("pass segment_prefix only with a cu_seqlens tensor, not with a DualKVLayout")
        if layout.device != q.device:
            layout = layout.to(q.device)
        cu_seqlens, segment_prefix = layout.cu_seqlens, layout.segment_prefix
        # A DualKVLayout was checked when it was built (its tensors agree with its python lengths), so the values are
        # checked on the host from those lengths: no device sync (the op's device-side assert still guards them).
        check_data = False
        if layout.total_tokens != q.shape[0]:
            raise ValueError(f"the layout's segments sum to {layout.total_tokens} tokens but q has T={q.shape[0]} "
                             f"(cu_seqlens must end at T)")
    elif type(layout).__name__ == "PrefixTreeLayout":
        raise ValueError("a PrefixTreeLayout goes to kvt.prefix_tree_attention(q, k, v, layout); "
                         "kvt.dualkv_attention takes a DualKVLayout (layout.as_dualkv() for a one-level tree)")
    else:
        cu_seqlens = layout
        if segment_prefix is None:
            raise ValueError("segment_prefix is required when layout is a cu_seqlens tensor")
        for name, x in (("cu_seqlens", cu_seqlens), ("segment_prefix", segment_prefix)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name} must be an int32 tensor; got {type(x).__name__}: pass a DualKVLayout "
                                 f"(DualKVLayout.from_lengths([(P, [R, ..]), ..])) or torch.tensor(..., "
                                 f"dtype=torch.int32)")
    if all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        q, k, v = autocast_inputs(q, k, v)
    check_inputs(q, k, v, cu_seqlens, segment_prefix, check_data=check_data and not is_tracing(q, cu_seqlens))
    window, softcap, sinks = check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale)
    out, lse = torch.ops.kvt.dualkv_attention(q, k, v, cu_seqlens, segment_prefix, scale, window, softcap, sinks)
    return (out, lse) if return_lse else out


__all__ = ["dualkv_attention", "check_inputs", "check_shapes", "check_kernel_support", "check_head_dim",
           "assert_layout_async", "DualKVLayout"]
