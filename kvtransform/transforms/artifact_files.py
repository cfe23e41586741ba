"""The files of a saved artifact on disk: reading one with a one-line error when it is damaged
(:func:`load_artifact_file`), checking that a directory may receive an artifact (:func:`check_output_dir`: never
replacing what is not one), moving a finished artifact into place (:func:`replace_directory`), and telling a
``config.yaml`` cut short from a complete one (:func:`config_keys`, :func:`check_config_keys`)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from kvtransform.utils import check_writable

__all__ = ["load_artifact_file", "check_output_dir", "replace_directory", "config_keys", "check_config_keys",
           "ARTIFACT_FILES"]


def config_keys(yaml_text: str) -> list:
    """The dotted key paths of a config's YAML text (``["budget", "verify.lengths", ...]``), sorted: what ``save``
    records in ``meta.json`` so that :func:`check_config_keys` can tell a file cut short (it still parses, and the
    missing fields would load as their defaults) from a complete one."""
    def walk(d, prefix):
        for k, v in d.items():
            yield from walk(v, f"{prefix}{k}.") if isinstance(v, dict) and v else (f"{prefix}{k}",)

    data = yaml.safe_load(yaml_text)
    return sorted(walk(data, "")) if isinstance(data, dict) else []


def check_config_keys(file: Path, meta: dict, text: str) -> None:
    """Raises ValueError (one line) when ``text``, the content of ``file`` (an artifact's ``config.yaml``, named in
    the message), lacks a key that ``meta.json``'s ``config_keys`` says was saved. Values may differ (the file may be
    edited); artifacts saved before the keys were recorded are not checked."""
    saved = meta.get("config_keys")
    if saved is None:
        return
    if not isinstance(saved, list) or not all(isinstance(k, str) for k in saved):
        raise ValueError(f"{file.parent / 'meta.json'} is damaged (config_keys is not a list of names): save the "
                         f"artifact again")
    missing = sorted(set(saved) - set(config_keys(text)))
    if missing:
        raise ValueError(f"{file} is damaged ({len(missing)} saved setting(s) missing, e.g. {missing[0]!r}: cut short? "
                         f"they would load as defaults): save the artifact again")


def load_artifact_file(file: Path, load: Callable[[Path], Any], fix: str = "save the artifact again") -> Any:
    """``load(file)`` for one file of a saved artifact (or a training checkpoint); a damaged file (not a zip archive
    where one belongs, truncated, a member whose CRC does not match its bytes or that is missing, not a pickle, not
    JSON) raises ValueError with one line naming the file, the cause and ``fix`` instead of the reader's traceback
    (torch.export's own warning with the traceback is kept off stderr; its cause goes into the line)."""
    logged = _Collect()
    try:
        _check_zip_crcs(file)
        with logged.of("torch.export"):
            return load(file)
    except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, json.JSONDecodeError, UnicodeDecodeError,
            yaml.YAMLError) as e:
        err = e
    except RuntimeError as e:  # torch's zip reader on a damaged archive, torch.export's deserializer
        text = str(e)
        if "zip" not in text.lower() and "PytorchStreamReader" not in text and "deserializ" not in text:
            raise
        err = logged.cause or (RuntimeError("the archive holds no exported program torch.export can read")
                               if "warnings above" in text else e)  # (nothing was logged above)
    why = (str(err).strip().splitlines() or [""])[0][:160]
    raise ValueError(f"{file} is damaged ({type(err).__name__}: {why}): {fix}") from None


class _Collect(logging.Filter):
    """Keeps back the exception records a logger reports while :meth:`of` is active, the first one as ``cause``
    (torch.export logs the deserializer's error with its traceback as a warning, then raises a RuntimeError that
    only says to look above); its other records (e.g. deprecation warnings) pass as usual."""

    def __init__(self):
        super().__init__()
        self.cause: Optional[BaseException] = None

    def filter(self, record):
        if record.exc_info and record.exc_info[1] is not None:
            self.cause = self.cause or record.exc_info[1]
            return False
        return True

    @contextlib.contextmanager
    def of(self, name: str):
        log = logging.getLogger(name)
        log.addFilter(self)
        try:
            yield
        finally:
            log.removeFilter(self)


#: files that are zip archives when whole (``torch.export.save``'s ``.pt2``, ``torch.save``'s ``.pt``)
_ZIP_SUFFIXES = (".pt2", ".pt")


def _check_zip_crcs(file: Path) -> None:
    """For a zip archive (``.pt2``, ``torch.save``'s ``.pt``): every member's CRC-32 against its bytes (one read of
    the file; torch's readers do not check them, so flipped weight bytes loaded as other weights). BadZipFile
    naming the first damaged member, a zip archive's start without its end (truncated: torch's reader says only
    "Invalid argument"), or a ``.pt2`` / ``.pt`` file that is no zip archive; other files are not looked at."""
    if not zipfile.is_zipfile(file):
        with open(file, "rb") as f:
            if f.read(4) == b"PK\x03\x04":
                raise zipfile.BadZipFile("truncated zip archive (no end of central directory)")
        if Path(file).suffix in _ZIP_SUFFIXES:
            raise zipfile.BadZipFile(f"not a zip archive, which every {Path(file).suffix} file is")
        return
    with zipfile.ZipFile(file) as z:
        bad = z.testzip()
    if bad is not None:
        raise zipfile.BadZipFile(f"member {bad} fails its CRC check")


def replace_directory(src: Path, dst: Path) -> None:
    """Rename directory ``src`` to ``dst`` (a path on the same file system). What ``dst`` held (an empty directory,
    or the artifact an ``overwrite`` replaces) is moved aside first, put back if the rename fails, and deleted only
    after it succeeded."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / "x")
    moved = False
    try:
        os.replace(src, dst)
        moved = True
    except BaseException:
        if not moved and not dst.exists():  # (an interrupt right after the rename leaves the new one in place)
            os.replace(old / "x", dst)  # put the previous contents back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


def check_output_dir(path: str | os.PathLike, overwrite: bool) -> Path:
    """Check that an artifact may be written to directory ``path``; returns it as a ``Path``.

    A new or empty directory is fine. An existing artifact (a ``meta.json`` naming its transform, and only the files
    an artifact has: :func:`_not_artifact`) is replaced only with ``overwrite``. Anything else is never replaced. A
    symbolic link is written through: the returned path is the directory it names.

    Raises:
        FileExistsError: ``path`` is empty, a file or inside a file; the current directory or one of its parents; a
            non-empty directory that is not a kvtransform artifact; or an artifact and ``overwrite`` is false.
        PermissionError: the directory that would hold ``path`` (its nearest existing ancestor) is not writable (an
            empty directory made and removed there tells).
        TypeError: ``path`` is not a str or os.PathLike.
        ValueError: ``overwrite`` is not a bool.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the output directory must be a path (str or os.PathLike); got {type(path).__name__}")
    if not isinstance(overwrite, bool):  # (a string such as "false" is truthy: it would replace the artifact)
        raise ValueError(f"overwrite must be True or False; got {overwrite!r}")
    if not str(path).strip():
        raise FileExistsError("the output directory is empty: give a directory path (e.g. out=out/<name>)")
    path = Path(path).expanduser()
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise FileExistsError(f"{str(parent)!r} is a file: the artifact directory {str(path)!r} cannot be inside "
                                  f"it; choose a directory path")
    check_writable(path, "the artifact", "out=...")
    if not path.exists():
        return path
    if not path.is_dir():
        raise FileExistsError(f"{str(path)!r} is a file, not an artifact directory: choose a directory path")
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise FileExistsError(f"{str(path)!r} is the current directory or one of its parents: write the artifact to "
                              f"a new directory (e.g. out/<name>)")
    if not any(path.iterdir()):
        return path
    if not overwrite:
        raise FileExistsError(f"output directory {str(path)!r} exists and is not empty; choose another directory or "
                              f"pass overwrite=True (on the command line: overwrite=true)")
    foreign = _not_artifact(path)
    if foreign:
        raise FileExistsError(f"{str(path)!r} is a non-empty directory but not a kvtransform artifact ({foreign}): "
                              f"overwrite replaces only artifacts; choose another directory")
    return path


#: the files an artifact directory holds (``save`` of every transform, ``kvtransform optimize``'s ``emit``):
#: programs, graph code, configs, reports, the retrieval head, the ONNX file and its external weights
ARTIFACT_FILES = frozenset({"model.pt2", "graph.py", "prefill.pt2", "prefill_shared.pt2", "decode.pt2",
                            "decode_graph.py", "head.pt", "config.yaml", "report.json", "meta.json", "model.onnx",
                            "model.onnx.data"})


def _not_artifact(path: Path) -> str:
    """Why the non-empty directory ``path`` is not a kvtransform artifact ('' when it is one): an artifact has a
    ``meta.json`` naming a registered transform and holds only files of :data:`ARTIFACT_FILES` (hidden files such as
    ``.DS_Store`` aside), no subdirectory (so a project directory that merely holds a ``config.yaml`` or a
    ``meta.json`` is never replaced)."""
    from kvtransform.transforms import registered

    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("transform") not in registered():
        return "no meta.json naming a kvtransform transform"
    other = sorted(p.name for p in path.iterdir()
                   if p.is_dir() or not (p.name in ARTIFACT_FILES or p.name.startswith(".")))
    if other:
        return f"it holds {other[0]!r}" + (f" and {len(other) - 1} more entries" if len(other) > 1 else "") + \
            ", which no artifact has"
    return ""
