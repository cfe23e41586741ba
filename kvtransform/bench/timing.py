"""The one timing loop of every benchmark suite: :func:`time_steps` (CUDA events on CUDA, optionally CUDA-graph
replays for sub-millisecond ops; the host clock on CPU) and :func:`percentile` for p20/p50/p80."""
from __future__ import annotations

import math
import time
from typing import Callable, List

import torch

__all__ = ["sync", "percentile", "time_steps", "quantiles"]


def sync(device) -> None:
    """Wait for the device (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def percentile(xs: list, p: float) -> float:
    """Linear-interpolated percentile (numpy's default) of a non-empty list."""
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def quantiles(ms: List[float]) -> dict:
    """``ms_p20``, ``ms_p50``, ``ms_p80`` and ``ms_mean`` (milliseconds) of the timed samples, the CSV's columns."""
    return dict(ms_p20=percentile(ms, 20), ms_p50=percentile(ms, 50), ms_p80=percentile(ms, 80),
                ms_mean=sum(ms) / len(ms))


def _graph_samples(step: Callable, device, iters: int, t_step_s: float, sample_ms: float) -> List[List[float]]:
    """Capture ``n`` calls of ``step`` in one CUDA graph (``n`` so that one replay lasts about ``sample_ms``) and
    time ``iters`` replays; returns ``[[ms per call]]`` per replay. Raises if the step cannot be captured."""
    n = max(1, min(1000, math.ceil(sample_ms / max(t_step_s * 1e3, 1e-3))))
    noop = lambda: None  # noqa: E731
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):  # warm the allocator on the capture stream
        step(noop)
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            step(noop)
    g.replay()
    torch.cuda.synchronize(device)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize(device)
    out = [[a.elapsed_time(b) / n] for a, b in ev]
    del g
    return out


def time_steps(step: Callable, device, warmup: int, iters: int, budget_s: float = 0.0, min_iters: int = 3,
               cuda_graph: bool = False, sample_ms: float = 20.0) -> List[List[float]]:
    """Run ``step(mark)`` ``warmup`` times untimed, then time it ``iters`` times.

    ``step`` calls ``mark()`` at internal boundaries (e.g. between forward and backward). Returns one list per
    iteration of the milliseconds between consecutive marks, the step's start and end included as marks, measured
    with CUDA events on CUDA, ``time.perf_counter`` on CPU. With ``budget_s > 0`` the timed steps are cut to fit the
    budget (never below ``min_iters``), estimated from the last warm-up's wall time.

    ``cuda_graph`` (CUDA only; decode-sized ops where launch overhead would dominate): the step is captured about
    ``sample_ms`` worth of times into one CUDA graph and each timed sample is one replay divided by the number of
    calls in it (as ``triton.testing.do_bench_cudagraph``); marks are ignored, one number per sample. If the capture
    fails the step is timed eagerly.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    noop = lambda: None  # noqa: E731
    t_step = 0.0
    for _ in range(max(warmup, 1 if cuda_graph else 0)):
        t0 = time.perf_counter()
        step(noop)
        sync(device)
        t_step = time.perf_counter() - t0
    if budget_s > 0 and t_step > 0:
        iters = max(min(iters, int(budget_s / t_step)), min(min_iters, iters))
    if cuda and cuda_graph:
        try:
            return _graph_samples(step, device, iters, t_step, sample_ms)
        except Exception:  # not capturable (host sync, allocation pattern): eager events below
            torch.cuda.synchronize(device)
    results = []
    if cuda:
        all_marks = []
        for _ in range(iters):
            marks = []

            def mark(marks=marks):
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)

            mark()
            step(mark)
            mark()
            all_marks.append(marks)
        torch.cuda.synchronize(device)
        for marks in all_marks:
            results.append([a.elapsed_time(b) for a, b in zip(marks[:-1], marks[1:])])
    else:
        for _ in range(iters):
            marks = []

            def mark(marks=marks):
                marks.append(time.perf_counter())

            mark()
            step(mark)
            mark()
            results.append([(b - a) * 1e3 for a, b in zip(marks[:-1], marks[1:])])
    return results
