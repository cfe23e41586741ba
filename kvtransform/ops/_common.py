"""Helpers shared by the op wrappers: tracing detection, integer checks, deprecated keyword names."""
from __future__ import annotations

import functools
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
        raise ValueError(f"{what} must be an integer{unit}; got {x!r} ({type(x).__name__}): pass whole token "
                         f"counts {hint}") from None


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
