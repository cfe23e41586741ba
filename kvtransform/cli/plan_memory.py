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

    console().print(run_plan_memory(cfg).table(), soft_wrap=True)


def main(args: Sequence[str]) -> int:
    return run_hydra(args, "plan_memory", "kvtransform plan-memory", job)
