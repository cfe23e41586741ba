"""Capture a Hugging Face causal LM as an FX graph with ``torch.export`` (non-strict, dynamic batch and sequence).

``torch.fx.symbolic_trace`` no longer works on transformers v5 models; ``torch.export.export(..., strict=False)`` is
the tracer (``docs/ARCHITECTURE.md``). The captured forward takes ``input_ids`` and ``attention_mask`` (both ``(B, S)``
int64) with ``use_cache=False`` and returns the pytree of the model's output; :func:`capture` returns the unlifted
``GraphModule`` (parameters as attributes, the same ``Parameter`` objects as the model's) that passes rewrite.

A model that torch.export cannot capture raises :class:`CaptureError`: one line naming the model feature (the source
line) that stopped capture, and the config key or workaround where one is known; the exporter prints nothing (its
logs and its partial-graph dump are silenced; ``KVT_DEBUG=1`` lets them through) and its exception is the error's
``__cause__``. Two model features are captured through a temporary, behaviour-preserving rewrite
(:mod:`kvtransform.capture_rewrites`): dynamic-NTK RoPE as it behaves up to the model's original maximum length, and
mixture-of-experts layers (Qwen3-MoE, gpt-oss) whose ``'eager'`` experts loop is data-dependent, captured through
transformers' ``'grouped_mm'`` experts implementation (the same math; the default in transformers 5.x).
"""
from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from kvtransform.capture_rewrites import KNOWN_BLOCKER_LINES, KNOWN_BLOCKERS, capturable, no_fake_state_left
from kvtransform.utils import cache_kwarg

#: rows a captured program takes at most (its dynamic batch bound); the canonical module runs more in slices
MAX_BATCH = 1024


class CaptureError(RuntimeError):
    """torch.export could not capture a model. The message is one line: what stopped capture (the model feature,
    its source line) and the config key or workaround where one is known; ``__cause__`` is the exporter's error."""


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
        CaptureError: torch.export cannot capture the model (a ``RuntimeError``; one line naming the feature).
    """
    max_len = max_seq_len or max_positions(model)
    ids, am = example_inputs(model)
    seq = Dim("seq", min=2, max=max_len)
    batch = Dim("batch", min=1, max=MAX_BATCH)
    dyn = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}, "use_cache": None}
    was_training = model.training
    model.eval()
    try:
        ep = export_dynamic(model, (), {"input_ids": ids, "attention_mask": am, "use_cache": False}, dyn,
                            type(model).__name__, max_positions=max_len)
    finally:
        model.train(was_training)
    _require_dynamic(ep, "input_ids", 1, type(model).__name__)
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
                   force_auto_dims: bool = False, max_positions: Optional[int] = None) -> torch.export.ExportedProgram:
    """``torch.export.export(..., strict=False)`` with named dynamic dims, falling back to ``Dim.AUTO``.

    On CUDA, SDPA's mask handling emits guards the named-``Dim`` solver cannot prove although they always hold
    (e.g. ``min(128*T, 512*T) == 128*T``); ``Dim.AUTO`` accepts them. Callers check that what must stay dynamic did.
    ``max_positions``: the largest position the captured program can see (``None``: unbounded), for
    :func:`kvtransform.capture_rewrites.capturable`.

    Raises:
        CaptureError: a model feature known to defeat capture, refused before exporting, or neither attempt
            exported (one line naming the source line that stopped it; the exporter's error is ``__cause__``).
    """
    err = None
    specs = (_auto_dims(dynamic_shapes),) if force_auto_dims else (dynamic_shapes, _auto_dims(dynamic_shapes))
    with capturable(module, max_positions, what):
        for spec in specs:
            try:
                with torch.no_grad(), _quiet(), no_fake_state_left(module):  # (a retry must not meet the first's)
                    return torch.export.export(module, tuple(args), kwargs or {}, dynamic_shapes=spec, strict=False)
            except Exception as e:
                err = e
    raise CaptureError(f"torch.export cannot capture {what}: {_blocker(err)}") from err


def _blocker(err: BaseException) -> str:
    """One line: what in the model stopped torch.export (the last frame outside torch, the kind of failure), the
    known feature and workaround for it, and where to see the rest."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_THIS_FILE)]
    first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    kind = ("data-dependent control flow (a Python branch on a tensor's value)"
            if "data-dependent" in first else f"{type(err).__name__}: {first}")
    where = ""
    if frames:
        f = frames[-1]
        parts = Path(f.filename).parts
        short = "/".join(parts[-3:] if "site-packages" not in parts
                         else parts[len(parts) - parts[::-1].index("site-packages"):])
        where = f" at {short}:{f.lineno} in {f.name}()" + (f": `{f.line}`" if f.line else "")
        hint = KNOWN_BLOCKERS.get(f.name) or next((h for word, h in KNOWN_BLOCKER_LINES.items()
                                                   if word in (f.line or "")), None)
        if hint:
            return f"{hint} ({kind}{where})"
    return f"{kind}{where}; set KVT_DEBUG=1 for the exporter's traceback"


_TORCH_DIR = str(Path(torch.__file__).parent)
_THIS_FILE = str(Path(__file__).resolve())


def _require_dynamic(ep: torch.export.ExportedProgram, placeholder: str, dim: int, what: str) -> None:
    """CaptureError (one line) when the exporter fixed dimension ``dim`` of ``placeholder``: the module would take
    one length only (e.g. a recurrent or convolution layer whose code branches on the length, as in RecurrentGemma
    and Jamba)."""
    for node in ep.graph.nodes:
        # a size the exporter fixed by a guard (e.g. ``size == 8``) stays a SymInt whose expression is a number
        if node.op == "placeholder" and node.name == placeholder and is_concrete_int(node.meta["val"].shape[dim]):
            raise CaptureError(f"torch.export specialised dimension {dim} of {placeholder} for {what} (the model's "
                               f"code depends on its exact size, e.g. a recurrent or convolution layer): cannot build "
                               f"a module for every length; kvtransform rewrites attention LMs (Llama, Qwen, "
                               f"Mistral, Gemma, gpt-oss families, ...)")


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


def tie_aliased_parameters(gm: torch.nn.Module) -> None:
    """Make parameters that alias one storage one ``Parameter`` again. ``torch.export.load`` gives a tied weight
    (e.g. ``embed_tokens`` / ``lm_head``) as separate ``Parameter`` objects over the same memory, of which the graph
    trains only one: the others would show up in ``parameters()`` with no gradient (an optimizer, DDP or FSDP2
    would see an extra, unused weight). Every name of a group is set to its first ``Parameter``, as in the model
    that was captured."""
    first: dict = {}
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        if p.numel() == 0 or p.device.type == "meta":
            continue
        key = (p.device, p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), tuple(p.stride()),
               p.dtype)
        keep = first.setdefault(key, p)
        if keep is not p:
            *path, leaf = name.split(".")
            gm.get_submodule(".".join(path))._parameters[leaf] = keep


@contextlib.contextmanager
def _quiet():
    """Silence the exporter: its loggers, warnings and what it prints to stderr (the partial graph of a failed
    export); ``KVT_DEBUG=1`` lets the printing through."""
    import io
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("torch._export", "torch.export", "torch._dynamo", "torch.fx")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    stderr = contextlib.nullcontext() if os.environ.get("KVT_DEBUG") else contextlib.redirect_stderr(io.StringIO())
    try:
        with warnings.catch_warnings(), stderr:
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


def export_wrapped(model: torch.nn.Module, wrapper: torch.nn.Module, args: tuple, dynamic_shapes: dict, what: str,
                   must_stay_dynamic: tuple, force_auto_dims: bool = False, max_positions: Optional[int] = None):
    """Export ``wrapper`` (a module holding ``model`` as ``.model``) with ``model`` in eval mode; check that
    ``must_stay_dynamic`` = ``(placeholder, dim)`` stayed dynamic; make the unlifted module share ``model``'s
    ``Parameter`` objects. Returns ``(exported_program, graph_module)``. ``max_positions``: the largest position
    the program can see (``None``: unbounded), as :func:`export_dynamic`'s.

    Raises:
        RuntimeError: torch.export failed, or specialised the dimension that must stay dynamic.
    """
    was_training = model.training
    model.eval()
    try:
        ep = export_dynamic(wrapper, args, None, dynamic_shapes, f"{type(model).__name__} ({what})",
                            force_auto_dims=force_auto_dims, max_positions=max_positions)
    finally:
        model.train(was_training)
    _require_dynamic(ep, *must_stay_dynamic, type(model).__name__)
    gm = ep.module()
    _share_parameters(gm.model, model)
    return ep, gm


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
        CaptureError: torch.export cannot capture the model (a ``RuntimeError``; one line naming the feature), e.g.
            dynamic-NTK RoPE, whose frequencies depend on positions a packed axis cannot bound.
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
    ep, gm = export_wrapped(model, PackedForward(model), (ids, pos, cu, sp), named, "packed", ("input_ids", 1),
                            force_auto_dims)
    return Captured(gm, ep, int(max_tokens), PACKED_INPUTS)


# ---------------------------------------------------------------------------------------------------------------------
# decode-step and prefill capture — added for the specontext transform (SpeContext, arXiv 2512.00722 §4–5)
# ---------------------------------------------------------------------------------------------------------------------
DECODE_INPUTS = ("input_ids", "cache_seqlens", "indices", "k_cache", "v_cache")
PREFILL_INPUTS = ("input_ids", "position_ids", "cu_seqlens", "segment_prefix", "logits_index")


def _recording_cache(past_keys: Optional[list] = None, past_values: Optional[list] = None):
    """A transformers ``DynamicCache`` whose ``update(k, v, layer)`` records the new post-RoPE K/V of every layer
    (``.new_keys`` / ``.new_values``, lists of ``(B, H_kv, S_new, D)``) and returns ``cat(past_l, new)`` along the
    sequence dim (just ``new`` without a past). It never grows: the caller owns the cache memory.

    With a past, its layers are ordinary ``DynamicLayer`` objects holding ``past_l`` ``(B, H_kv, S_max, D)``, so
    transformers' own mask code sizes the attention mask as ``S_max + S_new`` keys with the query at offset
    ``S_max``."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class _RecordingCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.new_keys.append(key_states)
            self.new_values.append(value_states)
            if layer_idx >= len(self.layers) or getattr(self.layers[layer_idx], "keys", None) is None:
                return key_states, value_states
            layer = self.layers[layer_idx]
            return (torch.cat([layer.keys, key_states], dim=-2), torch.cat([layer.values, value_states], dim=-2))

    cache = _RecordingCache()
    cache.new_keys, cache.new_values = [], []
    for k, v in zip(past_keys or [], past_values or []):
        layer = DynamicLayer()
        layer.keys, layer.values, layer.is_initialized, layer.device = k, v, True, k.device
        cache.layers.append(layer)
    return cache


class DecodeStepForward(torch.nn.Module):
    """Wrapper exported by :func:`capture_decode_step`: one decode step over a static KV cache.

    ``(input_ids (B, 1) int64, cache_seqlens (B,) int32, indices (B, H_kv, Bud) int32, k_cache (L, B, H_kv, S_max,
    D), v_cache (same)) -> (logits (B, vocab), k_new (L, B, H_kv, D), v_new (L, B, H_kv, D))``.

    Row ``b`` holds ``cache_seqlens[b]`` tokens at cache positions ``[0, cache_seqlens[b])`` (no padding inside the
    cache), so the new token sits at position ``cache_seqlens[b]`` (its RoPE position). The model runs with a
    recording cache whose ``update`` returns ``cat(k_cache[l], k_new)`` and a 2-D attention mask that keeps the
    valid cache positions and the new token: before the sparse_decode pass the graph is exactly dense decode
    attention (as HF computes it); the pass swaps every such attention for ``kvt::sparse_decode_attention`` over
    ``indices`` (unused until then). ``k_new``/``v_new`` are the new token's post-RoPE K/V; the runtime writes them
    into the cache.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self._cache_kw = cache_kwarg(model)

    def forward(self, input_ids, cache_seqlens, indices, k_cache, v_cache):
        n_layers, s_max = k_cache.shape[0], k_cache.shape[3]
        lens = cache_seqlens.to(torch.long)
        keep = torch.arange(s_max, device=input_ids.device)[None, :] < lens[:, None]
        attention_mask = torch.cat([keep, torch.ones_like(keep[:, :1])], dim=1).to(torch.long)
        cache = _recording_cache([k_cache[i] for i in range(n_layers)], [v_cache[i] for i in range(n_layers)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=lens[:, None],
                         use_cache=True, **{self._cache_kw: cache})
        logits = out.logits if hasattr(out, "logits") else out[0]
        k_new = torch.stack([k[:, :, -1] for k in cache.new_keys])
        v_new = torch.stack([v[:, :, -1] for v in cache.new_values])
        return logits[:, -1], k_new, v_new


def decode_example(model, batch: int = 2, s_max: int = 16, budget: int = 4):
    """Example inputs of :class:`DecodeStepForward` (``input_ids, cache_seqlens, indices, k_cache, v_cache``)."""
    cfg = model.config
    p = next(model.parameters())
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, batch, n_kv, s_max, d)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=p.device)
    lens = torch.tensor([s_max // 2 + i for i in range(batch)], dtype=torch.int32, device=p.device)
    idx = torch.arange(budget, dtype=torch.int32, device=p.device).expand(batch, n_kv, budget).contiguous()
    kc = torch.randn(shape, dtype=p.dtype, device=p.device)
    return ids, lens, idx, kc, torch.randn_like(kc)


def capture_decode_step(model: torch.nn.Module, max_cache_len: Optional[int] = None,
                        force_auto_dims: bool = False) -> Captured:
    """Export one decode step of ``model`` over an explicit static KV cache (:class:`DecodeStepForward`), dynamic
    batch, cache length ``S_max`` and budget.

    SpeContext (arXiv 2512.00722 §4.3) makes one selection per decode step, shared by every layer: the captured
    step takes it as the ``indices`` input. Before the sparse_decode pass the graph is dense attention over
    ``cat(k_cache[l], k_new)`` with a mask built from ``cache_seqlens`` (verifiable against HF); the pass proves that
    and rewrites each site. The captured module holds the model's own ``Parameter`` objects.

    Args:
        model: a transformers causal LM (eval mode), any dtype/device.
        max_cache_len: upper bound of the dynamic ``S_max`` (default the model's maximum positions).
        force_auto_dims: export with ``Dim.AUTO`` only (the fallback; for tests).

    Raises:
        RuntimeError: torch.export failed.
    """
    max_len = int(max_cache_len or max_positions(model))
    args = decode_example(model)
    batch = Dim("batch", min=1, max=MAX_BATCH)
    s_max = Dim("s_max", min=4, max=max_len)
    budget = Dim("budget", min=2, max=max_len)
    dyn = {"input_ids": {0: batch}, "cache_seqlens": {0: batch}, "indices": {0: batch, 2: budget},
           "k_cache": {1: batch, 3: s_max}, "v_cache": {1: batch, 3: s_max}}
    ep, gm = export_wrapped(model, DecodeStepForward(model), args, dyn, "decode step", ("k_cache", 3),
                            force_auto_dims, max_positions=max_len)  # (positions < S_max <= max_len)
    return Captured(gm, ep, max_len, DECODE_INPUTS)


class PrefillForward(torch.nn.Module):
    """Wrapper exported by :func:`capture_prefill`: the prompts of a batch packed on one token axis, each its own
    causal segment.

    ``(input_ids (1, T), position_ids (1, T), cu_seqlens (S+1,) int32, segment_prefix (S,) int32, logits_index (S,)
    int64) -> (logits (1, S, vocab) at the packed positions logits_index, k (L, 1, H_kv, T, D), v (same))``: the
    post-RoPE K/V of every layer, recorded by a cache whose ``update`` returns them unchanged. Before the dualkv
    pass the graph attends causally over the whole axis; the pass makes every attention per-segment
    (``kvt.dualkv_attention`` with no responses is varlen causal attention).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self._cache_kw = cache_kwarg(model)

    def forward(self, input_ids, position_ids, cu_seqlens, segment_prefix, logits_index):
        cache = _recording_cache()
        out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), position_ids=position_ids,
                         use_cache=True, logits_to_keep=logits_index, **{self._cache_kw: cache})
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits, torch.stack(cache.new_keys), torch.stack(cache.new_values)


def prefill_example(model):
    """Example inputs of :class:`PrefillForward`: three prompts of 5, 4 and 3 tokens."""
    device = next(model.parameters()).device
    lens = [5, 4, 3]
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lens)), device=device)
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32, device=device)
    sp = torch.full((3,), -1, dtype=torch.int32, device=device)
    last = (cu[1:] - 1).long()
    return ids, pos, cu, sp, last


def capture_prefill(model: torch.nn.Module, max_tokens: int = 1 << 20, force_auto_dims: bool = False) -> Captured:
    """Export the packed prefill (:class:`PrefillForward`), dynamic token count ``T`` and prompt count ``S``.

    Raises:
        RuntimeError: torch.export failed.
    """
    tok = Dim("tokens", min=2, max=int(max_tokens))
    seg = Dim("segments", min=2, max=int(max_tokens))
    seg1 = Dim("segments_plus_1", min=3, max=int(max_tokens) + 1)
    named = {"input_ids": {1: tok}, "position_ids": {1: tok}, "cu_seqlens": {0: seg1}, "segment_prefix": {0: seg},
             "logits_index": {0: seg}}
    # each prompt's positions restart at 0, and the runtime keeps prompt + new tokens within the model's positions
    ep, gm = export_wrapped(model, PrefillForward(model), prefill_example(model), named, "packed prefill",
                            ("input_ids", 1), force_auto_dims, max_positions=max_positions(model))
    return Captured(gm, ep, int(max_tokens), PREFILL_INPUTS)
