"""Helpers shared by the op wrappers: tracing detection, integer checks, deprecated keyword names, autocast casting,
the attention variants' arguments (``window``, ``softcap``, ``sinks``: ``docs/ARCHITECTURE.md``)."""
from __future__ import annotations

import functools
import math
import operator
import warnings
from typing import Optional

import torch


def is_tracing(*tensors) -> bool:
    """True while torch.compile / torch.export trace (fake or functional tensors), where data-dependent checks
    (``int(t.max())``, ...) are impossible. ``None`` entries are ignored."""
    try:
        if torch.compiler.is_compiling():
            return True
    except Exception:  # pragma: no cover - very old torch
        pass
    from torch._subclasses.fake_tensor import is_fake

    for t in tensors:
        if t is None:
            continue
        if is_fake(t) or (type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)):
            return True
    return False


def as_int(x, what: str, unit: str = "", keyword: Optional[str] = None) -> int:
    """``x`` as a python int: python ints and NumPy / torch integer scalars (``operator.index``; a traced SymInt
    passes through); a float, a bool or anything else raises ValueError instead of being truncated silently.

    ``what`` names the value in the message (``unit`` follows "an integer"); with ``keyword`` the message suggests
    ``keyword=<the value rounded down>``.
    """
    if isinstance(x, torch.SymInt):
        return x
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        raise ValueError(f"{what} must be an integer{unit}; got the bool {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        hint = (f"e.g. {keyword}={int(x) if isinstance(x, float) else 1}" if keyword
                else "(int, or a NumPy/torch integer)")
        raise ValueError(f"{what} must be an integer{unit}; got {x!r} ({type(x).__name__}): pass a whole "
                         f"number {hint}") from None


def as_scale(x) -> float:
    """softmax_scale as a finite python float; ValueError (one line) for NaN/inf, bools, strings, tensors of more
    than one element."""
    ok = not isinstance(x, (bool, str, bytes)) and not (isinstance(x, torch.Tensor) and x.numel() != 1)
    try:
        val = float(x) if ok else None
    except (TypeError, ValueError):
        val = None
    if val is None or not math.isfinite(val):
        raise ValueError(f"softmax_scale must be a finite real number (default: head_dim ** -0.5); got {x!r}")
    return val


def renamed_kwargs(**old_to_new: str):
    """Decorator: accept the old keyword names of a public op wrapper for one release (a ``DeprecationWarning``
    names the new one). Passing both the old and the new name is a TypeError."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {old}= (deprecated) and {new}=: pass {new}= only")
                    warnings.warn(f"{fn.__name__}({old}=...) is deprecated; use {new}=", DeprecationWarning,
                                  stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return deco


def kernel_path(t: torch.Tensor, on_cpu: bool) -> bool:
    """Whether an op runs its Triton kernels for ``t``: always on CUDA; on CPU only when ``on_cpu`` (an op module's
    ``USE_TRITON_ON_CPU``, which the tests flip) and Triton's interpreter runs (``TRITON_INTERPRET=1``)."""
    from kvtransform.kernels._common import interpreting

    return t.is_cuda or (on_cpu and interpreting())


def check_dtype_path(q: torch.Tensor, check_kernel_support) -> None:
    """The wrappers' dtype / head-dim check: float64 CPU tensors run the op's reference (any head_dim >= 1),
    everything else must suit the kernels (``check_kernel_support(q)``, the op's own ValueError)."""
    if q.dtype != torch.float64 or q.is_cuda:
        check_kernel_support(q)
    elif q.shape[-1] == 0:
        raise ValueError("unsupported head_dim 0: q, k, v need head_dim >= 1")


def autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """``(q, k, v)`` cast to the autocast dtype while ``torch.autocast`` is on for q's device, as SDPA's inputs are
    (mixed-precision training: fp32 weights' RoPE outputs q/k stay fp32 while the value projection is bf16); float64
    and non-float tensors, and everything outside autocast, unchanged."""
    dev = q.device.type
    if not torch.is_autocast_enabled(dev):
        return q, k, v
    dt = torch.get_autocast_dtype(dev)
    return tuple(x.to(dt) if x.is_floating_point() and x.dtype != torch.float64 else x for x in (q, k, v))


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_attention_variants(window, softcap, sinks, num_heads: int, device=None):
    """The three optional attention-variant arguments of every kvt attention op, checked and normalised; each bad
    value raises a one-line ValueError naming the fix.

    * ``window``: HF ``sliding_window`` semantics (Mistral, Gemma 2/3, gpt-oss): the query at sequence position
      ``i`` sees keys at positions ``i - window < j <= i``; a python/NumPy/torch int ``>= 1`` (a traced SymInt
      passes), returned as an int; ``None``: no window.
    * ``softcap``: Gemma 2's logit soft-capping ``s = softcap * tanh(s / softcap)`` on the scaled scores, before
      the mask; a finite real ``> 0``, returned as a float; ``None``: off.
    * ``sinks``: gpt-oss's learned attention sinks, a float tensor ``(H,)`` (one logit per query head; any float
      dtype, computed in fp32) on ``device`` (when given): an extra ``exp(sinks[h])`` term in every row's softmax
      denominator (a virtual key with value 0); ``None``: off.

    Returns ``(window, softcap, sinks)``.
    """
    if window is not None and not isinstance(window, torch.SymInt):
        ok = not isinstance(window, bool) and not (isinstance(window, torch.Tensor) and window.numel() != 1)
        try:
            w = operator.index(window) if ok else None
        except TypeError:
            w = None
        if w is None or w < 1:
            raise ValueError(f"window must be a positive int (tokens a query sees, including itself); got {window!r}")
        window = int(w)
    if softcap is not None:
        ok = not isinstance(softcap, (bool, str, bytes)) and not (isinstance(softcap, torch.Tensor)
                                                                 and softcap.numel() != 1)
        try:
            c = float(softcap) if ok else None
        except (TypeError, ValueError):
            c = None
        if c is None or not math.isfinite(c) or c <= 0 or c > _FLOAT32_MAX:  # (the kernels divide in fp32)
            raise ValueError(f"softcap must be a finite float > 0 and <= {_FLOAT32_MAX:.4g} (Gemma 2's "
                             f"attn_logit_softcapping, e.g. 50.0); got {softcap!r}")
        softcap = c
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (int(num_heads),) \
                or not sinks.dtype.is_floating_point:
            got = (f"{tuple(sinks.shape)} {sinks.dtype}" if isinstance(sinks, torch.Tensor)
                   else type(sinks).__name__)
            raise ValueError(f"sinks must be (H,) = ({num_heads},) floats, one learned logit per query head "
                             f"(gpt-oss); got {got}")
        if device is not None and sinks.device != torch.device(device):
            raise ValueError(f"sinks must be on {device} like q; got {sinks.device} (move them with .to(q.device))")
    return window, softcap, sinks


def variant_kwargs(q: torch.Tensor, window, softcap, sinks) -> dict:
    """:func:`check_attention_variants` for q's heads and device, as keyword arguments of the DualKV / prefix-tree
    kernels and references (``window``, ``softcap``, ``sinks``)."""
    window, softcap, sinks = check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    return dict(window=window, softcap=softcap, sinks=sinks)


def no_sinks_grad(q: torch.Tensor) -> torch.Tensor:
    """The ``dsinks`` output of the DualKV / prefix-tree backward ops when there are no sinks: an empty fp32 ``(0,)``
    tensor (a custom op's outputs cannot be None)."""
    return q.new_empty((0,), dtype=torch.float32)


def check_backward_shapes(op: str, q: torch.Tensor, grad_out, out, lse, grad_lse) -> None:
    """The attention backward ops' tensors against ``q`` ``(T, H, D)``: ``grad_out`` and ``out`` ``(T, H, D)``, ``lse``
    and (when given) ``grad_lse`` fp32 ``(H, T)``; ValueError naming ``op`` and the tensor otherwise."""
    t, h, _ = q.shape
    for name, x, want in (("grad_out", grad_out, tuple(q.shape)), ("out", out, tuple(q.shape)),
                          ("lse", lse, (h, t)), ("grad_lse", grad_lse, (h, t))):
        if x is not None and tuple(x.shape) != want:
            raise ValueError(f"{op}: {name} must have shape {want}; got {tuple(x.shape)}")


def refuse_double_backward(op) -> None:
    """Register on a fused attention backward op (the DualKV / prefix-tree kernels' ``..._backward``) an autograd
    formula that refuses second derivatives in one line: their backward is itself a kernel with no derivative.
    Without it a backward through the gradients (``torch.autograd.grad(..., create_graph=True)``, then backward
    again) fails in PyTorch with advice meant for op authors.

    Raises (when a second derivative reaches the op):
        RuntimeError: naming the op and where second derivatives can be taken."""
    name = f"{op._namespace}::{op._name}"

    def backward(ctx, *grads):
        raise RuntimeError(f"{name} has no second derivatives (a backward through gradients taken with "
                           f"create_graph=True); take them through the original model or the canonical transform "
                           f"(kvt.attention supports them)")

    op.register_autograd(backward)
