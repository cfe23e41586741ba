"""The SpeContext decode step as one CUDA graph (SpeContext, arXiv 2512.00722 §5: the retrieval head and the LLM step
replayed together per token)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .cache import KVCache

if TYPE_CHECKING:  # pragma: no cover
    from .generate import SpeContextRuntime

__all__ = ["_GraphStep"]


class _GraphStep:
    """The whole decode step -- ``head.step`` → LLM step → K/V append -- captured in one ``torch.cuda.CUDAGraph``
    for this batch and cache, replayed per token. Inputs live in static buffers (``tokens``, ``q``, the cache and
    its ``cache_seqlens``, which the graph advances itself); the head runs inside the graph on the replayed
    tensors, so a replay selects exactly what eager would for the same state (no value is baked in at capture).
    The warm-up step on a side stream writes K/V at position ``cache_seqlens`` and is undone by restoring
    ``cache_seqlens`` (the next real step overwrites that slot)."""

    def __init__(self, runtime: SpeContextRuntime, cache: KVCache, engine=None):
        self.rt, self.cache, self.engine = runtime, cache, engine
        self.version = None
        dev = cache.k.device
        self.tokens = torch.zeros(cache.batch, dtype=torch.long, device=dev)
        self.q: Optional[torch.Tensor] = None  # set by the caller after the first (eager) step
        self.graph = None

    def _capture(self):
        cache = self.cache
        self.graph = None  # release the previous graph (and its memory pool) before capturing again
        saved = cache.cache_seqlens.clone()
        saved_q = self.q.clone()
        eng = self.engine
        saved_slots = eng.slotmap.slot_pos.clone() if eng is not None else None
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._body()  # warm-up (allocations, Triton autotune/compile)
        torch.cuda.current_stream().wait_stream(s)
        cache.cache_seqlens.copy_(saved)
        self.q.copy_(saved_q)
        if eng is not None:  # the warm-up's copies are redone (same slots, same data) by the first replay
            eng.slotmap.slot_pos.copy_(saved_slots)
            # A layer move's device-to-host copy (side stream) must be done before the graph's elastic copies read
            # that layer's pinned memory. Captures happen only when a layer moves or the cache grows: a rare wait.
            torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._body()
        cache.cache_seqlens.copy_(saved)  # capture does not run kernels; keep state exact anyway
        self.q.copy_(saved_q)
        if eng is not None:
            eng.slotmap.slot_pos.copy_(saved_slots)
            self.version = eng.version

    def _body(self):
        self.cache.set_current(self.tokens)
        sel = self.rt.head_step(self.cache, self.q)
        logits, q = self.rt.decode(self.cache, self.tokens, sel, self.engine)
        self.q.copy_(q)
        return logits, sel

    def __call__(self, tokens: torch.Tensor):
        self.tokens.copy_(tokens)
        if self.graph is None or (self.engine is not None and self.engine.version != self.version):
            self._capture()
        self.graph.replay()
        logits, sel = self.out
        return logits, sel
