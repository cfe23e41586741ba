"""``kvtransform optimize [MODEL] [key=value ...]``: load → transform (capture, rewrite, verify) → report →
transform-specific step (:mod:`.steps`) → save → reload check in a fresh process → optional ONNX.

A Hydra app composed from ``kvtransform.conf`` (``config.yaml`` + groups ``model/`` and ``transform/``) on top of the
structured configs of :mod:`.schema`; see :mod:`kvtransform.cli` for the error conventions.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from ..api import check_available
from ..config import SpeContextConfig, config_from_dict
from ..utils import stage
from .errors import UsageError, console as _console
from .hydra_app import run_hydra
from .schema import EMIT_KINDS
from .steps import step_for

__all__ = ["main", "ArtifactReloadError", "reload_check", "run_optimize"]


class ArtifactReloadError(RuntimeError):
    """The written artifact does not load in a fresh process, or gives other outputs there (the CLI removes it)."""

# process start, near enough: the wall time printed by optimize counts from here; a -m sweep's later jobs count from
# the end of the job before (run_optimize moves it), not from the process start
_T_START = time.perf_counter()


def reload_check(opt, out: Path, tokenizer) -> tuple[float, tuple]:
    """Load the artifact at ``out`` in a fresh Python process and compare its :meth:`probe` outputs with ``opt``'s
    (a user's ``kvt.load`` sees only what importing kvtransform registers). Returns ``(max abs error, shape)``.

    Raises:
        ArtifactReloadError: the reloaded artifact fails to load or gives different outputs; the message carries
            the fresh process's last error line and its first warning (what a ``torch.export.load`` failure names).
    """
    import json
    import subprocess
    import tempfile

    import torch

    inputs = opt.probe_inputs(tokenizer)
    want = opt.probe(inputs).cpu()
    tol = 1e-5 * max(1.0, float(want.double().abs().max())) if want.is_floating_point() else 0.0
    with tempfile.TemporaryDirectory(prefix="kvt-reload-") as tmp:
        probe_file = Path(tmp) / "probe.pt"
        torch.save({"inputs": inputs, "outputs": want, "tolerance": tol}, probe_file)
        proc = subprocess.run([sys.executable, "-m", "kvtransform.cli.reload_child", str(out), str(probe_file)],
                              capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode < 0:
        raise ArtifactReloadError(f"the reload check of {out} was stopped by signal {-proc.returncode} (killed, or out "
                                  f"of memory) before it finished")
    if not lines:
        err_lines = proc.stderr.strip().splitlines() or ["no output"]
        warned = [ln.strip() for ln in err_lines[:-1] if "Warning" in ln or "warn" in ln]
        why = err_lines[-1].strip() + (f" (first warning there: {warned[0]})" if warned else "")
        raise ArtifactReloadError(f"the artifact {out} does not load in a fresh Python process: {why}")
    res = json.loads(lines[-1])
    if proc.returncode != 0:
        raise ArtifactReloadError(f"the artifact reloaded from {out} in a fresh process gives different outputs (max abs "
                           f"error {res['max_abs_error']:.3g}, shape {res['shape']} vs {list(want.shape)})")
    return res["max_abs_error"], tuple(want.shape)


_STAGING_OWNER = "owner"  # "<host> <pid>" of the run that made a staging directory


def _make_staging(out: Path, console) -> Path:
    """A new hidden staging directory beside ``out`` (``.<name>.staging-XXXX``, its owner recorded), after removing
    those that runs on this host left when they were killed (owner process gone; a live or unknown owner's stays)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    for old in out.parent.glob(f".{glob.escape(out.name)}.staging-*"):
        try:
            owner_host, pid = (old / _STAGING_OWNER).read_text().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue  # not made by this code, or its owner file not written yet: leave it
        if owner_host == host and not _process_alive(pid):
            shutil.rmtree(old, ignore_errors=True)
            console.print(f"removed {old}, left by an optimize run that was killed (process {pid})")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    (staging / _STAGING_OWNER).write_text(f"{host} {os.getpid()}")
    return staging


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (POSIX signal 0: nothing is sent; elsewhere always true)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists under another user (EPERM), or cannot be told: treat as alive
    return True


def _emit_kinds(cfg: DictConfig) -> list:
    """``cfg.emit`` as a list, checked (UsageError names the accepted values)."""
    emit = list(cfg.get("emit", ["pt2"]))
    bad = [e for e in emit if e not in EMIT_KINDS]
    if bad or not emit:
        raise UsageError(f"emit={emit}: give a non-empty list of {', '.join(EMIT_KINDS)} (e.g. emit=[pt2,onnx])")
    return emit


def _transform_config(cfg: DictConfig):
    """The transform dataclass, its values validated, and the transform available: all before the model loads."""
    try:
        tcfg = config_from_dict(OmegaConf.to_container(cfg.transform, resolve=True))
    except ValueError as e:
        raise UsageError(f"invalid transform setting: {e}") from None
    check_available(tcfg)  # the error kvt.transform gives, before the model is loaded
    return tcfg


def check_config(cfg: DictConfig) -> tuple:
    """The settings of ``cfg`` checked, without the model or ``out`` (also each job of a ``-m`` sweep, before the
    first runs): ``(transform config, emit list)``.

    Raises:
        UsageError: an invalid transform setting or a transform that is not built, a bad ``emit`` (or ONNX with
            SpeContext), ``threads`` or ``model.dtype``, a ``transform.retrieval`` directory that does not exist, a
            model that does not exist (:func:`kvtransform.models.check_model_source`; not loaded).
    """
    from .generate import check_threads
    from .keyvalue import check_model_dtype

    tcfg = _transform_config(cfg)
    emit = _emit_kinds(cfg)
    if "onnx" in emit and isinstance(tcfg, SpeContextConfig):  # before the model loads (the export would refuse)
        from kvtransform.onnx_export import UnsupportedOpError, refuse_ops

        try:
            refuse_ops(["retrieval_topk", "sparse_decode_attention"])
        except UnsupportedOpError as e:
            raise UsageError(f"emit=[...,onnx] with transform=specontext: {e}; use emit=[pt2]") from None
    check_threads(cfg.threads)
    if isinstance(tcfg, SpeContextConfig):
        from kvtransform.config import check_retrieval

        try:
            check_retrieval([tcfg.head], tcfg.retrieval)
        except FileNotFoundError as e:
            raise UsageError(f"transform.{e}") from None
    check_model_dtype(cfg.model.dtype)
    from ..models import check_model_source

    try:
        check_model_source(str(cfg.model.name))
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"model: {e}") from None
    return tcfg, emit


def run_optimize(cfg: DictConfig) -> dict:
    """The ``optimize`` job: load → transform (captures, rewrites, verifies) → report → save → reload check.

    Args:
        cfg: composed :class:`~kvtransform.cli.schema.OptimizeConfig`.

    Returns:
        timings in seconds: ``startup`` (process start, or the previous job's end in a ``-m`` sweep, to load),
        ``load``, ``transform``, ``demo`` (the step of :mod:`.steps` when it did timed work, e.g. the DualKV demo;
        else 0), ``save``, ``reload``, ``onnx`` (0 unless ``emit`` has ``onnx``), ``total`` (from the same start to
        the end).

    Raises:
        FileExistsError: ``out`` exists and is not empty and ``overwrite`` is false (checked before loading).
        UsageError: an invalid transform config value, a transform that is not built, an ``emit`` list that is
            empty or names something other than ``pt2`` / ``onnx``, or a bad ``threads``; checked before loading.
        ValueError / FileNotFoundError: from :func:`kvtransform.models.load_model` and the transform.
        RuntimeError: the reloaded artifact gives different logits.
    """
    import kvtransform as kvt
    from ..models import load_model
    from ..transforms.artifact_files import check_output_dir, replace_directory

    console = _console()
    tcfg, emit = check_config(cfg)  # the settings first: a bad value is named even when the output exists
    from .generate import choose_threads

    out = check_output_dir(cfg.out, cfg.overwrite)  # before loading the model: never replace what is not an artifact
    import torch

    threads, why = choose_threads(cfg.threads)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        console.print(f"[dim]{threads} CPU thread{'s' if threads > 1 else ''} ({why}; threads=N to change)[/dim]")

    import transformers  # noqa: F401  (imported before the clock starts: startup is reported on its own)

    t0 = time.perf_counter()
    model, tok = load_model(cfg.model.name, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation)
    t1 = time.perf_counter()
    console.print(f"[bold]Loaded[/bold] {cfg.model.name} ({type(model).__name__}, {model.dtype}) in {t1 - t0:.1f} s")

    opt = kvt.transform(model, tcfg, tokenizer=tok)
    t2 = time.perf_counter()
    opt.report.print(console=console)
    demo_s = 0.0
    step = step_for(tcfg)  # a transform-specific step (the DualKV demo), before saving
    if step is not None:
        td = time.perf_counter()
        if step(model, tok, opt, tcfg, console):
            demo_s = time.perf_counter() - td
    t_save = t3 = t4 = t5 = time.perf_counter()
    # everything is written and checked in a staging directory beside `out`, then moved into place (out checked
    # again right before): a failed, killed or interrupted step never replaces or mixes with what `out` held
    staging = _make_staging(out, console)
    staged = staging / out.name
    try:
        if "pt2" in emit:
            with stage(True, f"saving the artifact for {out}"):
                opt.save(str(staged), progress=False)
            t3 = time.perf_counter()
            try:
                with stage(True, "reloading the artifact in a fresh Python process and comparing outputs"):
                    err, shape = reload_check(opt, staged, tok)
            except ArtifactReloadError as e:
                raise ArtifactReloadError(f"{e}; nothing was written to {out} (KVT_DEBUG=1 shows the traceback)") \
                    from e
            t4 = time.perf_counter()
            console.print(f"[bold]Reloaded[/bold] the artifact in a fresh process: same outputs on a {shape} probe "
                          f"(max abs diff {err:.2g})")
        if "onnx" in emit:
            staged.mkdir(exist_ok=True)
            with stage(True, "exporting ONNX and checking it in onnxruntime"):
                opt.export_onnx(staged / "model.onnx", tokenizer=tok, progress=False)
            if "pt2" not in emit:  # what marks `out` as an artifact that overwrite=true may replace
                (staged / "meta.json").write_text(json.dumps({"transform": tcfg.name, "emit": ["onnx"]}, indent=2))
            t5 = time.perf_counter()
        check_output_dir(out, cfg.overwrite)  # again: a run beside this one may have written there meanwhile
        replace_directory(staged, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    t5 = max(t5, t4)
    files = sorted(p.name for p in out.iterdir())
    onnx_note = "; model.onnx is ONNX opset 23 and onnxruntime matches the module on a probe" if "onnx" in emit else ""
    console.print(f"[bold]Saved[/bold] to {out}: {', '.join(files)}{onnx_note}")
    global _T_START
    times = dict(startup=t0 - _T_START, load=t1 - t0, transform=t2 - t1, demo=demo_s, save=t3 - t_save,
                 reload=t4 - t3, onnx=t5 - t4, total=t5 - _T_START)
    _T_START = time.perf_counter()
    demo = f", {tcfg.name} demo {times['demo']:.1f} s" if demo_s else ""
    console.print(
        f"[bold green]Done[/bold green] in {times['total']:.1f} s wall "
        f"(startup/imports {times['startup']:.1f} s, load {times['load']:.1f} s, "
        f"transform+verify {times['transform']:.1f} s{demo}, save {times['save']:.1f} s, "
        f"reload check {times['reload']:.1f} s" + (f", onnx {times['onnx']:.1f} s" if "onnx" in emit else "") + ")"
    )
    return times


def main(args: Sequence[str]) -> int:
    """``kvtransform optimize [MODEL] [key=value ...] [--cfg job] [--help]``."""
    return run_hydra(args, "config", "kvtransform optimize", run_optimize, precheck=check_config)

