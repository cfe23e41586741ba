"""KV offload for the SpeContext runtime (arXiv 2512.00722 §5–6): whole layers' KV in pinned CPU memory, elastic
loading into budget-sized GPU slot buffers, asynchronous prefetch on a side CUDA stream.

**How offloaded layers enter the decode program.** The runtime runs the decode step split per layer, which its
decode programs derive once (``layer_split``; ``passes/layer_split.py``): ``(input_ids, cache_seqlens, k_0, v_0,
idx_0, ..., k_{L-1}, v_{L-1}, idx_{L-1})``, one (cache, indices) triple per layer, no recapture with
``torch.export`` when a layer moves. A resident layer gets its GPU cache
``(batch, H_kv, capacity, D)`` and the selection; an offloaded layer gets its slot buffer ``(batch, H_kv, W, D)``
and the selection mapped to slots (``slot_of[b, h, j]``: the slot holding ``indices[b, h, j]``, ``-1`` padding). The
op gathers the same K/V rows in the same order as the resident path, so the two paths give bit-identical outputs.
Each offloaded layer's K input passes through a :class:`LayerReady` node, where the compute stream waits on that
layer's copy event just before the layer's attention.

**Elastic loading** (:class:`SlotMap`): per (row, KV head) the slots keep the positions still selected; positions
that entered the selection go to the lowest free slots; only those are copied (``kernels/elastic.py``: masked
loads, no traffic for the others). The same slot map serves every offloaded layer (one selection per step).
Occupied slots always lie below the row's length, so the op's ``index < cache_seqlens`` mask never drops one.

**Streams.** Per step (the same code eager and under a CUDA graph): head → slot-map update (compute stream) → the
side stream waits for it, copies the entering entries of every offloaded layer, records one event per layer →
the LLM step (resident layers compute while the copies run; the offloaded layers are the last ones, so their
waits come last) → append: new K/V of resident layers into their GPU cache, of offloaded layers into pinned CPU
memory (written by a GPU kernel through the unified-address view) → the compute stream joins the side stream.
That is the eager step. With CUDA graphs the step is captured as a whole
(:class:`~kvtransform.runtime.graph_step._GraphStep`, captured again after a layer move or growth:
:attr:`OffloadEngine.version`) and the elastic copies run on the capturing stream before the LLM step (capturing
the side stream's fork/join and per-layer waits failed with ``cudaErrorStreamCaptureIsolation``; BENCHMARKS.md,
SpeContext runtime).

**Layer moves** (:meth:`OffloadEngine.before_step`): resident layers are allocated for ``capacity`` tokens and grow
by ``chunk`` tokens; before growing to ``n`` the layers the :class:`~kvtransform.runtime.memory.MemoryPlan` puts
on CPU by length ``n`` move: their slots are filled from the GPU copy (device to device), their K/V is copied to
pinned memory on the side stream, and the GPU tensor is released to the allocator once that copy is done
(``record_stream``; no host wait). A move costs the step after it one layer's device-to-host copy on the side
stream.

**CPU stand-in** (no GPU): "GPU" tensors are CPU tensors, "pinned CPU" memory is another CPU tensor, the side
stream and the events are no-ops and the copies run :func:`~kvtransform.kernels.elastic.elastic_copy_reference`.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from kvtransform.kernels.elastic import elastic_copy_reference, elastic_copy_triton

from .cache import KVCache
from .host_memory import host_view, pinned_zeros
from ..utils import is_count
from .memory import HeadMemory, MemoryPlan, ModelMemory, plan_memory

__all__ = ["LayerReady", "SlotMap", "OffloadedKVCache", "OffloadEngine", "OFFLOAD_HEADS", "plan_inputs", "make_plan",
           "initial_capacity"]

#: Heads that never read the full cache of every layer (``quest``/``oracle`` read all layers' keys, ``dense``
#: selects the whole cache): the ones offload works with.
OFFLOAD_HEADS = ("recent", "self", "distilled", "eagle3")


class LayerReady(torch.nn.Module):
    """The module before an offloaded layer's attention: the current stream waits on the layer's copy event (set
    by :class:`OffloadEngine`; None = no wait: resident layer, or the CPU stand-in). Returns its input."""

    def __init__(self):
        super().__init__()
        self.event = None
        self.mark = None  # a timing event recorded just before the wait (eager timing of the first waiting layer)

    def forward(self, x):
        if self.mark is not None:
            self.mark.record(torch.cuda.current_stream())
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return x


class SlotMap:
    """Which cached position each GPU slot holds, per (row, KV head): ``slot_pos`` ``(batch, H_kv, W)`` int64,
    ``-1`` free. Shared by every offloaded layer (one selection per step, §4.3)."""

    def __init__(self, batch: int, num_kv_heads: int, width: int, s_max: int, device):
        self.slot_pos = torch.full((batch, num_kv_heads, width), -1, dtype=torch.long, device=device)
        self.width, self.s_max = width, s_max
        self._ar = torch.arange(width, device=device)

    def update(self, sel: torch.Tensor):
        """Advance to the selection ``sel`` ``(batch, H_kv, W)`` (positions, ``-1`` padding). Static shapes, no host
        synchronisation.

        Returns:
            ``(slot_of int32 (batch, H_kv, W), pos int64, slot int64, enter bool)``: the slot of each selected entry
            (``-1`` for padding), and for the entries that entered the selection (``enter``) the position to load
            and the slot it goes to.
        """
        sp, w, s1 = self.slot_pos, self.width, self.s_max + 1
        b, h, _ = sp.shape
        pos = sel.long()
        valid = pos >= 0
        member = torch.zeros(b, h, s1, dtype=torch.bool, device=sp.device)
        member.scatter_(2, (pos + 1).clamp(min=0), True)
        member[:, :, 0] = False
        keep = member.gather(2, sp + 1) & (sp >= 0)
        p2s = torch.full((b, h, s1), -1, dtype=torch.long, device=sp.device)
        p2s.scatter_(2, torch.where(keep, sp + 1, torch.zeros_like(sp)),
                     torch.where(keep, self._ar.expand_as(sp), torch.full_like(sp, -1)))
        p2s[:, :, 0] = -1
        cur = p2s.gather(2, (pos + 1).clamp(min=0))
        enter = valid & (cur < 0)
        order = (keep.long() * w + self._ar).argsort(dim=-1)  # free slots first, ascending
        rank = (enter.long().cumsum(-1) - 1).clamp(min=0)
        target = order.gather(2, rank)
        slot_of = torch.where(enter, target, torch.where(valid, cur, torch.full_like(cur, -1)))
        nxt = torch.cat([torch.where(keep, sp, torch.full_like(sp, -1)), sp.new_full((b, h, 1), -1)], dim=2)
        nxt.scatter_(2, torch.where(enter, target, torch.full_like(target, w)), torch.where(enter, pos, -1))
        self.slot_pos.copy_(nxt[:, :, :w])
        return slot_of.to(torch.int32), pos.clamp(min=0), target, enter


class _LayerStack:
    """What heads see as ``cache.k``/``cache.v`` of an :class:`OffloadedKVCache`: ``shape`` ``(L, batch, H_kv,
    S_max, D)``, ``device``, ``dtype``, and ``[l]`` = layer ``l``'s GPU cache (resident layers only)."""

    def __init__(self, cache: "OffloadedKVCache", which: int):
        # a weak reference: a strong one made a cycle, so a dropped cache (its GPU layers) lived until the cyclic
        # garbage collector ran, and the next generation's cache was allocated beside it (out of memory at
        # gpu_gb=79.1; BENCHMARKS.md, "Decode throughput")
        self._c, self._w = weakref.proxy(cache), which

    @property
    def shape(self):
        c = self._c
        return torch.Size((c.num_layers, c.batch, c.num_kv_heads, c.max_length, c.head_dim))

    @property
    def device(self):
        return self._c.cache_seqlens.device

    @property
    def dtype(self):
        return self._c.dtype

    def __getitem__(self, l):
        t = self._c.gpu[self._w][l]
        if t is None:
            raise ValueError(f"the retrieval head reads layer {l}'s KV cache, which is offloaded to CPU: offload works "
                             f"with heads that keep their own state ({', '.join(OFFLOAD_HEADS)}) and whose layers "
                             f"stay on the GPU; lower the batch or raise the GPU memory")
        return t


class OffloadedKVCache(KVCache):
    """Per-layer KV cache: resident layers ``gpu[0][l]``/``gpu[1][l]`` ``(batch, H_kv, capacity, D)`` on the GPU,
    offloaded layers ``host[0][l]``/``host[1][l]`` ``(batch, H_kv, max_length, D)`` in pinned CPU memory (None when
    resident) plus slot buffers ``slots[0][l]`` ``(batch, H_kv, W, D)``. ``cache_seqlens`` and ``token_ids`` as
    :class:`KVCache`; ``k``/``v`` are :class:`_LayerStack` views for the heads."""

    def __init__(self, num_layers, batch, num_kv_heads, max_length, head_dim, dtype, device, capacity):
        self.num_layers, self._batch, self.num_kv_heads, self._max_length = num_layers, batch, num_kv_heads, max_length
        self.head_dim, self.dtype, self.device, self.capacity = head_dim, dtype, torch.device(device), capacity
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.gpu = [[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)] for _ in range(2)]
        self.host = [[None] * num_layers, [None] * num_layers]
        self.host_view = [[None] * num_layers, [None] * num_layers]  # what GPU kernels address (UVA view)
        self.slots = [[None] * num_layers, [None] * num_layers]
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.token_ids = torch.zeros(batch, max_length, dtype=torch.long, device=device)
        self.k, self.v = _LayerStack(self, 0), _LayerStack(self, 1)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch(self) -> int:
        return self._batch

    @property
    def nbytes(self) -> int:
        """Bytes of K/V on the GPU now (resident layers and slot buffers)."""
        return sum(t.numel() * t.element_size() for part in (self.gpu, self.slots) for side in part for t in side
                   if t is not None)

    @property
    def offloaded(self) -> list:
        return [l for l in range(self.num_layers) if self.gpu[0][l] is None]

    def write_prompts(self, k, v, cu_seqlens, input_ids=None) -> None:
        lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(self.batch)]
        if max(lens) > self.capacity:
            raise ValueError(f"a prompt of {max(lens)} tokens does not fit the cache capacity {self.capacity}")
        for b, n in enumerate(lens):
            lo = cu_seqlens[b]
            for l in range(self.num_layers):
                self.gpu[0][l][b, :, :n] = k[l, 0, :, lo:lo + n]
                self.gpu[1][l][b, :, :n] = v[l, 0, :, lo:lo + n]
            if input_ids is not None:
                self.token_ids[b, :n] = input_ids[0, lo:lo + n]
        self.cache_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))

    def append(self, k_new, v_new) -> None:
        """New token per row ``(L, batch, H_kv, D)``: resident layers into their GPU cache, offloaded layers into
        pinned CPU memory (through the unified-address view on CUDA). No host synchronisation."""
        rows = torch.arange(self.batch, device=self.device)
        pos = self.cache_seqlens.to(torch.long)
        for l in range(self.num_layers):
            for w, new in ((0, k_new), (1, v_new)):
                dst = self.gpu[w][l] if self.gpu[w][l] is not None else self.host_view[w][l]
                dst[rows, :, pos.clamp(max=dst.shape[2] - 1)] = new[l].to(dst.dtype)
        self.cache_seqlens.add_(1)


class OffloadEngine:
    """Owns the offload state of one generation: the plan, the cache, the slot map, streams and events, counters.

    Args:
        cache: :class:`OffloadedKVCache`. plan: :class:`~kvtransform.runtime.memory.MemoryPlan` (thresholds in
        tokens). width: the selection width ``W`` (tokens per KV head). chunk: resident capacity growth (tokens).
        graph: the decode step split per layer (the decode programs' ``layer_split(LayerReady)``).
    """

    def __init__(self, cache: OffloadedKVCache, plan: MemoryPlan, width: int, chunk: int, graph):
        self.cache, self.plan, self.width, self.chunk, self.graph = cache, plan, width, chunk, graph
        dev = cache.device
        self.cuda = dev.type == "cuda"
        self.slotmap = SlotMap(cache.batch, cache.num_kv_heads, width, cache.max_length, dev)
        self.side = torch.cuda.Stream(device=dev) if self.cuda else None
        self.events = [torch.cuda.Event() if self.cuda else None for _ in range(cache.num_layers)]
        self.version = 0
        self.entered = []       # per step: 0-dim tensors, entries copied per offloaded layer
        self.n_offloaded = []   # per step: layers offloaded (host int)
        self.moves = []         # (decode step, length, layer)
        self.timing = []        # CUDA eager: (copy start, copy end, step start, step end) events
        self.record_timing = False
        self._open = None
        self._entered_now = torch.zeros((), dtype=torch.long, device=dev)
        self.step = 0
        self.length = int(cache.cache_seqlens.max())

    # ---- layer moves (host side, between steps) ---------------------------------------------------------------
    def _alloc_host(self, l):
        c = self.cache
        shape = (c.batch, c.num_kv_heads, c.max_length, c.head_dim)
        for w in (0, 1):
            if c.host[w][l] is None:
                c.host[w][l] = pinned_zeros(shape, c.dtype) if self.cuda else torch.zeros(shape, dtype=c.dtype)
                c.host_view[w][l] = host_view(c.host[w][l], c.device)

    def preallocate(self):
        """Pinned CPU memory for every layer the plan offloads by ``max_length`` (before decoding starts)."""
        for l in self.plan.offloaded_at(self.cache.max_length):
            self._alloc_host(l)

    def _offload(self, l):
        c, n = self.cache, self.length
        self._alloc_host(l)
        width = self.width
        shape = (c.batch, c.num_kv_heads, width, c.head_dim)
        sp = self.slotmap.slot_pos
        idx = sp.clamp(min=0)[..., None].expand(*sp.shape, c.head_dim)
        for w in (0, 1):
            src = c.gpu[w][l]
            slots = torch.zeros(shape, dtype=c.dtype, device=c.device)
            slots.copy_(torch.where((sp >= 0)[..., None], src.gather(2, idx), torch.zeros((), dtype=c.dtype,
                                                                                           device=c.device)))
            c.slots[w][l] = slots
            if self.cuda:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    for b in range(c.batch):
                        for h in range(c.num_kv_heads):
                            c.host[w][l][b, h, :n].copy_(src[b, h, :n], non_blocking=True)
                src.record_stream(self.side)
            else:
                c.host[w][l][:, :, :n].copy_(src[:, :, :n])
            c.gpu[w][l] = None
        self.moves.append((self.step, n, l))

    def _grow(self, capacity):
        c = self.cache
        for w in (0, 1):
            for l in range(c.num_layers):
                old = c.gpu[w][l]
                if old is not None:
                    new = torch.zeros((c.batch, c.num_kv_heads, capacity, c.head_dim), dtype=c.dtype,
                                      device=c.device)
                    new[:, :, :old.shape[2]].copy_(old)
                    c.gpu[w][l] = new
                    del old
        c.capacity = capacity

    def resume_at(self, length: int, room: int = 0) -> None:
        """Put this fresh engine where a generation stands at ``length`` tokens per row, without holding an
        offloaded layer on the GPU on the way (the decode suite times offloaded steps at sampled lengths of a long
        run: :mod:`kvtransform.bench.decode_ours`): resident layers with capacity :func:`initial_capacity` of
        ``length + room`` (``room``: steps to decode before the next growth), the layers the plan has on CPU by that
        capacity in pinned memory with empty slots (the first step loads its whole selection, as the step after a
        move does), ``cache_seqlens`` = ``length``. Pinned buffers already in ``cache.host`` are used, not
        allocated again. The K/V values are the caller's to write (``cache.gpu`` and ``cache.host``, positions below
        ``length``).

        Raises:
            ValueError: ``length`` outside ``[1, cache.max_length)``, a negative ``room``, or an engine that has
                already stepped.
        """
        c = self.cache
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length < c.max_length:
            raise ValueError(f"length must be an int in [1, {c.max_length}) (the cache's max_length); got {length!r}")
        if not is_count(room, 0):
            raise ValueError(f"room must be an int >= 0 (tokens); got {room!r}")
        if self.step or self.moves:
            raise ValueError("resume_at needs a fresh engine (this one has already stepped or moved layers)")
        capacity = initial_capacity(self.plan, length + room, c.max_length, self.chunk)
        for l in self.plan.offloaded_at(capacity):
            self._alloc_host(l)
            for w in (0, 1):
                c.slots[w][l] = torch.zeros((c.batch, c.num_kv_heads, self.width, c.head_dim), dtype=c.dtype,
                                            device=c.device)
                c.gpu[w][l] = None
        self._grow(capacity)
        c.cache_seqlens.fill_(length)
        self.length = length
        self.version += 1

    def before_step(self) -> None:
        """Called before each decode step (host side): move the layers the plan puts on CPU and grow the resident
        capacity when the next token would not fit. Bumps :attr:`version` when the program's inputs change."""
        c = self.cache
        changed = False
        due = [l for l in self.plan.offloaded_at(self.length) if c.gpu[0][l] is not None]
        if self.length + 1 > c.capacity:
            target = min(c.max_length, c.capacity + self.chunk)
            due = sorted(set(due) | {l for l in self.plan.offloaded_at(target) if c.gpu[0][l] is not None})
            for l in sorted(due, reverse=True):
                self._offload(l)
            due = []
            self._grow(target)
            changed = True
        for l in sorted(due, reverse=True):
            self._offload(l)
            changed = True
        if changed:
            self.version += 1

    # ---- the step body (static shapes: eager or under CUDA-graph capture) -------------------------------------
    def layer_args(self, sel: torch.Tensor) -> list:
        """The split program's per-layer inputs for selection ``sel``; issues the elastic copies of every
        offloaded layer on the side stream (one event per layer) and arms the layers' waits."""
        c = self.cache
        off = c.offloaded
        args = []
        if off:
            if sel.shape[-1] != self.width:
                raise ValueError(f"the head selected {sel.shape[-1]} tokens per KV head but the slot buffers hold "
                                 f"{self.width}: offload needs a head with a fixed budget ({', '.join(OFFLOAD_HEADS)})")
            slot_of, pos, slot, enter = self.slotmap.update(sel)
            self._copy(off, pos, slot, enter)
            self._entered_now.copy_(enter.sum())
        side = self._uses_side_stream()
        for l in range(c.num_layers):
            ready = getattr(self.graph, f"ready_{l}")
            ready.mark = self._open[2] if (self._open is not None and off and l == min(off)) else None
            if c.gpu[0][l] is not None:
                ready.event = None
                args += [c.gpu[0][l], c.gpu[1][l], sel]
            else:
                ready.event = self.events[l] if side else None
                args += [c.slots[0][l], c.slots[1][l], slot_of]
        return args

    def _uses_side_stream(self) -> bool:
        """Whether this step's copies run on the side stream: on CUDA, outside CUDA-graph capture. Under capture
        they run on the capturing stream, before the step's LLM work (the side stream's fork/join and per-layer
        waits could not be captured: ``cudaErrorStreamCaptureIsolation``, BENCHMARKS.md): the copies no longer overlap
        the resident layers, but the step is one graph replay instead of ~100 eager launches per layer."""
        return self.cuda and not torch.cuda.is_current_stream_capturing()

    def _copy(self, layers, pos, slot, enter):
        c = self.cache
        if not self.cuda:
            for l in layers:
                elastic_copy_reference(c.host[0][l], c.host[1][l], c.slots[0][l], c.slots[1][l], pos, slot, enter)
            return
        if not self._uses_side_stream():  # captured: in stream order, before the layers that read the slots
            for l in sorted(layers):
                elastic_copy_triton(c.host_view[0][l], c.host_view[1][l], c.slots[0][l], c.slots[1][l], pos, slot,
                                    enter)
            return
        cur = torch.cuda.current_stream()
        self.side.wait_stream(cur)
        timing = self.record_timing and not torch.cuda.is_current_stream_capturing()
        if timing:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # copy start/end, first wait, step end
        with torch.cuda.stream(self.side):
            if timing:
                ev[0].record(self.side)
            for l in sorted(layers):  # ascending: the first offloaded layer's attention comes first
                elastic_copy_triton(c.host_view[0][l], c.host_view[1][l], c.slots[0][l], c.slots[1][l], pos, slot,
                                    enter)
                self.events[l].record(self.side)
            if timing:
                ev[1].record(self.side)
        if timing:
            self.timing.append(ev)
            self._open = ev

    def after_step(self) -> None:
        """The compute stream joins the side stream (end of the step body; nothing to join under capture)."""
        if self._uses_side_stream():
            cur = torch.cuda.current_stream()
            if self._open is not None:
                self._open[3].record(cur)
                self._open = None
            cur.wait_stream(self.side)

    def advance(self) -> None:
        """Host bookkeeping after a step: one token more per row."""
        self.n_offloaded.append(len(self.cache.offloaded))
        if self.cache.offloaded:
            self.entered.append(self._entered_now.clone())
        self.length += 1
        self.step += 1

    # ---- counters -----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for :class:`~kvtransform.runtime.outputs.GenerationStats` (bytes, fractions; host sync)."""
        c = self.cache
        row = 2 * c.head_dim * torch.empty((), dtype=c.dtype).element_size()  # K+V bytes of one entry
        full = c.batch * c.num_kv_heads * self.width * row
        steps = [k for k in self.n_offloaded if k > 0]
        moved = [int(e) * k * row for e, k in zip(self.entered, steps)]
        hidden = None
        if self.timing:
            torch.cuda.synchronize()
            fr = []
            for c0, c1, w0, _ in self.timing:
                copy_ms = c0.elapsed_time(c1)
                if copy_ms > 0:  # exposed: copy time left when compute reached the first offloaded layer's wait
                    fr.append(1.0 - min(max(0.0, w0.elapsed_time(c1)), copy_ms) / copy_ms)
            hidden = sum(fr) / len(fr) if fr else None
        return {"offload_bytes_per_step": moved,
                "offload_full_bytes_per_step": [k * full for k in steps],
                "offload_layers_per_step": list(self.n_offloaded),
                "offload_moves": list(self.moves),
                "offload_copy_hidden": hidden,
                "offload_plan": [t for t in self.plan.thresholds]}


def plan_inputs(runtime) -> tuple[ModelMemory, HeadMemory]:
    """What the memory model counts for ``runtime``: the decode program's parameters and fused projection copies
    (built now), the retrieval head's state, its own key cache per token and the layers whose cache it reads."""
    info = runtime.info
    params = {id(p): p for p in runtime.decode_fn.parameters()} if hasattr(runtime.decode_fn, "parameters") else {}
    runtime.programs.fused()  # + the fused projection copies (built now: the offloaded split runs them; the
    weight = sum(p.numel() * p.element_size() for p in params.values()) + runtime.programs.fused_bytes()  # shared
    # fused weights, the default, are the parameters themselves: no bytes)
    e = torch.empty((), dtype=getattr(torch, info.dtype)).element_size()
    mm = ModelMemory(weight, info.num_layers, info.num_kv_heads, info.head_dim, e)
    read = [l for l in getattr(runtime.head, "LAYERS", ()) if l < info.num_layers]  # layers whose cache it reads
    # heads with their own key cache (self / distilled / eagle3: (batch, H_kv, S_max, D) in the model's dtype)
    keys = info.num_kv_heads * info.head_dim * e if "keys" in getattr(runtime.head, "REQUEST_STATE", ()) else 0
    state = [t for t in runtime.head.state_dict().values() if isinstance(t, torch.Tensor)]
    return mm, HeadMemory(sum(t.numel() * t.element_size() for t in state), keys, max(read) + 1 if read else 0)


def make_plan(runtime, batch: int, input_len: int, output_len: int, gpu_bytes: Optional[int]) -> MemoryPlan:
    """The :class:`MemoryPlan` for a generation of ``runtime`` (:func:`plan_inputs`) in ``gpu_bytes`` (default on
    CUDA: free memory now plus what is already allocated).

    Raises:
        ValueError: no ``gpu_bytes`` on the CPU stand-in, a ``gpu_bytes`` or ``runtime.offload_chunk`` that is not
            an integer >= 1, or a batch that does not fit (see :func:`plan_memory`).
    """
    if not is_count(runtime.offload_chunk, 1, numpy=True):
        raise ValueError(f"runtime.offload_chunk={runtime.offload_chunk!r} must be an integer >= 1 (tokens)")
    if gpu_bytes is not None and not is_count(gpu_bytes, 1, numpy=True):
        raise ValueError(f"runtime.gpu_memory_bytes={gpu_bytes!r} must be an integer >= 1 (bytes; None: on CUDA, "
                         f"the free memory at the start)")
    mm, head = plan_inputs(runtime)
    if gpu_bytes is None:
        if not torch.cuda.is_available():
            raise ValueError("offload on CPU tensors needs the GPU memory to plan for: set "
                             "runtime.gpu_memory_bytes (bytes)")
        free, _ = torch.cuda.mem_get_info()
        gpu_bytes = int(free + torch.cuda.memory_allocated())
    return plan_memory(mm, head, gpu_bytes=int(gpu_bytes), batch=batch, input_len=input_len, output_len=output_len,
                       budget=int(runtime.head.budget))


def initial_capacity(plan: MemoryPlan, longest: int, max_length: int, chunk: int) -> int:
    """Resident capacity after the prefill: the prompt plus one chunk (tokens), at most ``max_length``."""
    return min(max_length, int(math.ceil((longest + 1) / chunk)) * chunk)
