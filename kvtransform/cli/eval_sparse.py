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
    """The settings, and the ``results.csv`` the job would merge into (a damaged one is named before any job)."""
    from omegaconf.errors import OmegaConfBaseException

    from ..eval_sparse import check_config, read_results

    check_config(cfg)
    try:
        out = cfg.out
    except OmegaConfBaseException:  # a ${hydra:...} value only the Hydra run has: the job checks it
        return
    read_results(out)


def main(args: Sequence[str]) -> int:
    # a sweep's jobs merge their rows into one results table (eval_sparse.write_results)
    return run_hydra(args, "eval_sparse", "kvtransform eval-sparse", job, sweep_shares_out=True, precheck=precheck)
