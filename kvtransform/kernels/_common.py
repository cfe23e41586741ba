"""Helpers shared by the Triton kernel files (``dualkv.py``, ``retrieval.py``, ``sparse_decode.py``).

Host-side only (no ``@triton.jit`` code): block-size padding, the ``tl.dot`` precision per input dtype, whether the
Triton interpreter runs (``TRITON_INTERPRET=1``: CPU tensors, used by the tests) and the device's SM count.
See ``docs/ARCHITECTURE.md`` for where kernels sit in the package.
"""
from __future__ import annotations

import os

import torch
import triton

__all__ = ["next_pow2", "dot_precision", "interpreting", "num_sms", "last_dim_contiguous"]


def next_pow2(x: int, minimum: int = 1) -> int:
    """Smallest power of two ``>= x``, and at least ``minimum`` (``tl.arange`` and ``tl.dot`` block sizes: head dims
    and GQA group sizes are padded to it, with masks; ``tl.dot`` wants 16 or more)."""
    return max(minimum, triton.next_power_of_2(int(x)))


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of ``tl.dot``: IEEE fp32 dots for fp32 inputs (exact enough for the fp32 tests); for
    fp16/bf16 inputs the tensor cores with fp32 accumulation (``"tf32"`` only matters for fp32 operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has stride 1 (a kernel that takes the other strides reads it in place), else a
    contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def interpreting() -> bool:
    """True under Triton's CPU interpreter (``TRITON_INTERPRET=1``); kernels then use small launch configs."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere), for split counts of about two programs per SM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
