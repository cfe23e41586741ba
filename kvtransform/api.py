"""The Python API: ``transform``, ``inspect``, ``load`` and the :class:`OptimizedModule` they return.

A transform is a handler registered per config name (``canonical``, ``dualkv``, ``specontext``; torchao's
``quantize_(model, config)`` pattern): it captures the model (``kvtransform.capture``), runs its passes through the
pass manager, verifies the result against the original model, and returns an ``OptimizedModule`` whose parameters
are the original model's ``Parameter`` objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.export import Dim

from .capture import capture, export_dynamic
from .config import CanonicalConfig, config_from_yaml, resolve_config
from .report import Report

TRANSFORMS: dict[str, Callable] = {}
MODULE_TYPES: dict[str, type] = {}


def register_transform(name: str):
    """Decorator: register ``fn(model, config, tokenizer, progress) -> OptimizedModule`` for config ``name``."""

    def deco(fn):
        TRANSFORMS[name] = fn
        return fn

    return deco


def register_module_type(name: str):
    """Decorator: the ``OptimizedModule`` subclass that :func:`load` rebuilds for artifacts of transform ``name``."""

    def deco(cls):
        MODULE_TYPES[name] = cls
        return cls

    return deco


# ---------------------------------------------------------------------------------------------------------------------
class _Logits(torch.nn.Module):
    """Adapter: ``(input_ids, attention_mask) -> logits`` around a captured graph module."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, input_ids, attention_mask):
        out = self.gm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits if hasattr(out, "logits") else out[0]


@register_module_type("canonical")
class OptimizedModule(torch.nn.Module):
    """A transformed model: an ``nn.Module`` holding the rewritten graph, its config and its report.

    Call it as ``opt(input_ids, attention_mask=None) -> logits`` with ``input_ids`` int64 ``(B, S)`` and
    ``attention_mask`` int/bool ``(B, S)`` (1 = real token; left padding supported); logits are
    ``(B, S, vocab)`` in the model's dtype.

    Attributes:
        core: the module that computes the logits (the rewritten FX graph, or the reloaded ``.pt2`` module).
        config: the resolved transform config (dataclass).
        report: :class:`~kvtransform.report.Report`.
    """

    def __init__(self, core: torch.nn.Module, config: CanonicalConfig, report: Report, max_seq_len: int = 4096):
        super().__init__()
        self.core = core
        self.config = config
        self.report = report
        self.max_seq_len = int(max_seq_len)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, S, vocab)``.

        Raises:
            ValueError: ``input_ids`` not an integer ``(B, S)`` tensor with ``B >= 1`` and ``1 <= S <= max_seq_len``,
                token ids outside the vocabulary, or an ``attention_mask`` that is not 0/1 of the same shape.
        """
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"{type(self).__name__} takes input_ids as an integer tensor (batch, seq); got "
                             f"{type(input_ids).__name__}" + (" — a PackedBatch needs kvt.transform(model, "
                                                              "'dualkv')" if type(input_ids).__name__ ==
                                                              "PackedBatch" else ""))
        if input_ids.dim() != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor of shape (batch, seq); got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if b < 1 or not 1 <= s <= self.max_seq_len:
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)}: need batch >= 1 and 1 <= seq <= "
                             f"{self.max_seq_len} (the model's maximum positions, captured as the dynamic bound)")
        vocab = self.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or (vocab is not None and hi >= vocab):
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab})")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif tuple(attention_mask.shape) != (b, s) or attention_mask.dtype.is_floating_point or \
                not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError(f"attention_mask must be 0/1 (int or bool) of shape {(b, s)} like input_ids; got "
                             f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
        return self.core(input_ids, attention_mask.to(torch.long))

    @property
    def vocab_size(self) -> Optional[int]:
        """Rows of the input embedding (token ids must be below it), or None if not found."""
        if not hasattr(self, "_vocab_size"):
            self._vocab_size = next((int(p.shape[0]) for n, p in self.core.named_parameters(remove_duplicate=False)
                                     if n.endswith(("embed_tokens.weight", "wte.weight")) and p.dim() == 2), None)
        return self._vocab_size

    @property
    def code(self) -> str:
        """Readable Python of the rewritten graph."""
        gm = getattr(self.core, "gm", self.core)
        return getattr(gm, "code", repr(gm))

    # ---- emission --------------------------------------------------------------------------------------------------
    def export_example(self):
        """``(args, dynamic_shapes)`` for exporting ``core`` as ``.pt2``: example positional inputs of ``core`` and
        their dynamic dimensions (a tuple matching ``args``). Subclasses with another ``core`` signature override
        this."""
        ids = torch.ones(2, 8, dtype=torch.long, device=_device_of(self))
        am = torch.ones_like(ids)
        seq = Dim("seq", min=2, max=self.max_seq_len)
        batch = Dim("batch", min=1, max=1024)
        return (ids, am), ({0: batch, 1: seq}, {0: batch, 1: seq})

    def save(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        """Write ``model.pt2`` (torch.export), ``graph.py`` (readable graph code), ``config.yaml`` and
        ``report.json`` into directory ``path``, atomically (a temporary sibling directory renamed into place).

        Raises:
            FileExistsError: ``path`` exists and is not empty, and ``overwrite`` is false.
        """
        path = Path(path)
        if path.exists() and (not path.is_dir() or any(path.iterdir())) and not overwrite:
            raise FileExistsError(f"output directory {str(path)!r} exists and is not empty; choose another "
                                  f"directory or pass overwrite=true")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            args, dyn = self.export_example()
            ep = export_dynamic(_ExportWrapper(self), tuple(args), None, {"args": tuple(dyn)},
                                "the transformed module")
            torch.export.save(ep, tmp / "model.pt2")
            (tmp / "graph.py").write_text(self.code)
            (tmp / "config.yaml").write_text(self.config.to_yaml())
            (tmp / "report.json").write_text(self.report.to_json())
            (tmp / "meta.json").write_text(_json({"transform": self.config.name, "max_seq_len": self.max_seq_len,
                                                  "torch": torch.__version__}))
            if path.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.replace(path, old / "x")
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path


class _ExportWrapper(torch.nn.Module):
    """What ``.pt2`` holds: ``core`` with its positional signature (``kvt.load`` wraps the module back)."""

    def __init__(self, opt):
        super().__init__()
        self.core = opt.core

    def forward(self, *args):
        return self.core(*args)


def load(path: str | os.PathLike) -> OptimizedModule:
    """Load a directory written by :meth:`OptimizedModule.save`.

    Raises:
        FileNotFoundError: ``path`` is not a saved kvtransform artifact.
    """
    import json

    path = Path(path)
    if not (path / "model.pt2").is_file() or not (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a kvtransform artifact (expected model.pt2 and config.yaml "
                                f"written by OptimizedModule.save)")
    config = config_from_yaml((path / "config.yaml").read_text())
    report = Report.from_dict(json.loads((path / "report.json").read_text())) if (path / "report.json").exists() \
        else Report()
    meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").exists() else {}
    ep = torch.export.load(path / "model.pt2")
    cls = MODULE_TYPES.get(config.name, OptimizedModule)
    return cls(ep.module(), config, report, max_seq_len=meta.get("max_seq_len", 4096))


# ---------------------------------------------------------------------------------------------------------------------
def transform(model: torch.nn.Module, config="canonical", tokenizer=None, progress: bool = True) -> OptimizedModule:
    """Capture ``model``, rewrite its attention with the passes of ``config``, verify, and return the result.

    Args:
        model: a transformers causal LM (Llama, Qwen2, Qwen3, Mistral families, ...), any dtype/device.
        config: ``"canonical"``, ``"dualkv"``, ``"specontext"``, a config dataclass (``kvt.DualKVConfig(...)``) or a
            dict with a ``name`` key.
        tokenizer: used to build real verification inputs from the shipped text; default the tokenizer
            :func:`kvtransform.load_model` attached to the model (``model.kvt_tokenizer``), else random token ids.
        progress: show progress for capture, passes and verification.

    Returns:
        :class:`OptimizedModule` (a subclass for some transforms).

    Raises:
        ValueError: unknown transform / invalid config, or a model that is not a decoder-only causal LM.
        NotImplementedError: ``"specontext"`` (only its ops exist so far).
        kvtransform.passes.verify.VerificationError: the rewritten model differs beyond tolerance.
    """
    cfg = resolve_config(config)
    check_available(cfg)
    _check_model(model)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "kvt_tokenizer", None)
    return TRANSFORMS[cfg.name](model, cfg, tokenizer=tokenizer, progress=progress)


def check_available(cfg: CanonicalConfig) -> None:
    """Raise unless a handler for ``cfg.name`` is registered (importing the optional transform modules first).

    Raises:
        NotImplementedError: ``specontext`` (only its ops exist so far).
        ValueError: any other name without a handler.
    """
    if cfg.name not in TRANSFORMS:
        _load_transform_modules()
    if cfg.name == "specontext" and cfg.name not in TRANSFORMS:
        raise NotImplementedError(
            "the SpeContext transform (decode-step capture, sparse_decode pass, KV-cache runtime, generate) is not "
            "built yet; its ops are available: kvtransform.retrieval_topk and kvtransform.sparse_decode_attention. "
            "Use transform='canonical' or 'dualkv'.")
    if cfg.name not in TRANSFORMS:
        raise ValueError(f"transform {cfg.name!r} is not available in this installation; available: "
                         f"{sorted(TRANSFORMS)}")


def inspect(model: torch.nn.Module, progress: bool = True) -> Report:
    """Capture ``model`` and report every attention site found (nothing is rewritten)."""
    from .passes.attention import canonicalize_attention
    from .passes.manager import PassContext

    _check_model(model)
    report = Report(model=_model_name(model), transform="inspect")
    with _stage(progress, "capturing the model with torch.export"):
        t0 = time.perf_counter()
        cap = capture(model)
        report.timings["capture"] = round(time.perf_counter() - t0, 3)
    ctx = PassContext(report, model.config, cap.max_seq_len)
    with _stage(progress, "finding attention sites"):
        canonicalize_attention(cap.graph_module, ctx, rewrite=False)
    return report


@register_transform("canonical")
def canonical_transform(model, cfg: CanonicalConfig, tokenizer=None, progress: bool = True) -> OptimizedModule:
    """Canonical transform: every attention → ``kvt.attention``; verified against the original model."""
    from .passes.attention import canonicalize_attention
    from .passes.cleanup import cleanup
    from .passes.manager import PassContext, PassManager

    report = Report(model=_model_name(model), transform=cfg.name)
    gm, ctx = capture_and_rewrite(model, report, [("attention", canonicalize_attention), ("cleanup", cleanup)],
                                  progress)
    opt = OptimizedModule(_Logits(gm), cfg, report, max_seq_len=ctx.max_seq_len)
    run_verification(model, opt, cfg, tokenizer, report, progress)
    return opt


def capture_and_rewrite(model, report: Report, passes, progress: bool):
    """Shared front half of every transform: model check, capture, pass manager. Returns ``(gm, ctx)``."""
    from .passes.manager import PassContext, PassManager

    _check_model(model)
    with _stage(progress, "capturing the model with torch.export"):
        t0 = time.perf_counter()
        cap = capture(model)
        report.timings["capture"] = round(time.perf_counter() - t0, 3)
    ctx = PassContext(report, model.config, cap.max_seq_len)
    with _stage(progress, "running passes") as st:
        gm = PassManager(passes).run(cap.graph_module, ctx,
                                     progress=(lambda n: st.update(f"running pass {n}")) if st else None)
    return gm, ctx


def run_verification(model, opt: OptimizedModule, cfg: CanonicalConfig, tokenizer, report: Report,
                     progress: bool) -> None:
    """Verification gate for transforms whose module has the ``(input_ids, attention_mask) -> logits`` signature."""
    from .passes.verify import check, default_tolerance, verification_cases, verify

    if not cfg.verify.enabled:
        return
    param = next(model.parameters())
    vcfg = cfg.verify
    too_long = [n for n in vcfg.lengths if n > opt.max_seq_len]
    if too_long:  # verify at the longest length the module accepts instead
        vcfg = dataclasses.replace(vcfg, lengths=sorted({min(n, opt.max_seq_len) for n in vcfg.lengths}))
        report.pass_record("attention").notes.append(
            f"verify lengths {too_long} exceed the model's {opt.max_seq_len} positions; verified at "
            f"{opt.max_seq_len} instead") if report.pass_record("attention") else None
    cases = verification_cases(vcfg, tokenizer, model.config.vocab_size, param.device)
    tol = default_tolerance(param.dtype, cfg.verify.tolerance)

    def original(ids, am):
        # The transformed module computes the model in eval mode (attention dropout off): compare with that.
        was_training = model.training
        model.eval()
        try:
            return model(input_ids=ids, attention_mask=am, use_cache=False).logits
        finally:
            model.train(was_training)

    with _stage(progress, f"verifying on {len(cases)} real inputs"):
        t0 = time.perf_counter()
        report.verification = verify(original, opt, cases, tol)
        report.timings["verify"] = round(time.perf_counter() - t0, 3)
    check(report.verification)


# ---------------------------------------------------------------------------------------------------------------------
def _check_model(model) -> None:
    from .models import check_causal_lm

    check_causal_lm(model)


def _model_name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
               or type(model).__name__)


def _device_of(module) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


def _load_transform_modules() -> None:
    """Import the modules that register the optional transforms (dualkv, specontext)."""
    import importlib

    for mod in ("kvtransform.dualkv", "kvtransform.specontext"):
        with contextlib.suppress(ImportError):
            importlib.import_module(mod)


@contextlib.contextmanager
def _stage(progress: bool, text: str):
    if not progress:
        yield None
        return
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with console.status(text) as st:
        yield st
    console.print(f"[dim]✓ {text} ({time.perf_counter() - t0:.1f} s)[/dim]")


def _json(obj) -> str:
    import json

    return json.dumps(obj, indent=2)
