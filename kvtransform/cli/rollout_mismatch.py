"""``kvtransform rollout-mismatch [MODEL] [key=value ...]``: per-token KL(sparse ‖ dense) and importance weights of
rollouts sampled with SpeContext sparse decode (:mod:`kvtransform.rollout_mismatch`; docs/ROLLOUT_MISMATCH.md), a
Hydra app (``conf/rollout_mismatch.yaml``)."""
from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig

from .errors import console
from .hydra_app import run_hydra

__all__ = ["main"]

_SHOWN = ["head", "budget", "length", "reached", "tokens", "kl_mean", "kl_p99", "w_p1", "w_p50", "w_p99", "w_out",
          "tis_clipped"]


def job(cfg: DictConfig) -> None:
    from ..eval_sparse import markdown
    from ..rollout_mismatch import run_rollout_mismatch

    df = run_rollout_mismatch(cfg)
    console().print(markdown(df[_SHOWN]), soft_wrap=True)  # a markdown table: never wrapped at 80 columns
    console().print(f"[bold]Wrote[/bold] {cfg.out}/results.csv, results.md, tokens.pt")


def precheck(cfg: DictConfig) -> None:
    from ..rollout_mismatch import check_config

    check_config(cfg)


def main(args: Sequence[str]) -> int:
    return run_hydra(args, "rollout_mismatch", "kvtransform rollout-mismatch", job, precheck=precheck)
