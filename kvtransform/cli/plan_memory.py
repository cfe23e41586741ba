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
    from ..runtime.memory import GIB, plan_memory, run_plan_memory
    from ..runtime.throughput import StepModel, best_batch, tokens_per_second

    plan = run_plan_memory(cfg)  # checks every setting, the throughput keys too, before the model is read
    console().print(plan.table(), soft_wrap=True)
    if not cfg.hbm_gbps:
        return
    rates = StepModel(float(cfg.hbm_gbps) * 1e9, float(cfg.link_gbps) * 1e9, float(cfg.overlap),
                      float(cfg.gpu_factor))
    host = float(cfg.host_gb)
    kw = dict(gpu_bytes=plan.gpu_bytes, input_len=plan.input_len, output_len=plan.output_len, budget=plan.budget,
              reserve_bytes=plan.reserve_bytes)
    # (a model with sliding-window layers cannot offload: its best batch is among the resident ones)
    best, rate = best_batch(plan.model, plan.head, rates, host_bytes=int(host * GIB),
                            max_batch=plan.max_batch_resident if plan.model.window else 0, **kw)
    lines = [f"\nModelled decode tokens/s (decode steps only: the GPU step {cfg.gpu_factor:g}x its floor at "
             f"{cfg.hbm_gbps:g} GB/s, elastic loading at {cfg.link_gbps:g} GB/s, selection overlap {cfg.overlap:g}):",
             f"  batch {plan.batch} (the plan above): {tokens_per_second(plan, rates):,.0f} "
             f"({len(plan.offloaded_at(plan.final_len))} layers on CPU by the last token)",
             f"  the most: batch {best.batch}: {rate:,.0f} ({len(best.offloaded_at(best.final_len))} layers on CPU by "
             f"the last token, {best.pinned_bytes / GIB:.3g} GiB pinned)"]
    if plan.max_batch_resident >= 1:
        resident = plan_memory(plan.model, plan.head, batch=plan.max_batch_resident, **kw)
        lines.append(f"  without offload: batch {resident.batch} (the largest resident): "
                     f"{tokens_per_second(resident, rates):,.0f}")
    console().print("\n".join(lines), soft_wrap=True)


def main(args: Sequence[str]) -> int:
    return run_hydra(args, "plan_memory", "kvtransform plan-memory", job)
