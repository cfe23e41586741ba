"""``kvtransform plan-memory [MODEL] gpu_gb=... batch=... input_len=... output_len=...``: the SpeContext memory model
(arXiv 2512.00722 §6; :mod:`kvtransform.runtime.memory`): when each layer's KV moves to CPU and the largest batch,
as a table. A Hydra app (``conf/plan_memory.yaml``)."""
from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig

from .errors import console
from .hydra_app import run_hydra

__all__ = ["main"]


def job(cfg: DictConfig) -> None:
    from ..runtime.memory import run_plan_memory
    from ..runtime.throughput import StepModel, best_batch, tokens_per_second

    rates = None  # checked before the model is read, one line per bad value
    for key, ok, want in (("overlap", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
                          ("gpu_factor", lambda v: 1 <= v < float("inf"), ">= 1 and finite (a step over its floor)")):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise ValueError(f"{key}={v!r} must be {want}")
    if cfg.hbm_gbps or cfg.link_gbps:
        for key in ("hbm_gbps", "link_gbps"):
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v * 1e9 < float("inf"):
                raise ValueError(f"{key}={v!r}: the throughput model needs both hbm_gbps and link_gbps as positive, "
                                 f"finite GB/s (or neither)")
        rates = StepModel(float(cfg.hbm_gbps) * 1e9, float(cfg.link_gbps) * 1e9, float(cfg.overlap),
                          float(cfg.gpu_factor))
    plan = run_plan_memory(cfg)
    console().print(plan.table(), soft_wrap=True)
    if rates is not None:
        best, rate = best_batch(plan.model, plan.head, rates, gpu_bytes=plan.gpu_bytes, input_len=plan.input_len,
                                output_len=plan.output_len, budget=plan.budget, reserve_bytes=plan.reserve_bytes)
        console().print(f"\nModelled decode tokens/s (HBM {cfg.hbm_gbps:g} GB/s x {cfg.gpu_factor:g}, link "
                        f"{cfg.link_gbps:g} GB/s, overlap {cfg.overlap:g}): batch {plan.batch} "
                        f"{tokens_per_second(plan, rates):.4g}; the most at batch {best.batch}: {rate:.4g}",
                        soft_wrap=True)


def main(args: Sequence[str]) -> int:
    return run_hydra(args, "plan_memory", "kvtransform plan-memory", job)
