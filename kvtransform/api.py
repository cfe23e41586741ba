"""The Python API: ``transform``, ``inspect`` and ``load``.

``transform(model, config)`` resolves ``config`` to its dataclass and calls the handler registered for that config
type in :mod:`kvtransform.transforms` (torchao's ``quantize_(model, config)`` pattern): capture, passes, verification,
and an :class:`~kvtransform.transforms.base.OptimizedModule` whose parameters are the original model's ``Parameter``
objects. ``load(dir)`` rebuilds the module class the writing transform registered, in any process.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .capture import capture
from .config import TransformConfig, config_from_yaml, resolve_config
from .passes.attention import AttentionPass
from .report import Report
from .transforms import spec_for
from .transforms.artifact_files import check_config_keys, load_artifact_file
from .transforms.base import OptimizedModule, capture_and_rewrite
from .utils import stage


def transform(model: torch.nn.Module, config="canonical", tokenizer=None, progress: bool = True) -> OptimizedModule:
    """Capture ``model``, rewrite its attention with the passes of ``config``, verify, and return the result.

    Args:
        model: a transformers causal LM (Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, gpt-oss, Qwen3-MoE, Phi-3 families, ...), any dtype/device.
        config: ``"canonical"``, ``"dualkv"``, ``"specontext"``, a config dataclass (``kvt.DualKVConfig(...)``) or a
            dict with a ``name`` key.
        tokenizer: used to build real verification inputs from the shipped text; default the tokenizer
            :func:`kvtransform.load_model` attached to the model (``model.kvt_tokenizer``), else random token ids.
        progress: show progress for capture, passes and verification.

    Returns:
        :class:`OptimizedModule` (a subclass for some transforms).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (e.g. :func:`~kvtransform.load_model`'s pair).
        ValueError: unknown transform / invalid config, or a model that is not a decoder-only causal LM.
        kvtransform.verify.VerificationError: the rewritten model differs beyond tolerance.
    """
    cfg = resolve_config(config)
    spec = check_available(cfg)
    from .models import check_causal_lm

    check_causal_lm(model)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "kvt_tokenizer", None)
    from .integrations.transformers import suspended

    with suspended(model):  # a model under enable(): captured and verified with its own attention, enabled again after
        return spec.handler(model, cfg, tokenizer=tokenizer, progress=progress)


def check_available(cfg: TransformConfig):
    """The registered transform for ``cfg`` (a :class:`~kvtransform.transforms.TransformSpec`).

    Raises:
        ValueError: a config without a registered transform.
    """
    return spec_for(cfg)


def inspect(model: torch.nn.Module, progress: bool = True) -> Report:
    """Capture ``model`` and report every attention site found (nothing is rewritten).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (e.g. a ``(model, tokenizer)`` pair).
        ValueError: not a decoder-only causal LM.
    """
    from .integrations.transformers import suspended
    from .models import check_causal_lm
    from .utils import model_name

    check_causal_lm(model)
    report = Report(model=model_name(model), transform="inspect")
    with suspended(model):
        capture_and_rewrite(model, capture, [lambda ctx: AttentionPass(ctx, rewrite=False)], report, progress)
    return report


def load(path: str | os.PathLike, progress: bool = True) -> OptimizedModule:
    """Load a directory written by :meth:`OptimizedModule.save` into the module class of the transform that wrote
    it (works in a fresh process: importing kvtransform registers every transform). ``progress``: say on stderr
    what loads and how long it took (deserialising a ``.pt2`` takes minutes on a small CPU).

    Raises:
        FileNotFoundError: ``path`` is not a saved kvtransform artifact.
        ValueError: the artifact's config is invalid or newer than this installation understands, or one of its
            files is damaged (the message names it).
    """
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a kvtransform artifact (expected config.yaml and the programs "
                                f"written by OptimizedModule.save)")
    config, config_text = load_artifact_file(path / "config.yaml", lambda f: _artifact_config(f))

    def read_json(name):
        d = load_artifact_file(path / name, lambda f: json.loads(f.read_text())) if (path / name).exists() else None
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"{path / name} is damaged (a JSON {type(d).__name__}, not an object): save the artifact "
                             f"again")
        return d

    report_dict, meta = read_json("report.json"), read_json("meta.json")
    try:
        report = Report.from_dict(report_dict) if report_dict is not None else Report()
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise ValueError(f"{path / 'report.json'} is damaged ({type(e).__name__}: {e}): save the artifact "
                         f"again") from None
    meta = meta if meta is not None else {}
    msl = meta.get("max_seq_len", 1)
    if isinstance(msl, bool) or not isinstance(msl, int) or msl < 1:
        raise ValueError(f"{path / 'meta.json'} is damaged (max_seq_len {msl!r} is not a positive integer): save "
                         f"the artifact again")
    check_config_keys(path / "config.yaml", meta, config_text)
    if meta.get("transform", config.name) != config.name:  # one of the two files was edited or swapped
        raise ValueError(f"{path} is damaged: config.yaml is a {config.name!r} config but meta.json says transform "
                         f"{meta['transform']!r}: save the artifact again")
    _register_transformers_ops()
    with stage(progress, f"loading the {config.name} artifact {path}"):
        return check_available(config).module_type.from_artifact(path, config, report, meta)


def _artifact_config(file: Path):
    """``(config, text)``: the transform config of an artifact's ``config.yaml`` and the file's text (read once), a
    mapping with the transform's ``name`` (an empty file or a YAML list is a damaged artifact, not the default
    canonical config); ValueError naming the file otherwise."""
    import yaml

    text = file.read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or "name" not in data:
        got = "empty" if data is None else f"a YAML {type(data).__name__} without a transform name"
        raise ValueError(f"{file} is damaged ({got}): save the artifact again")
    try:
        return config_from_yaml(text), text
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: {e}") from None


def _register_transformers_ops() -> None:
    """Register the custom ops that transformers defines on import and a captured program may call
    (``transformers::grouped_mm_fallback``, the mixture-of-experts kernel of ``capture_rewrites``): a saved
    program that holds one deserialises only once its op exists, and a fresh process has not imported them."""
    import importlib

    try:
        importlib.import_module("transformers.integrations.moe")
    except ImportError:  # a transformers without it has no such op to register
        pass
