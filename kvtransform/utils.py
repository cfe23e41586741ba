"""Small helpers shared by the transforms, the verification gate and the CLI (progress stages, devices, names)."""
from __future__ import annotations

import contextlib
import time

import torch


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); CPU for a module with neither."""
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def model_name(model) -> str:
    """The model's hub id / directory (``config._name_or_path``), else its class name."""
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
               or type(model).__name__)


@contextlib.contextmanager
def stage(progress: bool, text: str):
    """A rich status spinner with ``text`` while the block runs, then ``✓ text (N s)`` on stderr; yields the status
    (``.update(text)``) or None when ``progress`` is false."""
    if not progress:
        yield None
        return
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with console.status(text) as st:
        yield st
    console.print(f"[dim]✓ {text} ({time.perf_counter() - t0:.1f} s)[/dim]")


@contextlib.contextmanager
def timed(timings: dict, key: str):
    """Record the block's wall time in seconds (3 decimals) as ``timings[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = round(time.perf_counter() - t0, 3)
