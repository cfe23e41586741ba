"""The SpeContext generation loop (arXiv 2512.00722 §4–5): packed prefill into a static KV cache, then one decode
step per token: retrieval head → ``indices`` → the rewritten LLM step (every attention is
``kvt::sparse_decode_attention``) → append K/V → sample.

Semantics follow Hugging Face ``generate``: a batch of prompts of different lengths (left padding, or any 0/1
``attention_mask``: the real tokens of each row are its prompt), greedy by default or sampling with
``temperature``/``top_k``/``top_p`` (transformers' own logits warpers; unlike HF's ``generate``, which fills what is
not passed from the model's ``generation_config`` and else ``top_k=50``, what is not passed is off: the model's own
distribution, which an RL trainer's log-probs assume; pass them to match HF), per-row stop at EOS (finished rows are
filled with the pad id), ``(batch, prompt + new)`` ids returned. On CUDA with ``cuda_graphs`` the whole decode
step -- retrieval head and LLM -- is captured once per batch and replayed (:mod:`.graph_step`).

The loop runs programs it is handed and never derives one: the transform gives it an object that owns the captured
decode step and its variants (gather, slot mode, fused projections, the per-layer split of KV offload;
:mod:`.programs` lists what the loop calls). Sampling is in :mod:`.sampling`, request checks in :mod:`.requests`,
stats and outputs in :mod:`.outputs` (``docs/ARCHITECTURE.md``, floor "runtime").
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Optional, Sequence, Union

import torch

from ..utils import is_count
from .cache import KVCache
from .graph_step import _GraphStep
from .heads import RetrievalHead
from .outputs import GenerateOutput, GenerationStats, ModelInfo, _checksum, _count_new, _overlap, _trim
from .programs import CallableDecode
from .requests import _as_eos, _check_decode_from, _check_request, _pad_id, _plain, _prompt_rows
from .sampling import _greedy, _sampler

__all__ = ["SpeContextRuntime", "GenerateOutput", "GenerationStats", "ModelInfo", "_GraphStep", "_sampler",
           "_checksum"]


class SpeContextRuntime:
    """Prefill + decode loop around two programs and a retrieval head.

    Args:
        prefill: ``(input_ids (1, T), position_ids (1, T), cu_seqlens (S+1,) int32, segment_prefix (S,) int32,
            logits_index (S,) int64) -> (logits (1, S, vocab), k (L, 1, H_kv, T, D), v)`` (packed prompts, each its
            own causal segment; ``S >= 2``).
        decode: the decode programs (``kvtransform.passes.programs.DecodePrograms``, which the SpeContext transform
            builds: the captured step and every variant derived from it; :mod:`.programs` lists what the loop calls),
            or a plain callable step ``(input_ids (B, 1), cache_seqlens (B,) int32, indices (B, H_kv, W) int32,
            k_cache, v_cache) -> (logits (B, vocab), k_new (L, B, H_kv, D), v_new, queries (L, B, H, D))``, run as
            it is (gather mode over the head's indices, nothing fused, no offload).
        head: the :class:`~kvtransform.runtime.heads.RetrievalHead`.
        info: :class:`ModelInfo`.
        cuda_graphs: capture the decode step in a CUDA graph when the tensors are on CUDA.
        compile: on CUDA, run the decode program through ``torch.compile`` (Inductor fuses the norms, RoPE, SwiGLU
            and residuals around the opaque ``kvt`` ops; compiled once per batch size and cache length, before
            the CUDA graph is captured; ``generate`` rounds the cache length up to a bucket, :meth:`cache_length`),
            and the retrieval head's step too (:meth:`head_step`: its block, RoPE, key write and selection become a
            few fused kernels around the scoring kernel). Offloaded steps run the per-layer split program uncompiled.
        fuse_projections: ``"qkv"``, ``"all"`` or ``"none"``: the decode program's sibling projections fused into
            one GEMM each (the model's parameters become views of the fused weights, or, with
            :attr:`share_fused_weights` off or where they cannot, a copy refreshed when the originals change;
            ``docs/ARCHITECTURE.md``, floor "passes", ``fuse_projections.py``); None keeps the setting of
            ``decode``.
        share_fused_weights: see the attribute; None keeps the setting of ``decode``.
        offload: move layers' KV to CPU during decoding when the memory model says so (:mod:`.offload`, §5–6).

    Attributes:
        programs: the decode programs (``decode``, or :class:`~.programs.CallableDecode` around a callable).
        gpu_memory_bytes: the GPU memory offload plans for (bytes; None: on CUDA the free memory at the start of
            ``generate`` plus what is already allocated; required on the CPU stand-in).
        offload_chunk: tokens by which resident layers' caches grow (layer moves happen at these boundaries).
        offload_timing: record CUDA timing events around the copies and steps (eager decode only) for
            ``GenerationStats.offload_copy_hidden``.
        share_fused_weights: fused projections take the place of the model's parameters (they become views of the
            fused weights: no extra memory) rather than being a copy (``SpeContextConfig.share_fused_weights``).
            Setting it drops the derived programs; parameters that an earlier shared fusion already turned into
            views stay views.
    """

    RECOMPILE_LIMIT = 64  # static compiles kept per decode program (see _decode_program)

    def __init__(self, prefill: Callable, decode, head: RetrievalHead, info: ModelInfo,
                 cuda_graphs: bool = True, offload: bool = False, compile: bool = False,
                 fuse_projections: Optional[str] = None, share_fused_weights: Optional[bool] = None):
        self.prefill_fn, self.head, self.info = prefill, head, info
        self.programs = decode if callable(getattr(decode, "layer_split", None)) else CallableDecode(decode)
        self.cuda_graphs = bool(cuda_graphs)
        self.compile = bool(compile)
        if share_fused_weights is not None:
            self.share_fused_weights = share_fused_weights
        if fuse_projections is not None:
            self.fuse_projections = fuse_projections
        self._compiled: dict = {}  # slot mode -> (program, its torch.compile)
        self._head_compiled = None  # (head, head.step through torch.compile) (compile on CUDA)
        self.offload = bool(offload)
        self.gpu_memory_bytes: Optional[int] = None
        self.offload_chunk = 1024
        self.offload_timing = False

    @property
    def decode_fn(self) -> Callable:
        """The captured decode step (``programs.source``)."""
        return self.programs.source

    # ---- validation ------------------------------------------------------------------------------------------
    def _rows(self, input_ids, attention_mask) -> list:
        """:func:`~.requests._prompt_rows` for this model's vocabulary."""
        return _prompt_rows(input_ids, attention_mask, self.info.vocab_size)

    # ---- the two programs ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, rows: Sequence[torch.Tensor], max_length: int, device, capacity: Optional[int] = None
                ) -> tuple[KVCache, torch.Tensor]:
        """Run the packed prefill of ``rows`` (1-D prompts), write their K/V into a new cache of ``max_length``
        tokens per row (an :class:`~.offload.OffloadedKVCache` with resident layers of ``capacity`` tokens when
        given). Returns ``(cache, logits (batch, vocab))`` of each prompt's last token. Inference only (no autograd:
        a model whose weights require grad would otherwise keep every layer's activations, ~3.5 MB per token at
        Llama-8B shapes)."""
        info = self.info
        seqs = list(rows)
        if len(seqs) == 1:  # the captured prefill takes >= 2 segments: add a 1-token dummy prompt
            seqs.append(torch.zeros(1, dtype=torch.long))
        seg_lens = [int(r.numel()) for r in seqs]
        cu = [0, *itertools.accumulate(seg_lens)]
        ids = torch.cat(seqs).to(device=device, dtype=torch.long)[None]
        pos = torch.cat([torch.arange(n) for n in seg_lens]).to(device)[None]
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        sp = torch.full((len(seqs),), -1, dtype=torch.int32, device=device)
        last = (cu_t[1:] - 1).long()
        logits, k, v = self.prefill_fn(ids, pos, cu_t, sp, last)
        if capacity is None:
            cache = KVCache.allocate(info.num_layers, len(rows), info.num_kv_heads, max_length, info.head_dim,
                                     k.dtype, device)
        else:
            from .offload import OffloadedKVCache

            cache = OffloadedKVCache(info.num_layers, len(rows), info.num_kv_heads, max_length, info.head_dim,
                                     k.dtype, device, capacity)
        cache.write_prompts(k, v, cu, ids)
        return cache, logits[0, :len(rows)]

    @torch.no_grad()
    def decode(self, cache: KVCache, tokens: torch.Tensor, indices: torch.Tensor, engine=None,
               slot: Optional[bool] = None):
        """One decode step for ``tokens`` ``(batch,)``: the LLM step over ``indices``, then append K/V (with an
        :class:`~.offload.OffloadEngine`: per-layer inputs, elastic copies on the side stream, offloaded layers'
        new K/V to CPU). With a head whose ``slot_mode`` is set (``dense``) and no engine, ``indices`` is not read:
        every layer attends to each row's whole cache (the slot-mode program, :meth:`_decode_program`); ``slot``
        False forces the gather program over ``indices`` (True: slot mode where the program allows it). In gather
        mode the selection is passed sorted by position (once per step, shared by every layer): each layer's gather
        reads the cache in address order (H200, budget 2048 of ~35K positions: 6-12 % faster gathers at 26-49
        requests); the attention does not depend on the order. Returns
        ``(logits (batch, vocab), queries (L, batch, H, D))``."""
        if engine is None:
            slot = self._slot_mode(slot)
            logits, k_new, v_new, q = self._decode_program(cache.k.device, slot)(
                tokens[:, None], cache.cache_seqlens, cache.cache_seqlens if slot else
                torch.sort(indices, dim=-1).values, cache.k, cache.v)
        else:  # the same position order as resident decode: each layer sums its tokens in the same order
            args = engine.layer_args(torch.sort(indices, dim=-1).values)
            logits, k_new, v_new, q = engine.graph(tokens[:, None], cache.cache_seqlens, *args)
        cache.append(k_new, v_new)
        if engine is not None:
            engine.after_step()
        return logits, q

    def head_step(self, cache: KVCache, queries: Optional[torch.Tensor]) -> torch.Tensor:
        """The retrieval head's selection for the coming step (:meth:`RetrievalHead.step
        <kvtransform.runtime.heads.RetrievalHead.step>`; int32 ``(batch, H_kv, budget)``), through ``torch.compile``
        when :attr:`compile` is set and the cache is resident on CUDA (one compile per batch, cache length and
        whether ``queries`` is given; Triton kernels the head launches are traced as they are). A head with nothing
        to compute (``dense``, slot mode) or over an offloaded cache (per-layer views) is called as it is."""
        if not (self.compile and isinstance(cache.k, torch.Tensor) and cache.k.is_cuda) or \
                getattr(self.head, "slot_mode", False):
            return self.head.step(cache, queries)
        if self._head_compiled is None or self._head_compiled[0] is not self.head:  # (a replaced head: again)
            self._raise_recompile_limit()
            self._head_compiled = (self.head, torch.compile(self.head.step, dynamic=False))
        return self._head_compiled[1](cache, queries)

    def cache_length(self, needed: int, device) -> int:
        """Tokens per row of the KV cache ``generate`` allocates for ``needed`` (longest prompt + ``max_new_tokens``):
        ``needed``, or with :attr:`compile` on CUDA (no :attr:`offload`) ``needed`` rounded up to a multiple of 1/8 of
        its power of two, at least 256 (9,000 -> 9,216; 17,000 -> 18,432; 100 -> 256), so requests of nearby lengths
        (a GRPO run's rollouts) reuse one compiled program instead of ~30 s of compiling each; at most 1/8 more KV
        memory and page scoring from 2,048 tokens up. Positions past ``needed`` are never written or attended to and
        the heads size their state from ``max_new_tokens``: the bucket changes no selection (tested per head).

        Raises:
            ValueError: ``needed`` is not an integer >= 1."""
        if not is_count(needed, 1):
            raise ValueError(f"cache_length needs the tokens a row must hold, an integer >= 1; got {needed!r}")
        if not (self.compile and not self.offload and torch.device(device).type == "cuda"):
            return needed
        step = max(256, (1 << (needed.bit_length() - 1)) // 8)
        return -(-needed // step) * step

    def _raise_recompile_limit(self) -> None:
        """One static compile per (batch, cache length, indices width): a sweep or a server sees more than dynamo's
        default 8 per code object, and past it dynamo would silently run the program eagerly."""
        from torch._dynamo import config as cfg

        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, key):
                setattr(cfg, key, max(int(getattr(cfg, key)), self.RECOMPILE_LIMIT))

    def _slot_mode(self, want: Optional[bool] = None) -> bool:
        """Whether the step runs the slot-mode program: ``want`` (None: the head's ``slot_mode``) and the programs
        have a slot-mode variant (a plain callable ``decode`` keeps gather mode over the head's indices)."""
        want = getattr(self.head, "slot_mode", False) if want is None else want
        return bool(want) and self.programs.slot_capable

    @property
    def fuse_projections(self) -> str:
        """``"qkv"``, ``"all"`` or ``"none"`` (see the class docstring); setting it drops the derived programs (slot
        variant, compiled programs), which are rebuilt on the next step."""
        return self.programs.fuse_projections

    @fuse_projections.setter
    def fuse_projections(self, which: str) -> None:
        self.programs.fuse_projections = which

    @property
    def share_fused_weights(self) -> bool:
        """See the class docstring."""
        return self.programs.share_fused_weights

    @share_fused_weights.setter
    def share_fused_weights(self, share: bool) -> None:
        self.programs.share_fused_weights = share

    @property
    def slot_rewrite(self) -> Optional[Callable]:
        """``GraphModule -> GraphModule`` applied to the slot-mode program each time it is derived (None: none),
        e.g. the decode benchmark's ``flashinfer`` method, which swaps the attention kernel
        (:func:`kvtransform.bench.flashinfer_decode.flashinfer_program`). Setting it drops the derived programs;
        it survives a change of :attr:`fuse_projections`."""
        return self.programs.slot_rewrite

    @slot_rewrite.setter
    def slot_rewrite(self, fn: Optional[Callable]) -> None:
        self.programs.slot_rewrite = fn

    def _fused(self):
        """The decode program's fused projections (``programs.fused()``; None: not fused)."""
        return self.programs.fused()

    def _decode_program(self, device, slot: bool = False) -> Callable:
        """The program of one step (``programs.program(slot)``: fused per :attr:`fuse_projections`, ``slot``: its
        slot-mode variant, whose ``indices`` input is unused), through ``torch.compile`` when :attr:`compile` is
        set and ``device`` is CUDA (compiled again when the programs hand out another one)."""
        fn = self.programs.program(slot)
        if not (self.compile and torch.device(device).type == "cuda"):
            return fn
        done = self._compiled.get(slot)
        if done is None or done[0] is not fn:
            self._raise_recompile_limit()
            done = self._compiled[slot] = (fn, torch.compile(fn, dynamic=False, fullgraph=True))
        return done[1]

    def _offload_engine(self, rows, max_new_tokens, device):
        """The :class:`~.offload.OffloadEngine` plan of this request, or None when no layer needs to move.

        Raises:
            ValueError: a head that reads every layer's cache, no GPU memory size on the CPU stand-in, a batch that
                does not fit even with every layer on CPU."""
        from .offload import OFFLOAD_HEADS, make_plan

        if self.head.name not in OFFLOAD_HEADS:
            raise ValueError(f"offload needs a retrieval head that keeps its own state; head {self.head.name!r} "
                             f"reads every layer's cache: use head= one of {', '.join(OFFLOAD_HEADS)}")
        longest = max(int(r.numel()) for r in rows)
        plan = make_plan(self, len(rows), longest, max_new_tokens, self.gpu_memory_bytes)
        return plan if plan.needs_offload else None

    # ---- generation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Union[int, Sequence[int], None] = "default", pad_token_id: Optional[int] = None,
                 seed: Optional[int] = None, device=None, progress: Optional[bool] = None,
                 output_logprobs: bool = False) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` per row (HF ``generate`` semantics; see the module docstring).

        Args:
            input_ids: int ``(batch, seq)``; attention_mask: 0/1 ``(batch, seq)`` (default all ones).
            eos_token_id: an id or a list (``"default"``: the model's generation config; None: never stop).
            pad_token_id: id written after a row's EOS (default: the model's pad id, else its first EOS id, else 0).
            do_sample: a bool; False (greedy) ignores ``temperature``/``top_k``/``top_p`` as HF does (temperature
                may then be any number, e.g. 0, or None); True needs a finite temperature > 0.
            seed: seed of the sampling generator (``do_sample``).
            device: the programs' device. progress: a tqdm bar over decode steps (default: when
                ``max_new_tokens >= 256``).
            output_logprobs: also return, per generated token, its log-probability under the distribution it was
                drawn from (``GenerateOutput.logprobs``, float32 ``(batch, new)``; after temperature / top-k /
                top-p; greedy: ``log_softmax`` of the raw logits; 0 after a row's EOS): what an RL trainer's
                importance-sampling correction compares with its own log-probs.

        Returns:
            :class:`GenerateOutput`.

        Raises:
            ValueError: bad ``input_ids``/``attention_mask``, an empty prompt row, a token or EOS id outside the
                vocabulary, ``max_new_tokens < 1``, prompt + ``max_new_tokens`` beyond the model's positions,
                a bad sampling parameter.
        """
        info = self.info
        max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, seed = _plain(
            (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, seed))
        rows = self._rows(input_ids, attention_mask)
        _check_request(rows, max_new_tokens, temperature, top_k, top_p, info.max_positions, do_sample)
        if isinstance(eos_token_id, str) and eos_token_id != "default":
            raise ValueError(f"eos_token_id must be an id, a list of ids, None (never stop) or 'default'; got "
                             f"{eos_token_id!r}")
        eos = _as_eos(info.eos_token_id if isinstance(eos_token_id, str) else eos_token_id, info.vocab_size)
        pad = _pad_id(pad_token_id, info.pad_token_id, eos, info.vocab_size)
        device = device or input_ids.device
        if not isinstance(output_logprobs, bool):
            raise ValueError(f"output_logprobs must be True or False; got {output_logprobs!r}")
        sample = _sampler(do_sample, temperature, top_k, top_p, seed, device, logprobs=output_logprobs)
        longest = max(int(r.numel()) for r in rows)
        cap = longest + max_new_tokens if self.offload else self.cache_length(longest + max_new_tokens, device)
        with self.head.budget_at_most(cap):  # a budget above the cache would only pad selections and buffers with -1
            return self._generate(rows, longest, input_ids, max_new_tokens, sample, eos, pad, device, progress,
                                  output_logprobs)

    def _generate(self, rows, longest, input_ids, max_new_tokens, sample, eos, pad, device, progress, output_logprobs):
        """:meth:`generate` after its checks: prefill, decode loop, statistics."""
        batch = len(rows)
        stats = GenerationStats(batch=batch, prompt_tokens=sum(int(r.numel()) for r in rows), head=self.head.name,
                                budget=self.head.budget)

        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        plan = self._offload_engine(rows, max_new_tokens, device) if self.offload else None
        engine = None
        if plan is not None:
            from .offload import LayerReady, OffloadEngine, initial_capacity

            chunk = int(self.offload_chunk)
            cache, logits = self.prefill(rows, longest + max_new_tokens, device,
                                         initial_capacity(plan, longest, longest + max_new_tokens, chunk))
            engine = OffloadEngine(cache, plan, int(self.head.budget), chunk, self.programs.layer_split(LayerReady))
            engine.record_timing = self.offload_timing
            engine.preallocate()
        else:
            cache, logits = self.prefill(rows, self.cache_length(longest + max_new_tokens, device), device)
        self.head.prefill(cache, max_new_tokens)
        eos_t = torch.tensor(eos or [-1], device=device)
        running = torch.ones(batch, dtype=torch.bool, device=device)
        tok, lp = _split(sample(logits))
        out, lps = [tok], [lp]
        running &= ~torch.isin(tok, eos_t)
        sync()
        t1 = time.perf_counter()
        stats.kv_bytes, stats.cache_max_length = cache.nbytes, cache.max_length
        stats.prefill_s = t1 - t0

        steps, produced = self._decode_loop(cache, tok, running, max_new_tokens - 1, sample, eos_t, pad, engine,
                                            stats, progress if progress is not None else max_new_tokens >= 256)
        out += [t for t, _ in steps]
        lps += [p for _, p in steps]
        sync()
        t2 = time.perf_counter()
        new = _trim(torch.stack(out, 1), eos)
        stats.decode_s = t2 - t1
        stats.new_tokens = _count_new(new, eos)
        stats.prefill_tokens_per_s = stats.prompt_tokens / max(stats.prefill_s, 1e-9)
        stats.decode_tokens_per_s = int(produced) / max(stats.decode_s, 1e-9)
        stats.ms_per_step = 1000 * stats.decode_s / max(stats.decode_steps, 1)
        if engine is not None:
            off = engine.stats()
            stats.offload = True
            for key in ("bytes_per_step", "full_bytes_per_step", "layers_per_step", "moves", "copy_hidden"):
                setattr(stats, f"offload_{key}", off[f"offload_{key}"])
        logprobs = torch.stack(lps, 1)[:, :new.shape[1]].to(input_ids.device) if output_logprobs else None
        return GenerateOutput(torch.cat([input_ids.to(torch.long), new.to(input_ids.device)], dim=1), stats, logprobs)

    @torch.no_grad()
    def decode_from(self, cache: KVCache, tokens: torch.Tensor, max_new_tokens: int, *,
                    eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
                    progress: bool = False, engine=None) -> GenerateOutput:
        """Greedy decoding continued from a cache that already holds every row's context: ``tokens`` ``(batch,)``
        int64 are the next inputs (not yet in the cache), ``max_new_tokens`` decode steps follow (the head's
        :meth:`~.heads.RetrievalHead.prefill` runs first). What ``generate`` does after its prefill; the decode
        benchmark times decode steps at chosen context lengths with it (``kvtransform bench decode``).

        Rows that reach an EOS of ``eos_token_id`` get ``pad_token_id`` (default: the model's pad id, else the first
        EOS, else 0) after it; decoding stops when every row has finished, checked every 8 steps (as ``generate``),
        so up to 7 pad steps may follow the last EOS: they are in ``sequences`` and in the cache
        (``cache.cache_seqlens`` advances by ``stats.decode_steps``). ``engine``: the
        :class:`~.offload.OffloadEngine` of ``cache`` (an :class:`~.offload.OffloadedKVCache`, e.g. one placed by
        :meth:`~.offload.OffloadEngine.resume_at`) when it has layers on CPU; None: a resident cache.

        Returns:
            :class:`GenerateOutput` whose ``sequences`` are the ``(batch, steps)`` generated ids (no prompt) and
            whose ``stats`` have the decode fields (``decode_s``, ``decode_steps``, ``ms_per_step``, overlap).

        Raises:
            ValueError: ``tokens`` not ``(cache.batch,)`` integer ids inside the vocabulary, a cache of another
                model's shape or with a negative length, ``max_new_tokens < 1``, a row whose context plus
                ``max_new_tokens`` does not fit ``cache.max_length``, an EOS or pad id outside the vocabulary, an
                ``engine`` of another cache.
        """
        info = self.info
        max_new_tokens, eos_token_id, pad_token_id = _plain((max_new_tokens, eos_token_id, pad_token_id))
        max_new_tokens = _check_decode_from(info, cache, tokens, max_new_tokens, engine)
        device = cache.k.device
        eos = _as_eos(eos_token_id, info.vocab_size)
        pad_token_id = _pad_id(pad_token_id, info.pad_token_id, eos, info.vocab_size)
        eos_t = torch.tensor(eos or [-1], device=device)
        stats = GenerationStats(batch=cache.batch, head=self.head.name, budget=self.head.budget,
                                kv_bytes=cache.nbytes, cache_max_length=cache.max_length)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.head.prefill(cache, max_new_tokens)
        running = torch.ones(cache.batch, dtype=torch.bool, device=device)
        sync()
        t0 = time.perf_counter()
        out, produced = self._decode_loop(cache, tokens.to(device=device, dtype=torch.long), running,
                                          max_new_tokens, _greedy, eos_t, pad_token_id, engine, stats, progress)
        out = [t for t, _ in out]
        sync()
        stats.decode_s = time.perf_counter() - t0
        stats.new_tokens = int(produced)
        stats.decode_tokens_per_s = int(produced) / max(stats.decode_s, 1e-9)
        stats.ms_per_step = 1000 * stats.decode_s / max(stats.decode_steps, 1)
        return GenerateOutput(torch.stack(out, 1), stats)

    def _decode_loop(self, cache: KVCache, tok: torch.Tensor, running: torch.Tensor, n_steps: int, sample: Callable,
                     eos_t: torch.Tensor, pad: int, engine, stats: GenerationStats, show: bool) -> list:
        """``n_steps`` decode steps from ``cache`` (the head prefilled) and the next input tokens ``tok``
        ``(batch,)``; updates ``running`` and ``stats`` (steps, selection checksums and overlap); returns the
        produced tokens as ``(tokens (batch,), logprobs (batch,) or None)`` per step (pad and log-prob 0 after a
        row's EOS; log-probs when ``sample`` returns them, :func:`~.sampling._sampler`). Stops early when every row
        has finished (checked every 8 steps: a host sync)."""
        device = tok.device
        # offloaded steps are captured too (recaptured after a layer move); under capture the elastic copies run
        # on the compute stream (runtime/offload.py, "Streams")
        use_graph = self.cuda_graphs and torch.device(device).type == "cuda"
        # the fused projection weights = the model's now, however it was updated (the offloaded split runs them too)
        stats.fused_weight_bytes = self.programs.refresh(force=True)
        stepper = _GraphStep(self, cache, engine) if use_graph else None
        stats.cuda_graph = use_graph
        overlap = torch.zeros((), device=device)
        produced = torch.zeros((), dtype=torch.long, device=device)
        checksums, prev_sel, q, n_overlap = [], None, None, 0
        steps = range(1, n_steps + 1)
        out = []
        if show:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc=f"decode ({self.head.name})", unit="tok", leave=False)
        for i in steps:
            if i % 8 == 1 and not bool(running.any()):  # a host sync: checked every 8 steps, trimmed below
                break
            if engine is not None:
                engine.before_step()
            if stepper is not None and q is not None:
                logits, sel = stepper(tok)
            else:
                cache.set_current(tok)
                sel = self.head_step(cache, q)
                logits, q = self.decode(cache, tok, sel, engine)
                if stepper is not None:
                    stepper.q = q = q.clone()
            checksums.append(_checksum(sel))
            if prev_sel is not None and prev_sel.shape == sel.shape:
                overlap += _overlap(prev_sel, sel, cache.max_length)
                n_overlap += 1
            prev_sel = sel.clone()
            if engine is not None:
                engine.advance()
            produced += running.sum()
            nxt, lp = _split(sample(logits))
            if lp is not None:
                lp = torch.where(running, lp, torch.zeros_like(lp))
            tok = torch.where(running, nxt, torch.full_like(nxt, pad))
            out.append((tok, lp))
            running &= ~torch.isin(tok, eos_t)
            stats.decode_steps += 1
        stats.selection_overlap = float(overlap) / n_overlap if n_overlap else None
        stats.selection_checksums = torch.stack(checksums).tolist() if checksums else []
        return out, produced


def _split(drawn) -> tuple:
    """``(tokens, logprobs or None)`` from what a sampler returned (tokens, or ``(tokens, logprobs)``)."""
    return drawn if isinstance(drawn, tuple) else (drawn, None)
