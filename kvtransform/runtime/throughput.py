"""Decode throughput under KV offload: the request count that maximises tokens/s, not merely the largest that fits
(SpeContext arXiv 2512.00722 §5–6: offload buys requests; elastic loading pays for them in host-to-GPU copies).

Step-time model at cached length ``n`` of a :class:`~kvtransform.runtime.memory.MemoryPlan` (its notation: ``W``,
``P``, ``b``, ``L``, ``c``, ``c_h``, ``B``; ``k(n)`` layers on CPU; ``s = min(B, n)`` tokens selected per KV head)::

    t(n) = f · [W + P + b · (L · s · c + n · c_h)] / hbm  +  b · k(n) · (1 − overlap) · s · c / link

The first term is the GPU step: weights, the selected K/V of every layer (resident layers gather from their cache,
offloaded ones from their slot buffers: the same bytes) and the head's own state, at the device's read rate
``hbm`` times ``f``, the measured ratio of a real step to that floor. The second is elastic loading: each offloaded
layer copies the entries that entered the selection (``1 − overlap`` of them) over the host link; the captured step
runs those copies on the compute stream (:mod:`kvtransform.runtime.offload`), so they add to the step. Tokens/s =
``b`` / the mean of ``t`` over the generation (``n`` from ``I`` to ``S − 1``).

Measured (BENCHMARKS.md, "Decode throughput", Llama-8B shape at ``gpu_gb=79.1``): with random-weight heads the
selection changes almost entirely every step, and the largest count that fits (32) ran at half the tokens/s of 12
resident requests.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ..utils import is_count
from .memory import HeadMemory, MemoryPlan, ModelMemory, plan_memory

__all__ = ["StepModel", "step_bytes", "step_seconds", "tokens_per_second", "best_batch"]


@dataclass(frozen=True)
class StepModel:
    """The rates the step-time model needs.

    Attributes:
        hbm_bytes_per_s: the device's memory read rate (bytes/s; the decode suite measures a device-to-device copy).
        link_bytes_per_s: host-to-GPU rate of elastic loading (bytes/s).
        overlap: fraction of a step's selected entries that the previous step had selected too, in [0, 1]
            (``GenerationStats.selection_overlap``).
        gpu_factor: a real step's time over its HBM floor (>= 1; 1: at the floor).
        chunk: tokens by which the runtime grows resident layers (``SpeContextRuntime.offload_chunk``): a layer
            moves at the growth to the first capacity past its threshold, up to ``chunk`` tokens early (1: at the
            threshold).

    Raises:
        ValueError: a rate that is not a positive finite number, an overlap outside [0, 1], a factor below 1 or
            not finite, a chunk below 1 (bools are not numbers here).
    """

    hbm_bytes_per_s: float
    link_bytes_per_s: float
    overlap: float = 0.0
    gpu_factor: float = 1.0
    chunk: int = 1

    def __post_init__(self):
        def real(key):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                return float("nan")
            try:
                return float(v)
            except OverflowError:
                return float("inf")

        for key in ("hbm_bytes_per_s", "link_bytes_per_s"):
            if not 0 < real(key) < math.inf:
                raise ValueError(f"{key}={getattr(self, key)!r} must be a positive number of bytes per second")
        if not 0.0 <= real("overlap") <= 1.0:
            raise ValueError(f"overlap={self.overlap!r} must be a fraction in [0, 1]")
        if not 1.0 <= real("gpu_factor") < math.inf:
            raise ValueError(f"gpu_factor={self.gpu_factor!r} must be >= 1 and finite (a step is never faster than "
                             f"its floor)")
        if not is_count(self.chunk, 1, numpy=True):
            raise ValueError(f"chunk={self.chunk!r} must be an integer >= 1 (tokens)")


def step_bytes(plan: MemoryPlan, n: int, chunk: int = 1) -> tuple:
    """(bytes the GPU step reads, bytes elastic loading copies if every selected entry were new) at cached length
    ``n``, with the layers on CPU that the runtime has at capacity ``ceil((n + 1) / chunk) · chunk``. Heads that
    read layers' keys (``head.resident_layers``: the ``self`` head scores every cached key of layer 0) add those
    keys (``n · c / 2`` per layer and row)."""
    m, h = plan.model, plan.head
    sel = min(plan.budget, n)
    capacity = min(plan.final_len, -(-(n + 1) // chunk) * chunk)
    per_row = m.num_layers * sel * m.kv_token_bytes + n * h.token_bytes + h.resident_layers * n * m.kv_token_bytes // 2
    reads = m.weight_bytes + h.weight_bytes + plan.batch * per_row
    return reads, plan.batch * len(plan.offloaded_at(capacity)) * sel * m.kv_token_bytes


def step_seconds(plan: MemoryPlan, n: int, sm: StepModel) -> float:
    """Modelled decode step of ``plan.batch`` rows at cached length ``n`` (tokens), in seconds."""
    reads, moved = step_bytes(plan, n, sm.chunk)
    return sm.gpu_factor * reads / sm.hbm_bytes_per_s + (1.0 - sm.overlap) * moved / sm.link_bytes_per_s


def tokens_per_second(plan: MemoryPlan, sm: StepModel, points: int = 256) -> float:
    """Modelled decode tokens/s of the whole generation: ``plan.batch`` / the mean step over lengths ``I .. S − 1``
    (``points`` evenly spaced lengths; layer moves are steps of ``k(n)``, so a few hundred points resolve them)."""
    lo, hi = plan.input_len, plan.final_len - 1
    count = max(1, min(points, hi - lo + 1))
    lengths = [lo + round(i * (hi - lo) / max(count - 1, 1)) for i in range(count)]
    mean = sum(step_seconds(plan, n, sm) for n in lengths) / count
    return plan.batch / mean


def best_batch(model: ModelMemory, head: HeadMemory, sm: StepModel, *, gpu_bytes: int, input_len: int,
               output_len: int, budget: int, reserve_bytes: int = 0, max_batch: int = 0, host_bytes: int = 0) -> tuple:
    """``(plan, tokens/s)``: of the batches that fit with offload (Eq. 8), at most ``max_batch`` (0: no bound) and
    with at most ``host_bytes`` of pinned CPU memory at the last token (``MemoryPlan.pinned_bytes``; 0: no bound),
    the one whose :func:`plan_memory` plan has the most modelled tokens/s (:func:`tokens_per_second`); ties go to
    the smaller batch (less memory for the same rate). A search, not a proof of the maximum (the rate is not
    unimodal in the batch: layer moves are steps): every batch up to 512 is scored, past that a grid 1 % apart, then
    finer grids between the best point's neighbours down to every batch there (short requests can fit 10^7 rows:
    a few thousand plans at most).

    Raises:
        ValueError: ``max_batch`` or ``host_bytes`` not an integer >= 0, or not even one row fits
            (:func:`plan_memory`'s message).
    """
    for key, v in (("max_batch", max_batch), ("host_bytes", host_bytes)):
        if not is_count(v, numpy=True):
            raise ValueError(f"{key}={v!r} must be an integer >= 0 (0: no bound)")
    kw = dict(gpu_bytes=gpu_bytes, input_len=input_len, output_len=output_len, budget=budget,
              reserve_bytes=reserve_bytes)
    top = plan_memory(model, head, batch=1, **kw).max_batch
    if max_batch:
        top = min(top, int(max_batch))
    top = max(top, 1)
    if host_bytes:  # pinned bytes grow with the batch: the largest within the bound, by bisection (one row at least)
        lo, hi = 1, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if plan_memory(model, head, batch=mid, **kw).pinned_bytes <= host_bytes else (lo, mid - 1)
        one = plan_memory(model, head, batch=1, **kw).pinned_bytes
        if one > host_bytes:
            raise ValueError(f"one row needs {one / 2**30:.3g} GiB of pinned CPU memory, more than the "
                             f"{host_bytes / 2**30:.3g} GiB allowed: raise the host memory bound (host_bytes; "
                             f"plan-memory's host_gb) or the GPU memory (gpu_bytes; gpu_gb)")
        top = lo
    scored = {}

    def score(b):
        if b not in scored:
            plan = plan_memory(model, head, batch=b, **kw)
            scored[b] = (plan, tokens_per_second(plan, sm))
        return scored[b]

    grid = list(range(1, min(top, 512) + 1))
    while grid[-1] < top:
        grid.append(min(top, max(grid[-1] + 1, int(grid[-1] * 1.01))))
    while True:  # zoom in between the best point's neighbours, at most 512 plans a round
        best = max(grid, key=lambda b: (score(b)[1], -b))
        i = grid.index(best)
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        if hi - lo <= 512:
            break
        grid = sorted({lo, hi, best} | {lo + (hi - lo) * j // 256 for j in range(257)})
    for b in range(lo, hi + 1):
        score(b)
    b = max(scored, key=lambda b: (scored[b][1], -b))
    return scored[b]
