"""Small helpers shared by the transforms, the verification gate and the CLI (progress stages, consoles, devices,
names, output paths, atomic file writes)."""
from __future__ import annotations

import contextlib
import numbers
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

#: Width of a console whose stream is not a terminal (output redirected to a file or a pipe): wide enough that no
#: table or line of ours wraps, where rich's default of 80 columns cut tables mid-cell.
REDIRECTED_WIDTH = 400
LOG_EVERY_S = 5.0  # redirected output: the shortest gap between two progress lines of one stage


def is_count(v, low: int = 0, high: "int | None" = None, numpy: bool = False) -> bool:
    """``v`` is a Python ``int`` (not a bool; with ``numpy``, a NumPy integer too) with ``low <= v`` and, when
    ``high`` is given, ``v <= high``. Values that are written to YAML or JSON (configs, artifacts) must be Python
    ints: OmegaConf and ``json`` refuse NumPy's."""
    kind = numbers.Integral if numpy else int
    return not isinstance(v, bool) and isinstance(v, kind) and v >= low and (high is None or v <= high)


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """An integer torch dtype (token ids, offsets): not floating point, complex or bool."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_device(device, available: bool = False, auto: bool = False) -> None:
    """A ``device=`` setting: ``cpu`` or ``cuda[:N]``, and ``auto`` where the command takes it (with ``available``,
    also that torch sees a CUDA device).

    Raises:
        ValueError: one line naming the fix.
    """
    if auto and device == "auto":
        return
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda") or \
            (":" in device and not (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device must be {'auto, ' if auto else ''}cpu or cuda[:N]; got {device!r}")
    if available and device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device} but torch sees no CUDA device: use device=cpu")


def console(stderr: bool = False):
    """The one way kvtransform makes a rich console: on a terminal, its width; redirected (not a terminal and no
    ``COLUMNS`` in the environment), :data:`REDIRECTED_WIDTH` columns, so tables and lines keep their shape in a
    log file."""
    from rich.console import Console

    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(stderr=stderr, highlight=False, width=REDIRECTED_WIDTH)
    return c


def _unwritable(path: Path) -> tuple:
    """``(holder, why)``: the nearest existing ancestor of ``path`` (its parent once ``path`` exists) and why a
    directory cannot be made there (None: it can). A real probe: root passes ``os.access`` on read-only mounts and
    on /proc or /sys, so an empty directory is made and removed."""
    holder = path.parent
    while not holder.exists() and holder != holder.parent:
        holder = holder.parent
    why = None if os.access(holder, os.W_OK | os.X_OK) else "permission denied"
    if why is None:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".kvt-write-probe-", dir=holder))
        except OSError as e:
            why = e.strerror or type(e).__name__
    return holder, why


def check_writable(path: Path, what: str, key: str) -> None:
    """Raise ``PermissionError`` unless directory ``path`` can be made or replaced: its nearest existing ancestor
    (the parent once ``path`` exists: a replaced directory is renamed inside it) is writable and searchable.
    ``what`` / ``key`` name the output and the setting that chooses it in the message (``"the artifact"``,
    ``"out=..."``)."""
    holder, why = _unwritable(path)
    if why is not None:
        raise PermissionError(f"cannot write {what} {str(path)!r}: {str(holder)!r} is not writable ({why}); "
                              f"choose an output directory you can write to ({key})")


def check_results_dir(out, key: str = "out") -> None:
    """ValueError (one line) unless ``out`` is, or can become, a directory this process writes results into (a
    benchmark's or an evaluation's CSV, markdown, plot): not a file, not inside one, writable (probed). Checked
    before a long run, which must not fail at its end on its output path; nothing is created. ``key``: the setting
    that names it (``out``, ``out_dir``)."""
    if out is None or not str(out).strip():  # (Path("") is the current directory: reported as "/results.csv")
        raise ValueError(f"{key} is empty: give the directory for the results, e.g. {key}=outputs/results")
    path = Path(str(out)).expanduser().absolute()
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ValueError(f"{key}={out} cannot be written ({p} is a file): choose another {key}=<directory>")
    holder, why = _unwritable(path / "results" if path.is_dir() else path)
    if why is not None:
        raise ValueError(f"{key}={out} cannot be written ({holder} is not writable: {why}): choose another "
                         f"{key}=<directory>")


def _read_umask() -> int:
    """The process umask, read once at import (reading it means setting it, which is not thread-safe later)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: the permission bits a new file or directory of this process does not get (what ``mkstemp``/``mkdtemp`` files
#: are opened up to: ``0o666 & ~UMASK`` for files, ``0o777 & ~UMASK`` for directories)
UMASK = _read_umask()


def check_free_space(path: Path, need: int, key: str = "out", what: str = "the weights") -> None:
    """OSError (one line) when the file system that would hold directory ``path`` (its nearest existing ancestor)
    has less than ``need`` bytes free plus 64 MiB: checked before writing, since torch's archive writer
    (``torch.save``, ``torch.export.save``) aborts the whole process (SIGABRT) when a write fails on a full disk.
    ``key``: the setting that chooses ``path`` (named in the fix); ``what``: what the ``need`` bytes are."""
    where = next(p for p in (Path(path), *Path(path).parents) if p.exists())
    free = shutil.disk_usage(where).free
    if free < need + (64 << 20):
        raise OSError(f"saving to {str(path)!r} needs at least {(need >> 20) + 64} MiB ({what} and 64 MiB of "
                      f"room) and {str(where)!r} has {free >> 20} MiB free: free some space or choose {key}= on "
                      f"another disk")


@contextlib.contextmanager
def atomic_write(path):
    """Yield a temporary path beside file ``path`` for the block to write; when the block ends normally it is
    synced and renamed onto ``path`` (``os.replace``), so ``path`` is the old file or the whole new one, never a
    part (a run killed while writing leaves it as it was). An exception in the block removes the temporary file.
    The temporary name keeps ``path``'s extension (writers that infer the format from it, as matplotlib's
    ``savefig``, see the same one); the file gets a new file's mode (the umask), not ``mkstemp``'s 0600.

    Raises:
        OSError: the directory cannot be written, or ``path`` is a directory (from the rename).
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def rename_keys(text: str, names: dict) -> str:
    """``text`` (an error message naming ``SpeContextConfig``'s keys bare, ``retrieval=``, or as the optimize and
    generate commands spell them, ``transform.retrieval=``) with each ``KEY=`` of ``names`` written ``names[KEY]=``:
    the key as the caller's own config spells it (TRL's ``rollout_retrieval=``, eval-sparse's ``retrieval=``)."""
    import re

    for key, new in names.items():
        text = re.sub(rf"(?<![\w.-])(?:transform\.)?{re.escape(key)}=", f"{new}=", text)
    return text


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the KV-cache argument of a Hugging Face model's ``forward`` (and ``generate``): ``cache``
    (transformers >= 5.2x, where ``past_key_values`` is deprecated) or ``past_key_values`` (older 5.x)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); CPU for a module with neither."""
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def model_name(model) -> str:
    """The model's hub id / directory (``config._name_or_path``), else its class name."""
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
               or type(model).__name__)


class _Live:
    """What :func:`stage` yields on a terminal: ``update(text)`` changes the line beside the spinner and clock."""

    def __init__(self, progress, task):
        self._progress, self._task = progress, task

    def update(self, text: str) -> None:
        self._progress.update(self._task, description=text)


class _Logged:
    """What :func:`stage` yields when stderr is not a terminal: ``update(text)`` prints the new step with the seconds
    since the stage began, at most one line per :data:`LOG_EVERY_S` (a log shows where a long wait is, not every
    quick step)."""

    def __init__(self, con, t0: float):
        self._console, self._t0, self._last = con, t0, t0

    def update(self, text: str) -> None:
        now = time.perf_counter()
        if now - self._last >= LOG_EVERY_S:
            self._console.print(f"[dim]… {text} ({now - self._t0:.0f} s in)[/dim]")
            self._last = now


@contextlib.contextmanager
def stage(progress: bool, text: str):
    """Show what runs while the block runs, then ``✓ text (N s)`` on stderr.

    On a terminal: a spinner with ``text`` and the elapsed time, live; redirected: ``… text`` once when the block
    starts (a log shows what a long wait is). Yields an object whose ``update(text)`` says what runs now, or None
    when ``progress`` is false."""
    if not progress:
        yield None
        return
    con = console(stderr=True)
    t0 = time.perf_counter()
    if con.is_terminal:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=con,
                      transient=True) as bar:
            yield _Live(bar, bar.add_task(text, total=None))
    else:
        con.print(f"[dim]… {text}[/dim]")
        yield _Logged(con, t0)
    con.print(f"[dim]✓ {text} ({time.perf_counter() - t0:.1f} s)[/dim]")


@contextlib.contextmanager
def timed(timings: dict, key: str):
    """Record the block's wall time in seconds (3 decimals) as ``timings[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = round(time.perf_counter() - t0, 3)
