"""Capture a Hugging Face causal LM as an FX graph with ``torch.export`` (non-strict, dynamic batch and sequence).

``torch.fx.symbolic_trace`` no longer works on transformers v5 models; ``torch.export.export(..., strict=False)`` is
the tracer (``docs/ARCHITECTURE.md``). The captured forward takes ``input_ids`` and ``attention_mask`` (both ``(B, S)``
int64) with ``use_cache=False`` and returns the pytree of the model's output; :func:`capture` returns the unlifted
``GraphModule`` (parameters as attributes, the same ``Parameter`` objects as the model's) that passes rewrite.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch.export import Dim


@dataclass
class Captured:
    """Result of :func:`capture`.

    Attributes:
        graph_module: unlifted ``torch.fx.GraphModule``; call it as ``gm(input_ids=..., attention_mask=...,
            use_cache=False)``.
        exported: the ``torch.export.ExportedProgram`` it came from.
        max_seq_len: upper bound of the dynamic sequence dimension.
        input_names: user input names in order.
    """

    graph_module: torch.fx.GraphModule
    exported: torch.export.ExportedProgram
    max_seq_len: int
    input_names: tuple


def max_positions(model) -> int:
    cfg = model.config
    n = getattr(cfg, "max_position_embeddings", None) or 4096
    return int(min(n, 1 << 16))


def example_inputs(model, batch: int = 2, seq: int = 8, device=None):
    """Small example ``(input_ids, attention_mask)`` for tracing; the second row is left-padded by 2 tokens."""
    device = device or next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    am = torch.ones(batch, seq, dtype=torch.long, device=device)
    if batch > 1:
        am[1, :2] = 0
    return ids, am


def capture(model: torch.nn.Module, max_seq_len: Optional[int] = None) -> Captured:
    """Export ``model``'s forward (no KV cache) with dynamic batch and sequence length.

    Args:
        model: a transformers causal LM (``...ForCausalLM``) in eval mode, any dtype/device.
        max_seq_len: upper bound of the dynamic sequence length; default ``config.max_position_embeddings``.

    Returns:
        :class:`Captured`.

    Raises:
        RuntimeError: when torch.export fails (the message carries the exporter's reason).
    """
    max_len = max_seq_len or max_positions(model)
    ids, am = example_inputs(model)
    seq = Dim("seq", min=2, max=max_len)
    batch = Dim("batch", min=1, max=1024)
    dyn = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}, "use_cache": None}
    was_training = model.training
    model.eval()
    try:
        ep = export_dynamic(model, (), {"input_ids": ids, "attention_mask": am, "use_cache": False}, dyn,
                            type(model).__name__)
    finally:
        model.train(was_training)
    _require_dynamic(ep, "input_ids", 1)
    gm = ep.module()
    _share_parameters(gm, model)
    return Captured(gm, ep, max_len, ("input_ids", "attention_mask"))


def _auto_dims(spec):
    """The same dynamic-shape spec with every named ``Dim`` replaced by ``Dim.AUTO``."""
    if isinstance(spec, dict):
        return {k: _auto_dims(v) for k, v in spec.items()}
    if isinstance(spec, (tuple, list)):
        return type(spec)(_auto_dims(v) for v in spec)
    return None if spec is None else Dim.AUTO


def export_dynamic(module: torch.nn.Module, args: tuple, kwargs: Optional[dict], dynamic_shapes, what: str,
                   force_auto_dims: bool = False) -> torch.export.ExportedProgram:
    """``torch.export.export(..., strict=False)`` with named dynamic dims, falling back to ``Dim.AUTO``.

    On CUDA, SDPA's mask handling emits guards the named-``Dim`` solver cannot prove although they always hold
    (e.g. ``min(128*T, 512*T) == 128*T``); ``Dim.AUTO`` accepts them. Callers check that what must stay dynamic did.

    Raises:
        RuntimeError: neither attempt exported (the message carries the exporter's reason).
    """
    err = None
    specs = (_auto_dims(dynamic_shapes),) if force_auto_dims else (dynamic_shapes, _auto_dims(dynamic_shapes))
    for spec in specs:
        try:
            with torch.no_grad(), _quiet():
                return torch.export.export(module, tuple(args), kwargs or {}, dynamic_shapes=spec, strict=False)
        except Exception as e:  # pragma: no cover - message path
            err = e
    raise RuntimeError(f"torch.export could not capture {what}: {err}") from err


def _require_dynamic(ep: torch.export.ExportedProgram, placeholder: str, dim: int) -> None:
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name == placeholder and isinstance(node.meta["val"].shape[dim], int):
            raise RuntimeError(f"torch.export specialised dimension {dim} of {placeholder}; cannot build a module "
                               f"for every length")


def _share_parameters(gm: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make the captured module hold the model's own ``Parameter`` objects (so optimisers built on
    ``model.parameters()`` train the transformed module, and no weight memory is duplicated)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, _ in list(gm.named_parameters(remove_duplicate=False)):
        if name not in params:
            continue
        *path, leaf = name.split(".")
        owner = gm
        for p in path:
            owner = getattr(owner, p)
        owner._parameters[leaf] = params[name]


@contextlib.contextmanager
def _quiet():
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("torch._export", "torch.export", "torch._dynamo", "torch.fx")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


# ---------------------------------------------------------------------------------------------------------------------
# packed (DualKV) capture: one token axis [P][R_1]...[R_N] (DualKV, arXiv 2605.15422)
# ---------------------------------------------------------------------------------------------------------------------
PACKED_INPUTS = ("input_ids", "position_ids", "cu_seqlens", "segment_prefix")


class PackedForward(torch.nn.Module):
    """Wrapper exported by :func:`capture_packed`: ``(input_ids (1, T), position_ids (1, T), cu_seqlens (S+1,),
    segment_prefix (S,)) -> logits (1, T, vocab)``.

    The model sees ``position_ids`` and an all-ones ``attention_mask`` built from ``input_ids`` (so transformers
    builds a plain causal mask, not its packed-sequence mask from position ids); ``cu_seqlens`` and
    ``segment_prefix`` are unused here: they only become graph placeholders, which the dualkv pass wires into
    ``kvt.dualkv_attention``.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, cu_seqlens, segment_prefix):
        out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids,
                         use_cache=False)
        return out.logits if hasattr(out, "logits") else out[0]


def capture_packed(model: torch.nn.Module, max_tokens: int = 1 << 20, force_auto_dims: bool = False) -> Captured:
    """Export ``model``'s forward over one packed token axis: ``(input_ids (1, T), position_ids (1, T), cu_seqlens
    (S+1,) int32, segment_prefix (S,) int32) -> logits (1, T, vocab)``, dynamic ``T`` and ``S``.

    Used by the dualkv transform (DualKV, arXiv 2605.15422): before its pass the graph computes plain causal attention
    over the whole axis; the pass rewires every attention to the layout placeholders. The captured module holds the
    model's own ``Parameter`` objects.

    Args:
        model: a transformers causal LM, any dtype/device.
        max_tokens: upper bound of the dynamic packed length ``T``.
        force_auto_dims: skip the named-``Dim`` attempt and export with ``Dim.AUTO`` (the fallback; for tests).

    Raises:
        RuntimeError: when torch.export fails.
    """
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, 12), device=device)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 5, 6, 7, 5, 6, 7]], device=device)
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32, device=device)
    sp = torch.tensor([-1, 0, 0], dtype=torch.int32, device=device)
    tok = Dim("tokens", min=2, max=int(max_tokens))
    seg = Dim("segments", min=2, max=int(max_tokens))
    seg1 = Dim("segments_plus_1", min=3, max=int(max_tokens) + 1)
    named = {"input_ids": {1: tok}, "position_ids": {1: tok}, "cu_seqlens": {0: seg1}, "segment_prefix": {0: seg}}
    was_training = model.training
    model.eval()
    try:
        ep = export_dynamic(PackedForward(model), (ids, pos, cu, sp), None, named,
                            f"{type(model).__name__} (packed)", force_auto_dims=force_auto_dims)
    finally:
        model.train(was_training)
    _require_dynamic(ep, "input_ids", 1)
    gm = ep.module()
    _share_parameters(gm.model, model)
    return Captured(gm, ep, int(max_tokens), PACKED_INPUTS)
