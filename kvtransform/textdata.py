"""Real long text that every Python installation has: the corpus of the retrieval-head training and of
``kvtransform eval-sparse`` (SpeContext, arXiv 2512.00722 §6 evaluates on long real documents).

The split is **by file**, so no evaluated document shares a file with the training text, and the evaluation
holds out one **kind** of text the training never sees:

* training (:data:`TRAIN_FILES`), three kinds: Python code with English docstrings (ten standard-library
  modules), English technical prose (``pydoc_data/topics.py``, ≈750 KB of the Python reference manual;
  ``idlelib/help.html``, the IDLE user manual, read as text; ``email/architecture.rst`` and the IDLE
  ``README.txt``, ``HISTORY.txt``, ``TODO.txt``, ``idle_test/README.txt``) and an English changelog
  (``idlelib/NEWS.txt``);
* evaluation (:data:`EVAL_FILES`): ``argparse.py``, ``difflib.py``, ``inspect.py`` (code + docstrings),
  ``idlelib/NEWS2x.txt`` (changelog; CPython ≤ 3.11 only), and the held-out kind, **legal English**:
  ``LICENSE.txt`` (the history of Python and its licenses, ≈3.8K tokens, so it is evaluated with a
  ``prefix`` of 3072 tokens). No training file is a license: legal text is the kind the training never sees
  (:data:`HELDOUT_KIND`).

Paths are relative to the standard library directory (``sysconfig.get_paths()["stdlib"]``). ``.html`` files are
read as their text (tags, ``<head>``, scripts and styles dropped; character references decoded).
"""
from __future__ import annotations

import re
import sysconfig
from html.parser import HTMLParser
from pathlib import Path

import torch

__all__ = ["TRAIN_FILES", "EVAL_FILES", "HELDOUT_KIND", "STDLIB_CORPUS", "stdlib_corpus", "stdlib_path", "read_text",
           "html_text", "token_chunks"]

TRAIN_FILES = ("pydoc_data/topics.py", "_pydecimal.py", "turtle.py", "typing.py", "pydoc.py", "tarfile.py",
               "zipfile.py", "datetime.py", "subprocess.py", "enum.py", "ast.py", "idlelib/NEWS.txt",
               "idlelib/help.html", "email/architecture.rst", "idlelib/README.txt", "idlelib/HISTORY.txt",
               "idlelib/TODO.txt", "idlelib/idle_test/README.txt")
EVAL_FILES = ("argparse.py", "idlelib/NEWS2x.txt", "difflib.py", "inspect.py", "LICENSE.txt")
HELDOUT_KIND = {"LICENSE.txt": "legal English (license terms and the software's history), never trained on"}
#: the entry of a ``files`` list that stands for :func:`stdlib_corpus` (``distill-retrieval-head 'files=[stdlib]'``)
STDLIB_CORPUS = "stdlib"
_CORPUS_SKIP_DIRS = ("test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__",
                     "ensurepip", "encodings")
_LEGAL = ("Permission is hereby granted", "LICENSE AGREEMENT", "THE SOFTWARE IS PROVIDED", "WITHOUT WARRANTY",
          "Licensed under the Apache")


def stdlib_corpus(min_code_bytes: int = 30_000, min_prose_bytes: int = 10_000) -> list[str]:
    """The broad training corpus: every standard-library ``.py`` file of at least ``min_code_bytes`` and ``.txt`` /
    ``.rst`` / ``.html`` file of at least ``min_prose_bytes``, sorted, then ``pydoc_data/topics.py``; without the
    evaluation files (:data:`EVAL_FILES`), tests, codec tables (``encodings/``), generated ``_sysconfigdata*``,
    and any file whose name or text is legal (a license: the held-out kind, :data:`HELDOUT_KIND`). ~80–110 files
    (≈7 MB) on CPython 3.11/3.12; the list depends on the running Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        name = rel.as_posix()
        if p.suffix not in (".py", ".txt", ".rst", ".html") or not p.is_file() or name in EVAL_FILES or \
                any(x in _CORPUS_SKIP_DIRS or x.startswith("config-") for x in rel.parts[:-1]) or \
                name.startswith("_sysconfigdata") or "licen" in name.lower() or "copying" in name.lower() or \
                name == "pydoc_data/topics.py":
            continue
        if p.stat().st_size < (min_code_bytes if p.suffix == ".py" else min_prose_bytes):
            continue
        if any(x in p.read_text(encoding="utf-8", errors="replace") for x in _LEGAL):
            continue
        out.append(name)
    return out + ["pydoc_data/topics.py"]


class _TextOnly(HTMLParser):
    _SKIP = ("head", "script", "style")

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.skip = [], 0

    def handle_starttag(self, tag, attrs):
        self.skip += tag in self._SKIP

    def handle_endtag(self, tag):
        self.skip -= tag in self._SKIP and self.skip > 0

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def html_text(html: str) -> str:
    """The text of an HTML page: the data outside ``<head>``, ``<script>`` and ``<style>``, character references
    decoded, trailing blanks removed and runs of blank lines collapsed to one."""
    p = _TextOnly()
    p.feed(html)
    p.close()
    text = re.sub(r"[ \t]+\n", "\n", "".join(p.parts))
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def stdlib_path(rel: str, key: str = "documents") -> Path:
    """The absolute path of ``rel`` in the running Python's standard library (``key``: the setting that listed it,
    named in the error).

    Raises:
        FileNotFoundError: the file is not there (a stripped Python installation); the message names it.
    """
    p = Path(sysconfig.get_paths()["stdlib"]) / rel
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing from this Python installation: choose other documents "
                                f"({key}=[...] with paths relative to {p.parent})")
    return p


def read_text(rel: str) -> str:
    """The text of a standard-library file (``pydoc_data/topics.py``: its topics' documentation joined, without
    the Python quoting; ``.html``: :func:`html_text`), UTF-8."""
    if rel == "pydoc_data/topics.py":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    text = stdlib_path(rel).read_text(encoding="utf-8", errors="replace")
    return html_text(text) if rel.lower().endswith((".html", ".htm")) else text


def token_chunks(tokenizer, rel: str, length: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` consecutive non-overlapping chunks of exactly ``length`` tokens from the start of ``rel``.

    Returns:
        int64 ``(length,)`` tensors (fewer than ``count`` when the file is short).

    Raises:
        ValueError: no ``tokenizer`` (a model directory saved without one), or the file has fewer than ``length``
            tokens (the message gives its length).
    """
    if tokenizer is None:
        raise ValueError("the model has no tokenizer, and these documents are real text: save one beside the model "
                         "(tokenizer.save_pretrained(dir)) or load a model that has one")
    text = read_text(rel)
    ids = tokenizer(text[: 8 * length * count + 4096], return_tensors="pt",
                    add_special_tokens=False)["input_ids"][0]
    n = min(count, ids.numel() // length)
    if n < 1:
        raise ValueError(f"{rel} has {ids.numel()} tokens, fewer than the {length} asked for: choose a longer "
                         f"document or a shorter length")
    return [ids[i * length:(i + 1) * length].clone() for i in range(n)]
