"""The device a benchmark job runs on and its measured copy bandwidth (the HBM floor's denominator)."""
from __future__ import annotations

import time

import torch

from .timing import sync

__all__ = ["resolve_device", "copy_bandwidth"]


def resolve_device(cfg) -> torch.device:
    """``device=auto``: cuda if available, else cpu; otherwise ``torch.device(cfg.device)``."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def copy_bandwidth(device, mib: int = 4096) -> float:
    """Device copy bandwidth in bytes/s: read + written bytes of ``y.copy_(x)`` over ``mib`` MiB, best of 6."""
    a = torch.empty(mib << 19, dtype=torch.int16, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    n = 2 * a.numel() * a.element_size()
    del a, b
    return n / best
