"""The real-text corpus of the retrieval-head training and of ``eval-sparse`` (kvtransform/textdata.py): the
train/eval split by file, the held-out kind, HTML read as text, chunking."""
from __future__ import annotations

import re
import sys

import pytest
import torch

from kvtransform.textdata import (EVAL_FILES, HELDOUT_KIND, TRAIN_FILES, html_text, read_text, stdlib_corpus,
                                  stdlib_path, token_chunks)


def test_split_by_file_and_the_held_out_kind():
    assert not set(TRAIN_FILES) & set(EVAL_FILES)
    assert set(HELDOUT_KIND) <= set(EVAL_FILES) and not set(HELDOUT_KIND) & set(TRAIN_FILES)
    # no training file is a license: the held-out kind (legal English) stays unseen
    assert not [f for f in TRAIN_FILES if "licen" in f.lower()]
    for f in TRAIN_FILES + EVAL_FILES:
        if f == "idlelib/NEWS2x.txt" and sys.version_info >= (3, 12):
            continue                                   # removed from CPython 3.12
        assert len(read_text(f)) > 8000, f             # every file is there and long enough for a 2048-token chunk


def test_the_broad_corpus_keeps_the_split_and_the_held_out_kind_unseen():
    """files=[stdlib] (distill): every long standard-library text file, never an evaluation file, a test, a codec
    table or legal text (the held-out kind), each long enough for a training chunk; named files come once."""
    from kvtransform.distill import DistillConfig, _training_files

    corpus = stdlib_corpus()
    assert len(corpus) >= 50 and corpus[-1] == "pydoc_data/topics.py" and len(set(corpus)) == len(corpus)
    assert not set(corpus) & set(EVAL_FILES)
    assert not [f for f in corpus if "licen" in f.lower() or "/test" in "/" + f or f.startswith("encodings/")]
    assert not [f for f in corpus if "Permission is hereby granted" in read_text(f)]
    assert {"typing.py", "ast.py"} <= set(corpus)
    files, from_corpus = _training_files(DistillConfig(files=["typing.py", "stdlib", "argparse.py"]))
    assert files[0] == "typing.py" and files.count("typing.py") == 1 and files[-1] == "argparse.py"
    assert set(from_corpus) == set(corpus) and len(files) == len(corpus) + 1


def test_html_is_read_as_text():
    page = ("<!DOCTYPE html><html><head><title>T</title><style>p {}</style></head><body>"
            "<script>var x = '<p>';</script><h1>Menus&#182;</h1>\n\n\n\n<p>Cut &amp; paste  \nhere</p></body></html>")
    assert html_text(page) == "Menus\u00b6\n\nCut & paste\nhere\n"
    text = read_text("idlelib/help.html")
    assert not re.search(r"</?(p|div|span|a|dl|dt|dd|li|ul|h1|meta|link)[ >]", text) and "IDLE" in text
    assert len(text) < 0.7 * len(stdlib_path("idlelib/help.html").read_text(encoding="utf-8"))


class _WordTokenizer:
    def __call__(self, text, return_tensors, add_special_tokens):
        return {"input_ids": torch.arange(len(text.split()))[None]}


def test_token_chunks_and_a_short_file():
    chunks = token_chunks(_WordTokenizer(), "email/architecture.rst", 100, 3)
    assert [c.tolist() for c in chunks] == [list(range(i * 100, (i + 1) * 100)) for i in range(3)]
    with pytest.raises(ValueError, match="fewer than the 1000000 asked for"):
        token_chunks(_WordTokenizer(), "LICENSE.txt", 1_000_000, 1)
    with pytest.raises(FileNotFoundError, match="missing from this Python installation"):
        stdlib_path("no/such/file.txt")
