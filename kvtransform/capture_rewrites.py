"""Temporary, behaviour-preserving model rewrites that make ``torch.export`` capture possible (used by
:mod:`kvtransform.capture` around every export; each is undone when the export returns):

* dynamic-NTK RoPE runs as plain RoPE with its original frequencies, which is what it computes up to the model's
  original maximum length (:func:`_capturable_rope`);
* a tensor a forward caches on a module during the export (a fake tensor) is taken back out
  (:func:`no_fake_state_left`, around each export attempt);
* mixture-of-experts layers (Qwen3-MoE, gpt-oss) set to transformers' ``'eager'`` experts implementation, a Python
  loop over the experts the router hit (data-dependent control flow), run as ``'grouped_mm'`` (the same per-expert
  matmuls over tokens sorted by expert; transformers' default; on CPU the ``transformers::grouped_mm_fallback`` op,
  with its own autograd), or ``'batched_mm'`` where grouped_mm cannot dispatch (:func:`_capturable_experts`).

``KNOWN_BLOCKERS`` maps the function in which torch.export stopped (``KNOWN_BLOCKER_LINES``: a word of its source
line) to what to tell the user.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

__all__ = ["KNOWN_BLOCKER_LINES", "KNOWN_BLOCKERS", "capturable", "no_fake_state_left"]

_DYNAMIC_ROPE = "dynamic-NTK RoPE (config.rope_parameters['rope_type'] = 'dynamic')"
_ROPE_FIX = ("if your inputs stay within config.max_position_embeddings, where dynamic RoPE equals plain RoPE, set "
             "config.rope_parameters['rope_type'] = 'default' before transforming")
# features known to defeat torch.export, by the function that raises: what to tell the user
KNOWN_BLOCKERS = {
    "dynamic_frequency_update": f"{_DYNAMIC_ROPE} recomputes its frequencies from the input's largest position; "
                                f"kvtransform captures it only within config.max_position_embeddings",
}
# ... and by a word of the source line that stopped it
KNOWN_BLOCKER_LINES = {
    "expert": "a mixture-of-experts layer's experts loop (over the experts the router picked: data-dependent) cannot "
              "be captured; set model.set_experts_implementation('grouped_mm') or 'batched_mm' before transforming, "
              "or use kvt.integrations.transformers.enable(model, ...), which needs no capture",
}


@contextlib.contextmanager
def _capturable_rope(module: torch.nn.Module, max_positions: Optional[int], what: str):
    """Dynamic-NTK RoPE recomputes its frequencies from the largest position id, a data-dependent branch that
    torch.export cannot trace. Up to the model's original maximum length (``config.max_position_embeddings``) it is
    plain RoPE with the frequencies it was built with, so for the duration of the export every such rotary module
    runs as ``'default'`` RoPE with its original frequencies (the captured program accepts sequences up to that length
    only). A capture whose positions may exceed it (``max_positions`` above it, or ``None``: unbounded, as a packed
    axis) is refused by name with :class:`~kvtransform.capture.CaptureError`, before exporting."""
    from kvtransform.capture import CaptureError

    saved = []
    try:
        for m in module.modules():
            rope_type = getattr(m, "rope_type", None)
            types = rope_type if isinstance(rope_type, dict) else {None: rope_type}
            dynamic = [lt for lt, t in types.items() if isinstance(t, str) and "dynamic" in t]
            if not dynamic:
                continue
            limit = getattr(m, "original_max_seq_len", None)
            prefixes = ["" if lt is None else f"{lt}_" for lt in dynamic]
            if limit is None or any(not hasattr(m, f"{p}original_inv_freq") for p in prefixes):
                raise CaptureError(f"torch.export cannot capture {what}: {_DYNAMIC_ROPE} in {type(m).__name__} "
                                   f"recomputes its frequencies from the input's positions and this module keeps no "
                                   f"original frequencies to capture; {_ROPE_FIX}")
            if max_positions is None or max_positions > limit:
                need = "an unbounded position axis" if max_positions is None else f"{max_positions} positions"
                raise CaptureError(f"torch.export cannot capture {what}: {_DYNAMIC_ROPE} rescales its frequencies "
                                   f"past {limit} positions (config.max_position_embeddings) and this capture needs "
                                   f"{need}; kvtransform captures dynamic RoPE only up to that length (the canonical "
                                   f"transform does); {_ROPE_FIX}")
            saved.append((m, rope_type, {f"{p}inv_freq": getattr(m, f"{p}inv_freq") for p in prefixes}))
            m.rope_type = ({lt: ("default" if lt in dynamic else t) for lt, t in types.items()}
                           if isinstance(rope_type, dict) else "default")
            for p in prefixes:
                setattr(m, f"{p}inv_freq", getattr(m, f"{p}original_inv_freq").clone())
        yield
    finally:
        for m, rope_type, bufs in saved:
            m.rope_type = rope_type
            for name, b in bufs.items():
                setattr(m, name, b)


#: experts implementations torch.export captures (no data-dependent Python control flow), in order of preference
CAPTURABLE_EXPERTS = ("grouped_mm", "batched_mm")


@contextlib.contextmanager
def _capturable_experts(module: torch.nn.Module):
    """Run the model's mixture-of-experts layers with a capturable experts implementation for the duration of the
    export when they are set to ``'eager'`` (see the module docstring); a model without transformers'
    ``set_experts_implementation`` switch, or already on another implementation, is left as it is."""
    model = next((m for m in module.modules() if hasattr(m, "set_experts_implementation")
                  and getattr(getattr(m, "config", None), "_experts_implementation", None) is not None), None)
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if model is None or model.config._experts_implementation != "eager" or not (can_set and can_set()):
        yield
        return
    for impl in CAPTURABLE_EXPERTS:
        try:
            model.set_experts_implementation(impl)
            break
        except (ValueError, ImportError, RuntimeError):
            continue
    try:
        yield
    finally:
        model.set_experts_implementation("eager")


@contextlib.contextmanager
def capturable(module: torch.nn.Module, max_positions: Optional[int], what: str):
    """The RoPE and experts rewrites of the module docstring, for one export of ``module`` (a model, or a wrapper holding one).

    Raises:
        kvtransform.capture.CaptureError: dynamic RoPE that cannot be captured for ``max_positions``.
    """
    with _capturable_rope(module, max_positions, what), _capturable_experts(module):
        yield


@contextlib.contextmanager
def no_fake_state_left(module: torch.nn.Module):
    """torch.export runs the forward on fake tensors, so a forward that caches a tensor on a module (transformers'
    longrope RoPE keeps ``long_inv_freq``: Phi-3-128k / 3.5) leaves a fake tensor in the user's model, and every later
    export or forward fails ("fake mode ... doesn't match mode"). After the export each module attribute or buffer
    that holds a fake tensor gets its value from before the export back (or is removed, when it is new)."""
    from torch._subclasses.fake_tensor import FakeTensor

    before = [(m, dict(m.__dict__), dict(m._buffers)) for m in module.modules()]
    try:
        yield
    finally:
        for m, attrs, buffers in before:
            for store, old in ((m.__dict__, attrs), (m._buffers, buffers)):
                for name in [n for n, v in store.items() if isinstance(v, FakeTensor)]:
                    if name in old and not isinstance(old[name], FakeTensor):
                        store[name] = old[name]
                    else:
                        del store[name]
