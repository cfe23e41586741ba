"""Real long text that every Python installation has: the corpus of the retrieval-head training and of
``kvtransform eval-sparse`` (SpeContext, arXiv 2512.00722 §6 evaluates on long real documents).

The split is **by file**, so no evaluated document shares a file with the training text:

* training (:data:`TRAIN_FILES`): ``pydoc_data/topics.py`` (≈750 KB of the Python reference manual, English) and
  ten standard-library modules (code with English docstrings) plus ``idlelib/NEWS.txt`` (an English changelog);
* evaluation (:data:`EVAL_FILES`): ``argparse.py``, ``difflib.py`` (code + docstrings), ``idlelib/NEWS2x.txt``
  (English) and ``inspect.py``; none of them is read by the training.

Paths are relative to the standard library directory (``sysconfig.get_paths()["stdlib"]``).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = ["TRAIN_FILES", "EVAL_FILES", "stdlib_path", "read_text", "token_chunks"]

TRAIN_FILES = ("pydoc_data/topics.py", "_pydecimal.py", "turtle.py", "typing.py", "pydoc.py", "tarfile.py",
               "zipfile.py", "datetime.py", "subprocess.py", "enum.py", "ast.py", "idlelib/NEWS.txt")
EVAL_FILES = ("argparse.py", "idlelib/NEWS2x.txt", "difflib.py", "inspect.py")


def stdlib_path(rel: str) -> Path:
    """The absolute path of ``rel`` in the running Python's standard library.

    Raises:
        FileNotFoundError: the file is not there (a stripped Python installation); the message names it.
    """
    p = Path(sysconfig.get_paths()["stdlib"]) / rel
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing from this Python installation: choose other documents "
                                f"(documents=[...] with paths relative to {p.parent})")
    return p


def read_text(rel: str) -> str:
    """The text of a standard-library file (``pydoc_data/topics.py``: its topics' documentation joined, without
    the Python quoting), UTF-8."""
    if rel == "pydoc_data/topics.py":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    return stdlib_path(rel).read_text(encoding="utf-8", errors="replace")


def token_chunks(tokenizer, rel: str, length: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` consecutive non-overlapping chunks of exactly ``length`` tokens from the start of ``rel``.

    Returns:
        int64 ``(length,)`` tensors (fewer than ``count`` when the file is short).

    Raises:
        ValueError: the file has fewer than ``length`` tokens (the message gives its length).
    """
    text = read_text(rel)
    ids = tokenizer(text[: 8 * length * count + 4096], return_tensors="pt",
                    add_special_tokens=False)["input_ids"][0]
    n = min(count, ids.numel() // length)
    if n < 1:
        raise ValueError(f"{rel} has {ids.numel()} tokens, fewer than the {length} asked for: choose a longer "
                         f"document or a shorter length")
    return [ids[i * length:(i + 1) * length].clone() for i in range(n)]
