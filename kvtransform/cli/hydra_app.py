"""Run a CLI command as a Hydra app composed from ``kvtransform.conf`` (``optimize``, ``eval-sparse``,
``distill-retrieval-head``, ``plan-memory``): ``[MODEL] key=value ... [-m]``, a typo or a bad value first turned into
one ``error:`` line (:func:`.overrides.check_overrides`), the job run under :func:`.errors.guard`."""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from omegaconf import DictConfig

from .errors import UsageError, guard
from .overrides import check_overrides, parse_overrides, split_args, sweep_points

__all__ = ["run_hydra"]

_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--shell-completion", "-sc")


def run_hydra(args: Sequence[str], config_name: str, prog: str, job: Callable[[DictConfig], object],
              sweep_shares_out: bool = False, precheck: Optional[Callable[[DictConfig], object]] = None) -> int:
    """Run ``job(cfg)`` with ``cfg`` composed from ``kvtransform.conf/<config_name>.yaml`` and ``args``.

    ``--cfg job`` prints the composed config resolved (interpolations as the values they will be). Hydra writes no
    run directory, ``.hydra/`` folder or log file: every config sets ``hydra.run.dir=.`` and
    ``output_subdir=null``. A ``-m`` sweep's jobs each get their own ``out`` (:func:`_sweep_out`) unless
    ``sweep_shares_out`` (a command that merges its rows into the ``out`` of earlier runs: ``eval-sparse``).
    ``precheck(cfg)`` (the command's settings check, which its job runs first) runs on each value of a ``-m``
    sweep before the first job, so that a bad value in a later job is named before any job runs and writes.

    Returns:
        0; a user error exits with status 2 after one ``error:`` line.
    """
    import hydra

    argv, overrides, multirun = split_args(args)
    if multirun and not sweep_shares_out and _has_out(config_name):
        argv += _sweep_out(overrides)
    if any(a in ("--cfg", "-c") for a in argv) and "--resolve" not in argv:
        argv.append("--resolve")  # --cfg job shows out as the directory it will be, not ${kvt_slug:...}
    new_parents = []  # the sweep folder's parents this run creates (outputs/multirun): pruned if a sweep fails
    if not any(a in _INFO_FLAGS for a in argv):
        points, every_job = sweep_points(overrides) if multirun else ([overrides], False)
        for num, point in enumerate(points):
            cfg = check_overrides(point, config_name, hydra_node=multirun)
            if multirun and num == 0:
                new_parents = _missing_parents(cfg)
            if multirun and precheck is not None:
                _precheck(precheck, cfg, point, overrides, num if every_job else None)

    sweep_dirs = set()

    @hydra.main(version_base="1.3", config_path="pkg://kvtransform.conf", config_name=config_name)
    def _task(cfg: DictConfig) -> None:
        if multirun:
            from hydra.core.hydra_config import HydraConfig

            sweep_dirs.add(HydraConfig.get().sweep.dir)
        guard(job, cfg)

    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        _task()
    except BaseException:
        for d in sweep_dirs:
            _drop_empty_sweep(d)
        for d in new_parents:  # deepest first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    finally:
        sys.argv = saved
    return 0


def _missing_parents(cfg: DictConfig) -> list:
    """The parents of ``cfg.hydra.sweep.dir`` that do not exist yet, deepest first (none if it cannot be resolved
    before the run)."""
    from pathlib import Path

    try:
        parent = Path(str(cfg.hydra.sweep.dir)).absolute().parent
    except Exception:  # an interpolation only the Hydra run resolves
        return []
    return [p for p in (parent, *parent.parents) if not p.exists()]


def _drop_empty_sweep(sweep_dir: str) -> None:
    """After a failed ``-m`` sweep: remove the empty job folders Hydra made in ``sweep_dir``, and the sweep folder
    itself (its ``multirun.yaml``) when no job left anything in it; a finished job's files stay."""
    from pathlib import Path

    root = Path(sweep_dir)
    if not root.is_dir():
        return
    for sub in root.iterdir():
        if sub.is_dir() and not any(p.is_file() or p.is_symlink() for p in sub.rglob("*")):
            for d in sorted((p for p in sub.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                d.rmdir()
            sub.rmdir()
    rest = [p.name for p in root.iterdir()]
    if rest in ([], ["multirun.yaml"]):
        for name in rest:
            (root / name).unlink()
        root.rmdir()


def _precheck(precheck: Callable[[DictConfig], object], cfg: DictConfig, point: Sequence[str],
              overrides: Sequence[str], job_num: Optional[int]) -> None:
    """``precheck(cfg)`` for one job of a sweep (``cfg`` with its ``hydra`` node, ``job_num`` its job number when
    known); its error as one UsageError line naming the job's swept values. ``${hydra:job.num}`` in a setting
    resolves to the job's number; a setting naming another ``${hydra:...}`` value (one only the Hydra run has) leaves
    the job's check to the job."""
    import re

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    refs = re.findall(r"\$\{hydra:([^}]*)\}", " ".join(o for o in point if o.split("=", 1)[0].lstrip("+~") != "out"))
    if any(r.strip() != "job.num" for r in refs) or (refs and job_num is None):
        return
    with open_dict(cfg):
        cfg.hydra.job.num = job_num if job_num is not None else 0
    HydraConfig.instance().set_config(cfg)
    try:
        precheck(cfg)
    except (UsageError, ValueError, FileNotFoundError) as e:
        swept = [p for p in point if p not in overrides] or list(point)
        raise UsageError(f"{str(e).splitlines()[0] if str(e) else type(e).__name__} (the -m sweep's job with "
                         f"{' '.join(swept)}; no job was run)") from None


def _has_out(config_name: str) -> bool:
    """Whether the command's config has an ``out`` directory (a top-level ``out:`` key)."""
    from importlib.resources import files

    text = files("kvtransform.conf").joinpath(f"{config_name}.yaml").read_text()
    return any(line.startswith("out:") for line in text.splitlines())


def _sweep_out(overrides: Sequence[str]) -> list:
    """A ``-m`` sweep's jobs must not share ``out`` (each would refuse or replace the one before): without an
    ``out=`` override each job writes to its own ``<hydra.sweep.dir>/<job number>``
    (``outputs/multirun/<date_time>/<n>``, a new folder per sweep); an ``out=`` without a per-job part
    (``${hydra:job.num}``, ``${hydra:job.id}``, ``${hydra:job.override_dirname}``) is refused in one line."""
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == "out" and "=" in o]
    if not given:
        return ["out=${hydra:sweep.dir}/${hydra:job.num}"]
    if _one_out_per_job(overrides):
        return []
    if not any(f"${{hydra:job.{k}}}" in given[-1] for k in ("num", "id", "override_dirname")):
        raise UsageError(f"out={given[-1]} is the same directory for every job of the -m sweep: give each its own, "
                         f"e.g. 'out={given[-1]}/${{hydra:job.num}}', or leave out out= "
                         f"(outputs/multirun/<date_time>/<n>)")
    return []


def _one_out_per_job(overrides: Sequence[str]) -> bool:
    """Whether ``out`` is itself the sweep (``out=a,b``, distinct values, no other sweep): one directory per job."""
    from hydra.core.override_parser.types import ChoiceSweep

    parsed = parse_overrides(overrides)
    if parsed is None:
        return False
    sweeps = [o for o in parsed if o.is_sweep_override()]
    if len(sweeps) != 1 or sweeps[0].get_key_element().lstrip("+~") != "out" or \
            not isinstance(sweeps[0].value(), ChoiceSweep):
        return False
    values = list(sweeps[0].sweep_string_iterator())
    return len(set(values)) == len(values)
