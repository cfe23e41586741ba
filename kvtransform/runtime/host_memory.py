"""Pinned CPU memory for offloaded KV layers (SpeContext arXiv 2512.00722 §5) and the device view GPU kernels read
it through.

``torch.zeros(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every block up to
a power of two and keeps freed blocks for reuse: an offloaded layer of 2.1 GiB took 4 GiB of page-locked memory, so
a plan sized to three quarters of the machine's memory ran the host out of memory (BENCHMARKS.md, "Decode
throughput"). :func:`pinned_zeros` page-locks an ordinary CPU allocation at its exact size instead
(``cudaHostRegister``) and unlocks it when the tensor is freed.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["pinned_zeros", "host_view"]

#: cudaHostRegisterPortable | cudaHostRegisterMapped (CUDA runtime API): locked for every context, mapped into the
#: device address space (with unified addressing the device address is the host address).
_REGISTER_FLAGS = 1 | 2


def pinned_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape``/``dtype`` in page-locked memory of exactly its size (CUDA only).

    Raises:
        RuntimeError: ``cudaHostRegister`` failed (the message names the CUDA error and the size; usually the
            machine's locked-memory limit: lower ``host_gb`` or raise ``ulimit -l``).
    """
    t = torch.zeros(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, _REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"page-locking {nbytes / 2**30:.2f} GiB of CPU memory failed "
                           f"({cudart.cudaGetErrorString(err)}): lower host_gb or raise the locked-memory limit")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def host_view(t: torch.Tensor, device) -> torch.Tensor:
    """A tensor on ``device`` aliasing the pinned CPU tensor ``t`` (CUDA unified virtual addressing: the device
    pointer of pinned memory is its host pointer), so GPU kernels read/write host memory directly; ``t`` itself on
    the CPU stand-in.

    Raises:
        ValueError: ``t`` is not contiguous (the alias describes contiguous memory).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return t
    if not t.is_contiguous():
        raise ValueError("host_view needs a contiguous pinned tensor (a strided view would alias the wrong bytes): "
                         "pass the whole buffer from pinned_zeros")
    raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)

    class _Iface:
        __cuda_array_interface__ = {"shape": tuple(raw.shape), "typestr": "<i2" if t.element_size() == 2 else "<i4",
                                    "data": (raw.data_ptr(), False), "version": 2, "strides": None}

    alias = torch.as_tensor(_Iface(), device=device).view(t.dtype)
    alias._kvt_owner = t  # keep the pinned memory alive with the view
    return alias
