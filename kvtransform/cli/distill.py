"""``kvtransform distill-retrieval-head [MODEL] [key=value ...]``: train SpeContext's distilled retrieval head on
MODEL's own attention (:mod:`kvtransform.distill`; arXiv 2512.00722 §9), a Hydra app
(``conf/distill_retrieval_head.yaml``)."""
from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig

from .errors import console
from .hydra_app import run_hydra

__all__ = ["main"]


def job(cfg: DictConfig) -> None:
    from ..distill import distill

    res = distill(cfg, log=console().print)
    steps = f"{res['steps']} step{'' if res['steps'] == 1 else 's'}"
    console().print(f"[bold]Saved[/bold] the distilled head to {res['out']} after {steps} on {res['device']} in "
                    f"{res['seconds'] / 60:.1f} min (top-k teacher mass on the training text {res['captured']:.3f}); "
                    f"use it with transform.head=distilled transform.retrieval={res['out']}")


def precheck(cfg: DictConfig) -> None:
    from ..distill import check_config

    check_config(cfg)


def main(args: Sequence[str]) -> int:
    return run_hydra(args, "distill_retrieval_head", "kvtransform distill-retrieval-head", job, precheck=precheck)
