"""Run a CLI command as a Hydra app composed from ``kvtransform.conf`` (``optimize``, ``eval-sparse``,
``distill-retrieval-head``, ``plan-memory``): ``[MODEL] key=value ... [-m]``, a typo or a bad value first turned into
one ``error:`` line (:func:`.overrides.check_overrides`), the job run under :func:`.errors.guard`."""
from __future__ import annotations

import sys
from typing import Callable, Sequence

from omegaconf import DictConfig

from .errors import guard
from .overrides import check_overrides, split_args

__all__ = ["run_hydra"]

_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--shell-completion", "-sc")


def run_hydra(args: Sequence[str], config_name: str, prog: str, job: Callable[[DictConfig], object]) -> int:
    """Run ``job(cfg)`` with ``cfg`` composed from ``kvtransform.conf/<config_name>.yaml`` and ``args``.

    ``--cfg job`` prints the composed config resolved (interpolations as the values they will be). Hydra writes no
    run directory, ``.hydra/`` folder or log file: every config sets ``hydra.run.dir=.`` and
    ``output_subdir=null``.

    Returns:
        0; a user error exits with status 2 after one ``error:`` line.
    """
    import hydra

    argv, overrides, multirun = split_args(args)
    if any(a in ("--cfg", "-c") for a in argv) and "--resolve" not in argv:
        argv.append("--resolve")  # --cfg job shows out as the directory it will be, not ${kvt_slug:...}
    if not multirun and not any(a in _INFO_FLAGS for a in argv):
        check_overrides(overrides, config_name)

    @hydra.main(version_base="1.3", config_path="pkg://kvtransform.conf", config_name=config_name)
    def _task(cfg: DictConfig) -> None:
        guard(job, cfg)

    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        _task()
    finally:
        sys.argv = saved
    return 0
