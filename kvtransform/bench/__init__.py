"""``kvtransform bench SUITE [overrides...] [-m]``: Hydra-composed benchmark suites.

:func:`run` composes the suite's structured config (``kvtransform.bench.config``) with Hydra's compose API, so a
misspelt key or a bad value is a composition error raised before anything runs. With ``-m``/``--multirun`` every
sweep override (``P=5059,8192``, ``mb=4,8``, ``method=fa2,dualkv``, ``range(...)``, ``choice(...)``) is expanded
by Hydra's own override parser and basic sweeper into the cartesian product of jobs; all jobs run in this process
(baselines measured in the same run) and land in one long-format CSV plus a markdown table and a PNG plot in
``out_dir``. Each CSV row carries the command that reproduces it.

Suites: ``dualkv-layer`` and ``dualkv-attn`` (DualKV, arXiv 2605.15422; runner :mod:`.runner`, methods
:mod:`.methods`, masks :mod:`.masks`, test layer :mod:`.layer`) and ``decode-ops`` (SpeContext, arXiv 2512.00722;
runner :mod:`.decode_ops`) and ``decode`` (end-to-end decode throughput, SpeContext Table 5; runner :mod:`.decode`) and
``tree-attn`` / ``tree-layer`` (prefix-tree attention on agentic trees, Tree Training arXiv 2511.00413; runner
:mod:`.tree_runner`, configs :mod:`.tree_config`, shapes :mod:`.tree_shapes`, methods :mod:`.tree_methods`).
One timing loop (:mod:`.timing`), one CSV format (:mod:`.report`). Where a benchmark goes
in the package: ``docs/ARCHITECTURE.md``.

Example (on a GPU)::

    kvtransform bench dualkv-layer -m P=5059,8192,16384,32768 mb=4,8,16 out_dir=benchmarks/dualkv_layer
    kvtransform bench dualkv-layer P=8192 mb=8 method=dualkv
    kvtransform bench dualkv-attn -m P=4096,8192 mb=8,16 kernel_check=true tune=true
    kvtransform bench decode-ops -m S=4096,16384,32768 kernel_check=true tune=small retrieval_tune=true
    kvtransform bench decode -m model=llama-8b,qwen3-8b input=2048 output=16384,32768
    kvtransform bench tree-attn -m prompt=4096 fanout=4x2x2,4x2x2x2 turn_min=256 turn_max=2048 kernel_check=true
    kvtransform bench tree-attn shape=one_level P=8192 mb=16
    kvtransform bench tree-layer fanout=4x2x2
"""
from __future__ import annotations

import datetime as _dt
import os
import shlex
import subprocess
import sys
from typing import List, Optional

__all__ = ["run", "compose_jobs", "SUITES"]

SUITES = ("dualkv-layer", "dualkv-attn", "decode-ops", "decode", "tree-attn", "tree-layer")

_FLAGS_MULTIRUN = ("-m", "--multirun")


def git_commit() -> str:
    """Short commit of the checkout benchmarks run from (``$KVT_COMMIT`` wins: the device copy has no ``.git``)."""
    env = os.environ.get("KVT_COMMIT")
    if env:
        return env
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def compose_jobs(suite: str, overrides: List[str], multirun: bool = False) -> list:
    """Compose every job of a (possibly sweeping) command line.

    Args:
        suite: a name in :data:`SUITES`.
        overrides: Hydra override strings (``key=value``, ``key=a,b`` with ``multirun``).
        multirun: expand sweep overrides into the cartesian product of jobs.

    Returns:
        list of ``(job_overrides: list[str], cfg: DictConfig)``, one per job, in sweep order.

    Raises:
        ValueError: unknown suite, a sweep override without ``multirun``, or a value out of range in any job
            (:func:`kvtransform.bench.config.validate`: ``P``/``mb``/``r_min``/``r_max`` >= 1, ``r_min <= r_max``, ...).
        hydra.errors.ConfigCompositionException / OverrideParseException: unknown key, bad value, bad syntax.
    """
    from hydra import compose, initialize
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from . import config as _config  # registers the suites in the ConfigStore

    if suite not in _config.SUITES:
        raise ValueError(f"unknown benchmark suite {suite!r}; suites: {', '.join(_config.SUITES)}")
    parsed = OverridesParser.create().parse_overrides(overrides)
    import dataclasses
    import difflib

    from hydra.errors import ConfigCompositionException

    keys = [f.name for f in dataclasses.fields(_config.SUITES[suite])]
    for o in parsed:
        key = o.get_key_element().lstrip("+~").split(".")[0]
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigCompositionException(f"unknown key {key!r} for suite {suite}{hint}; keys: {', '.join(keys)}")
    hydra_refs = [o.input_line for o in parsed if "${hydra:" in o.input_line]
    if hydra_refs:  # (it would fail at the first read of the value, as "HydraConfig was not set")
        raise ValueError(f"{hydra_refs[0]}: bench composes its jobs itself, without a Hydra run, so ${{hydra:...}} "
                         f"has no value here; drop it (every job of a bench sweep adds its rows to the one out_dir)")
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    odd = [o.input_line for o in parsed
           if o.is_sweep_override() and not isinstance(o.value(), (ChoiceSweep, RangeSweep))]
    if odd:  # glob() needs config groups (a suite has none), interval() a sweeper plugin
        raise ValueError(f"{odd[0]}: bench sweeps take a list of values (key=a,b) or range(start,stop[,step])")
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps and not multirun:
        raise ValueError(f"sweep override(s) {sweeps} need -m/--multirun")
    batches = BasicSweeper.split_arguments(parsed, None)[0] if parsed else [[]]

    def _compose_all():
        try:
            return [(list(b), compose(config_name=suite, overrides=list(b))) for b in batches]
        except ConfigCompositionException as e:  # say why (bad value, valid choices), not only which override
            cause = str(e.__cause__).splitlines()[0] if e.__cause__ else ""
            key = getattr(e.__cause__, "full_key", None)
            if key and cause:  # "invalid value for 'P': Value 'abc' of type 'str' could not be converted to Integer"
                raise ConfigCompositionException(f"invalid value for {key!r}: {cause}") from e
            raise ConfigCompositionException(f"{e}: {cause}" if cause else str(e)) from e

    if GlobalHydra.instance().is_initialized():
        jobs = _compose_all()
    else:
        with initialize(version_base=None, config_path=None):
            jobs = _compose_all()
    for ov, cfg in jobs:  # every job's values, before any job runs
        try:
            _config.validate(cfg)
        except ValueError as e:
            where = f" (job {' '.join(ov)})" if len(jobs) > 1 else ""
            raise ValueError(f"bad benchmark setting{where}: {e}") from None
    return jobs


def repro_command(suite: str, job_overrides: List[str], method: Optional[str] = None) -> str:
    """The shell command that reruns one row: the job's overrides, ``method`` pinned, ``out_dir``/``append`` left
    to the user."""
    keep = [o for o in job_overrides if o.split("=", 1)[0].lstrip("+~") not in ("method", "out_dir", "append")]
    if method:
        keep.append(f"method={method}")
    return "kvtransform bench " + " ".join([suite] + [shlex.quote(o) for o in keep])


def run(suite: str, argv: List[str]) -> list:
    """Entry point of ``kvtransform bench SUITE [overrides...] [-m]``.

    Args:
        suite: one of :data:`SUITES`.
        argv: Hydra overrides, plus ``-m``/``--multirun`` to sweep, ``--cfg`` to print the composed config(s) and
            stop, ``-h``/``--help``.

    Returns:
        the CSV rows written (list of dicts); also writes ``results.csv``, ``results.md`` and ``results.png`` under
        each job's ``out_dir`` (the last job's ``out_dir`` when jobs differ), and prints the markdown table last.

    Raises:
        RuntimeError: after writing everything, when a ``kernel_check`` row failed.
    """
    from omegaconf import OmegaConf

    from kvtransform.utils import check_results_dir

    from . import report
    from .device import resolve_device

    if suite not in SUITES:  # (before --help, which would look the name up)
        raise ValueError(f"unknown benchmark suite {suite!r}; suites: {', '.join(SUITES)}")
    if suite == "decode-ops":
        from .decode_ops import run_job
    elif suite == "decode":
        from .decode import run_job
    elif suite in ("tree-attn", "tree-layer"):
        from .tree_runner import run_job
    else:
        from .runner import run_job
    from .runner import clear_check_reference

    clear_check_reference()
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(suite_help(suite))
        return []
    multirun = any(a in _FLAGS_MULTIRUN for a in argv)
    show_cfg = "--cfg" in argv
    overrides = [a for a in argv if a not in _FLAGS_MULTIRUN and a != "--cfg"]
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        raise ValueError(f"unknown flag(s) {unknown}; use -m/--multirun, --cfg, -h")
    jobs = compose_jobs(suite, overrides, multirun)
    if show_cfg:
        for ov, cfg in jobs:
            print(f"# {' '.join(ov)}\n{OmegaConf.to_yaml(cfg)}")
        return []

    import torch

    for ov, cfg in jobs:  # a device that is not there, an out_dir that cannot be written: before the first job
        if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={cfg.device} but CUDA is not available here; use device=cpu or device=auto")
        check_results_dir(cfg.out_dir, "out_dir")
    commit = git_commit()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    all_rows, by_dir = [], {}
    print(f"kvtransform bench {suite}: {len(jobs)} job(s), commit {commit}, torch {torch.__version__}", flush=True)
    for i, (ov, cfg) in enumerate(jobs):
        dev = resolve_device(cfg)
        dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        print(f"[job {i + 1}/{len(jobs)}] {' '.join(ov) or '(defaults)'}", flush=True)

        def on_row(r, ov=ov, cfg=cfg, dev_name=dev_name):
            r.update(suite=suite, device=dev_name, commit=commit, torch=torch.__version__,
                     dtype=cfg.dtype.value if hasattr(cfg.dtype, "value") else str(cfg.dtype), timestamp=stamp,
                     cmd=repro_command(suite, ov, r["method"]))
            print("  " + report.row_line(r), flush=True)

        out_dir = str(cfg.out_dir)
        if out_dir not in by_dir:  # rows already in out_dir survive only with append=true
            old = os.path.join(out_dir, "results.csv")
            prior = report.read_csv(old).to_dict("records") if cfg.append and os.path.exists(old) else []
            by_dir[out_dir] = {"prior": prior, "rows": [], "plot": False}
        rows = run_job(cfg, on_row)
        all_rows += rows
        d = by_dir[out_dir]
        d["rows"] += rows
        d["plot"] = d["plot"] or bool(cfg.plot)
        # written after every job, so a run cut short still leaves its finished rows
        d["paths"] = report.write_all(d["prior"] + d["rows"], out_dir, append=False, plot=False)
    for out_dir, d in by_dir.items():
        if d["plot"]:
            d["paths"] = report.write_all(d["prior"] + d["rows"], out_dir, append=False, plot=True)
        print("wrote " + ", ".join(d["paths"]), flush=True)
        print(report.markdown(report.read_csv(d["paths"][0])), flush=True)
    failed = [r for r in all_rows if str(r.get("pass", "")).startswith("check") and r.get("status") != "ok"]
    if failed:
        raise RuntimeError(f"kernel checks failed: {', '.join(r['method'] + ' ' + r['impl'] for r in failed)}")
    return all_rows


def suite_help(suite: str) -> str:
    """``kvtransform bench SUITE --help``: what every key of the suite means (its config's docstring, as plain text),
    the choices of each enumerated key, and the defaults."""
    import dataclasses
    import inspect
    import re
    from enum import Enum

    from omegaconf import OmegaConf

    from . import config as _config

    cls = _config.SUITES[suite]
    doc = inspect.getdoc(cls) or ""
    doc = re.sub(r":\w+:`~?\.?([^`]+)`", r"\1", doc).replace("``", "`")
    choices = [f"  {f.name}: {', '.join(str(e.value) for e in type(f.default))}" for f in dataclasses.fields(cls)
               if isinstance(f.default, Enum)]
    return "\n".join([f"kvtransform bench {suite} [key=value ...] [-m]   (-m: sweep comma lists, e.g. method=a,b)", "",
                      doc, "", "Choices:", *choices, "", "Defaults:",
                      OmegaConf.to_yaml(OmegaConf.structured(cls)).rstrip()])


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m kvtransform.bench SUITE [overrides...] [-m]`` (the same as ``kvtransform bench``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print("suites: " + ", ".join(SUITES))
        return 0
    try:
        run(argv[0], argv[1:])
    except Exception as e:  # bad input: one line and exit status 2, as ``kvtransform bench`` does
        if os.environ.get("KVT_DEBUG") or not (isinstance(e, ValueError)
                                               or (type(e).__module__ or "").startswith(("hydra", "omegaconf"))):
            raise
        from hydra.errors import OverrideParseException

        text = (str(e).strip() or type(e).__name__).splitlines()[0]
        print(f"error: {'bad override syntax: ' if isinstance(e, OverrideParseException) else ''}{text}",
              file=sys.stderr)
        return 2
    return 0
