"""``kvtransform eval-sparse [MODEL] [key=value ...] [-m]``: recall / NLL / greedy agreement of SpeContext retrieval
heads on real text (:mod:`kvtransform.eval_sparse`; arXiv 2512.00722 §4.3), a Hydra app (``conf/eval_sparse.yaml``)."""
from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig

from .errors import console
from .hydra_app import run_hydra

__all__ = ["main"]


def job(cfg: DictConfig) -> None:
    from ..eval_sparse import markdown, run_eval, summarize

    df = run_eval(cfg)
    console().print(markdown(summarize(df)), soft_wrap=True)  # a markdown table: never wrapped at 80 columns
    console().print(f"[bold]Wrote[/bold] {cfg.out}/results.csv, results.md, results.png")


def precheck(cfg: DictConfig) -> None:
    from ..eval_sparse import check_config

    check_config(cfg)


def main(args: Sequence[str]) -> int:
    # a sweep's jobs merge their rows into one results table (eval_sparse.write_results)
    return run_hydra(args, "eval_sparse", "kvtransform eval-sparse", job, sweep_shares_out=True, precheck=precheck)
