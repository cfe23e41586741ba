"""How the ``decode`` suite turns a few timed decode steps into the time of a whole long generation: the contexts it
samples, the per-step time of a sample (the difference of two runs, fixed costs cancelling), the integral over every
step, and the timed prefill scaled to all requests (see :mod:`.decode` for the method; BENCHMARKS.md, "Decode
throughput").
"""
from __future__ import annotations

import time
from typing import Callable

from .timing import sync

__all__ = ["sample_contexts", "integrate_steps", "per_step", "timed_prefill"]


def sample_contexts(input_len: int, output_len: int, samples: int, tail: int) -> list:
    """Context lengths (tokens in the cache before a decode step) at which steps are timed: ``samples`` points
    spread evenly over the run's steps, the last ``tail`` tokens short of the cache's end (a timed sample decodes
    ``tail`` tokens). Decode steps run at contexts ``input + 1 .. input + output - 1``."""
    first, last = input_len + 1, max(input_len + 1, input_len + output_len - 1 - tail)
    if samples <= 1 or last == first:
        return [first]
    return sorted({round(first + (last - first) * i / (samples - 1)) for i in range(samples)})


def integrate_steps(contexts: list, ms: list, input_len: int, output_len: int) -> float:
    """Seconds of all ``output - 1`` decode steps (contexts ``input + 1 .. input + output - 1``) from step times
    ``ms`` sampled at ``contexts``: linear between samples, constant beyond the first and the last."""
    import numpy as np

    steps = np.arange(input_len + 1, input_len + output_len, dtype=np.float64)
    return float(np.interp(steps, np.asarray(contexts, dtype=np.float64), np.asarray(ms, dtype=np.float64)).sum()
                 / 1000.0)


def per_step(run: Callable, n0: int, steps: int, tries: int = 3) -> float:
    """ms per step from ``run(n) -> seconds`` of ``n`` decode steps: ``(run(n0 + steps) - run(n0)) / steps``, the
    fixed costs (capture, head prefill, warm-up) cancelling. Timing noise can make the longer run the faster one:
    then it is measured again, up to ``tries`` times, and NaN (a ``noisy`` sample, left out of the integral) when it
    never is slower."""
    for _ in range(tries):
        short = run(n0)
        diff = run(n0 + steps) - short
        if diff > 0:
            return 1000 * diff / steps
    return float("nan")


def timed_prefill(prefill: Callable, input_len: int, requests: int, prefill_tokens: int, device) -> tuple:
    """(seconds to prefill all ``requests``, requests per timed prefill): ``prefill(g)`` runs ``g`` prompts of
    ``input_len`` tokens (``g = prefill_tokens // input_len``, 1 to ``requests``); the second of two calls is timed
    (the first warms up) and scaled by ``requests / g``."""
    g = max(1, min(requests, prefill_tokens // input_len))
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        prefill(g)
        sync(device)
    return (time.perf_counter() - t0) * requests / g, g
