"""The SpeContext generation loop (arXiv 2512.00722 §4–5): packed prefill into a static KV cache, then one decode
step per token: retrieval head → ``indices`` → the rewritten LLM step (every attention is
``kvt::sparse_decode_attention``) → append K/V → sample.

Semantics follow Hugging Face ``generate``: a batch of prompts of different lengths (left padding, or any 0/1
``attention_mask``: the real tokens of each row are its prompt), greedy by default or sampling with
``temperature``/``top_k``/``top_p`` (transformers' own logits warpers), per-row stop at EOS (finished rows are
filled with the pad id), ``(batch, prompt + new)`` ids returned. On CUDA with ``cuda_graphs`` the whole decode
step -- retrieval head and LLM -- is captured once per batch and replayed (:meth:`SpeContextRuntime._graph_step`).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from .cache import KVCache
from .heads import RetrievalHead


@dataclass
class GenerationStats:
    """Per-run numbers of :meth:`SpeContextRuntime.generate`.

    Attributes:
        batch: rows.
        prompt_tokens: real prompt tokens (sum over rows; padding not counted).
        new_tokens: tokens generated (sum over rows, up to and including each row's EOS).
        prefill_s, decode_s: wall seconds of the prefill (with the first token) and of the decode steps.
        prefill_tokens_per_s: ``prompt_tokens / prefill_s``.
        decode_tokens_per_s: tokens produced by the decode steps (rows still running) per second.
        decode_steps: decode steps run. Whether every row has stopped is checked every 8 steps (each check is a host
            sync), so up to 7 steps can run after the last EOS: ``decode_steps`` may exceed ``new_tokens``.
        ms_per_step: ``1000 * decode_s / decode_steps``.
        selection_overlap: mean fraction of the tokens selected at a step that were also selected at the
            previous step (per row and KV head; ``1 - 1/len`` for ``dense``; None without two comparable steps).
        kv_bytes: bytes allocated for the KV cache (``2 * L * batch * H_kv * max_length * D * itemsize``).
        cache_max_length: ``max_length`` of the cache (longest prompt + ``max_new_tokens``).
        head, budget: the retrieval head and the budget (tokens per KV head; ignored by ``dense``).
        cuda_graph: whether the decode steps replayed a CUDA graph.
        fused_weight_bytes: extra memory (on the model's device) of the decode program's fused projection weights:
            the groups kept as a copy of the model's (``fuse_projections``); 0 when nothing is fused or every group
            took the parameters' place.
        offload: whether layers' KV moved to CPU (``SpeContextConfig.offload`` and a plan that needs it).
        offload_bytes_per_step: per decode step with an offloaded layer, bytes copied to the GPU by elastic loading
            (entries that entered the selection × offloaded layers × K+V bytes of one entry).
        offload_full_bytes_per_step: the same steps, bytes of loading all ``W`` selected tokens of every offloaded
            layer (what loading without elastic reuse would copy).
        offload_layers_per_step: layers on CPU at each decode step.
        offload_moves: ``(decode step, length in tokens, layer)`` of every layer move.
        offload_copy_hidden: CUDA, eager decode with ``offload_timing``: mean over steps of ``1 − exposed / copy``,
            ``copy`` the side stream's copy time, ``exposed`` the part of it still running when the compute stream
            reached the first offloaded layer's wait (1 = fully hidden); None under CUDA graphs (timing events are
            not captured) and on the CPU stand-in.
        selection_checksums: per decode step and row, an int64 hash of the selected positions of every KV head
            (of the set: the order a head returns them in does not count): equal lists mean equal selections (used
            to check a graph replay against eager).
    """

    batch: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    decode_steps: int = 0
    ms_per_step: float = 0.0
    selection_overlap: Optional[float] = None
    kv_bytes: int = 0
    cache_max_length: int = 0
    head: str = ""
    budget: int = 0
    cuda_graph: bool = False
    fused_weight_bytes: int = 0
    offload: bool = False
    offload_bytes_per_step: list = field(default_factory=list, repr=False)
    offload_full_bytes_per_step: list = field(default_factory=list, repr=False)
    offload_layers_per_step: list = field(default_factory=list, repr=False)
    offload_moves: list = field(default_factory=list, repr=False)
    offload_copy_hidden: Optional[float] = None
    selection_checksums: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("selection_checksums")
        return d


@dataclass
class GenerateOutput:
    """``generate(..., return_dict_in_generate=True)``: ``sequences`` int64 ``(batch, prompt + new)`` and
    ``stats`` (:class:`GenerationStats`)."""

    sequences: torch.Tensor
    stats: GenerationStats


@dataclass
class ModelInfo:
    """What the runtime needs to know about the model (stored in the artifact's ``meta.json``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: str
    eos_token_id: list
    pad_token_id: Optional[int]

    @classmethod
    def from_model(cls, model) -> "ModelInfo":
        cfg = model.config
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = cfg.eos_token_id if eos is None else eos
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        pad = getattr(gen, "pad_token_id", None) if gen is not None else None
        from kvtransform.capture import max_positions

        return cls(num_layers=cfg.num_hidden_layers,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                   vocab_size=int(cfg.vocab_size), max_positions=max_positions(model),
                   dtype=str(next(model.parameters()).dtype).replace("torch.", ""), eos_token_id=eos,
                   pad_token_id=None if pad is None else int(pad))


def _check_steps(max_new_tokens) -> None:
    """Raises ValueError unless ``max_new_tokens`` is an int >= 1 (not a bool)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")


def _as_eos(eos, vocab: int) -> list:
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) or (isinstance(eos, torch.Tensor) and eos.dim() == 0) else list(eos)
    out = []
    for e in ids:
        if isinstance(e, bool) or not isinstance(e, (int, torch.Tensor)) or not 0 <= int(e) < vocab:
            raise ValueError(f"eos_token_id {e!r} is outside the vocabulary [0, {vocab}): pass the tokenizer's "
                             f"eos_token_id, or None to never stop early")
        out.append(int(e))
    return out


def _check_pad(pad, vocab_size: int) -> None:
    """``pad_token_id`` is written into finished rows and fed back as their next token: it must be a vocabulary id.

    Raises:
        ValueError: not an int in ``[0, vocab_size)``.
    """
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab_size:
        raise ValueError(f"pad_token_id must be an id in [0, {vocab_size}) or None; got {pad!r}")


class SpeContextRuntime:
    """Prefill + decode loop around two captured programs and a retrieval head.

    Args:
        prefill: ``(input_ids (1, T), position_ids (1, T), cu_seqlens (S+1,) int32, segment_prefix (S,) int32,
            logits_index (S,) int64) -> (logits (1, S, vocab), k (L, 1, H_kv, T, D), v)`` (packed prompts, each its
            own causal segment; ``S >= 2``).
        decode: ``(input_ids (B, 1), cache_seqlens (B,) int32, indices (B, H_kv, W) int32, k_cache, v_cache) ->
            (logits (B, vocab), k_new (L, B, H_kv, D), v_new, queries (L, B, H, D))``.
        head: the :class:`~kvtransform.runtime.heads.RetrievalHead`.
        info: :class:`ModelInfo`.
        cuda_graphs: capture the decode step in a CUDA graph when the tensors are on CUDA.
        compile: on CUDA, run the decode program through ``torch.compile`` (Inductor fuses the norms, RoPE, SwiGLU
            and residuals around the opaque ``kvt`` ops; compiled once per batch size and cache length, before
            the CUDA graph is captured), and the retrieval head's step too (:meth:`head_step`: its block, RoPE,
            key write and selection become a few fused kernels around the scoring kernel). Offloaded steps stay
            eager.
        fuse_projections: ``"qkv"``, ``"all"`` or ``"none"``: the decode program's sibling projections fused into
            one GEMM each (:mod:`kvtransform.passes.fuse_projections`: the model's parameters become views of the
            fused weights, or, with :attr:`share_fused_weights` off or where they cannot, a copy refreshed when the
            originals change).
        offload: move layers' KV to CPU during decoding when the memory model says so (:mod:`.offload`, §5–6).

    Attributes:
        gpu_memory_bytes: the GPU memory offload plans for (bytes; None: on CUDA the free memory at the start of
            ``generate`` plus what is already allocated; required on the CPU stand-in).
        offload_chunk: tokens by which resident layers' caches grow (layer moves happen at these boundaries).
        offload_timing: record CUDA timing events around the copies and steps (eager decode only) for
            ``GenerationStats.offload_copy_hidden``.
        share_fused_weights: fused projections take the place of the model's parameters (they become views of the
            fused weights: no extra memory; see :mod:`kvtransform.passes.fuse_projections`) rather than being a copy
            (``SpeContextConfig.share_fused_weights``). Setting it drops the derived programs; parameters that an
            earlier shared fusion already turned into views stay views.
    """

    RECOMPILE_LIMIT = 64  # static compiles kept per decode program (see _decode_program)

    def __init__(self, prefill: Callable, decode: Callable, head: RetrievalHead, info: ModelInfo,
                 cuda_graphs: bool = True, offload: bool = False, compile: bool = False,
                 fuse_projections: str = "all", share_fused_weights: bool = True):
        self.prefill_fn, self.decode_fn, self.head, self.info = prefill, decode, head, info
        self.cuda_graphs = bool(cuda_graphs)
        self.compile = bool(compile)
        self._share = bool(share_fused_weights)
        self.fuse_projections = fuse_projections  # validated; resets the derived programs below
        self._compiled: dict = {}  # slot mode -> the compiled program
        self._head_compiled = None  # (head, head.step through torch.compile) (compile on CUDA)
        self._slot = None  # the slot-mode variant of the (fused) decode program (built on first use)
        self._slot_rewrite = None
        self.offload = bool(offload)
        self.gpu_memory_bytes: Optional[int] = None
        self.offload_chunk = 1024
        self.offload_timing = False
        self._split = None

    # ---- validation ------------------------------------------------------------------------------------------
    def _rows(self, input_ids, attention_mask) -> list:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
                or input_ids.dtype == torch.bool:
            one_row = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1 and \
                not input_ids.dtype.is_floating_point and input_ids.dtype != torch.bool
            raise ValueError(f"input_ids must be an integer tensor (batch, seq); got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                             f"{tuple(getattr(input_ids, 'shape', ()))}"
                             + (": one prompt needs a batch dimension, pass input_ids[None]" if one_row else ""))
        if input_ids.shape[0] < 1:
            raise ValueError("input_ids has no rows: pass at least one prompt")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif not isinstance(attention_mask, torch.Tensor):
            raise ValueError(f"attention_mask must be a 0/1 tensor of shape {tuple(input_ids.shape)} like input_ids; "
                             f"got {type(attention_mask).__name__}")
        elif tuple(attention_mask.shape) != tuple(input_ids.shape) or attention_mask.dtype.is_floating_point or \
                not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError(f"attention_mask must be 0/1 (int or bool) of shape {tuple(input_ids.shape)} like "
                             f"input_ids; got {attention_mask.dtype} {tuple(attention_mask.shape)}")
        keep = attention_mask.bool().cpu()
        ids = input_ids.cpu()
        rows = [ids[b][keep[b]] for b in range(ids.shape[0])]
        empty = [b for b, r in enumerate(rows) if r.numel() == 0]
        if empty:
            raise ValueError(f"prompt row {empty[0]} is empty (no token with attention_mask 1): every row needs at "
                             f"least one prompt token")
        vocab = self.info.vocab_size
        for b, r in enumerate(rows):
            lo, hi = int(r.min()), int(r.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"token id {lo if lo < 0 else hi} in prompt row {b} is outside the vocabulary "
                                 f"[0, {vocab})")
        return rows

    def _check_request(self, rows, max_new_tokens, temperature, top_k, top_p):
        _check_steps(max_new_tokens)
        longest = max(r.numel() for r in rows)
        if longest + max_new_tokens > self.info.max_positions:
            raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                             f"{self.info.max_positions} positions: shorten the prompt or lower max_new_tokens to "
                             f"{max(self.info.max_positions - longest, 0)}")
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(f"temperature must be a number > 0; got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 or None = off); got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 or None = off); got {top_p!r}")

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
        cu = [0]
        for n in seg_lens:
            cu.append(cu[-1] + n)
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
        mode the selection is passed sorted by position (once per step, shared by every layer), so each layer's
        gather reads the cache in address order (H200, H 32 / H_kv 8, budget 2048 of ~35K positions, one process,
        ``tools/gather_split_probe.py --order``: 0.107 → 0.097 ms per layer at 44 requests, 0.119 → 0.105 at 49,
        0.079 → 0.074 at 26, unchanged at 23); the attention does not depend on the order. Returns
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
        when :attr:`compile` is set and the cache is on CUDA (one compile per batch, cache length and whether
        ``queries`` is given; Triton kernels the head launches are traced as they are). A head with nothing to
        compute (``dense``, slot mode) is called as it is."""
        if not (self.compile and cache.k.is_cuda) or getattr(self.head, "slot_mode", False):
            return self.head.step(cache, queries)
        if self._head_compiled is None or self._head_compiled[0] is not self.head:  # (a replaced head: again)
            self._raise_recompile_limit()
            self._head_compiled = (self.head, torch.compile(self.head.step, dynamic=False))
        return self._head_compiled[1](cache, queries)

    def _raise_recompile_limit(self) -> None:
        """One static compile per (batch, cache length, indices width): a sweep or a server sees more than dynamo's
        default 8 per code object, and past it dynamo would silently run the program eagerly."""
        from torch._dynamo import config as cfg

        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, key):
                setattr(cfg, key, max(int(getattr(cfg, key)), self.RECOMPILE_LIMIT))

    def _slot_mode(self, want: Optional[bool] = None) -> bool:
        """Whether the step runs the slot-mode program: ``want`` (None: the head's ``slot_mode``) and the decode
        program is a graph the sparse-decode pass rewrote (a plain callable ``decode`` keeps gather mode over the
        head's indices)."""
        want = getattr(self.head, "slot_mode", False) if want is None else want
        return bool(want) and isinstance(self.decode_fn, torch.fx.GraphModule)

    @property
    def fuse_projections(self) -> str:
        """``"qkv"``, ``"all"`` or ``"none"`` (see the class docstring); setting it drops the derived programs (slot
        variant, compiled programs), which are rebuilt on the next step."""
        return self._fuse

    @fuse_projections.setter
    def fuse_projections(self, which: str) -> None:
        from kvtransform.passes.fuse_projections import CHOICES

        if which not in CHOICES:
            raise ValueError(f"fuse_projections must be one of {CHOICES}; got {which!r}")
        self._fuse = which
        self._compiled, self._slot = {}, None

    @property
    def share_fused_weights(self) -> bool:
        """See the class docstring."""
        return self._share

    @share_fused_weights.setter
    def share_fused_weights(self, share: bool) -> None:
        if not isinstance(share, bool):
            raise ValueError(f"share_fused_weights must be true or false; got {share!r}")
        self._share = share
        self._compiled, self._slot = {}, None

    @property
    def slot_rewrite(self) -> Optional[Callable]:
        """``GraphModule -> GraphModule`` applied to the slot-mode program each time it is derived (None: none),
        e.g. the decode benchmark's ``flashinfer`` method, which swaps the attention kernel
        (:func:`kvtransform.bench.flashinfer_decode.flashinfer_program`). Setting it drops the derived programs;
        it survives a change of :attr:`fuse_projections`."""
        return self._slot_rewrite

    @slot_rewrite.setter
    def slot_rewrite(self, fn: Optional[Callable]) -> None:
        if fn is not None and not callable(fn):
            raise ValueError(f"slot_rewrite must be a callable GraphModule -> GraphModule or None; got {fn!r}")
        self._slot_rewrite = fn
        self._compiled, self._slot = {}, None

    def _fused(self):
        """The decode program's :class:`~kvtransform.passes.fuse_projections.FusedProjections` (None: not fused)."""
        from kvtransform.passes.fuse_projections import fused_program

        return fused_program(self.decode_fn, self.fuse_projections, self.share_fused_weights)

    def _decode_program(self, device, slot: bool = False) -> Callable:
        """The decode program (its sibling projections fused per :attr:`fuse_projections`, the fused weights
        refreshed from the originals outside CUDA-graph captures; ``slot``: its slot-mode variant,
        :func:`~kvtransform.passes.sparse_decode.slot_mode_program`, whose ``indices`` input is unused), through
        ``torch.compile`` when :attr:`compile` is set and ``device`` is CUDA."""
        fused = self._fused()
        fn = self.decode_fn if fused is None else fused.program
        if fused is not None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            fused.refresh()
        if slot:
            if self._slot is None:
                from kvtransform.passes.sparse_decode import slot_mode_program

                slot_fn = slot_mode_program(fn)
                if self._slot_rewrite is not None:
                    slot_fn = self._slot_rewrite(slot_fn)
                    if not callable(slot_fn):
                        raise ValueError(f"slot_rewrite returned {type(slot_fn).__name__}, not a program: it must "
                                         f"return the rewritten GraphModule")
                self._slot = slot_fn  # only a finished rewrite is kept: a failing hook fails again next time
            fn = self._slot
        if not (self.compile and torch.device(device).type == "cuda"):
            return fn
        if self._compiled.get(slot) is None:
            self._raise_recompile_limit()
            self._compiled[slot] = torch.compile(fn, dynamic=False, fullgraph=True)
        return self._compiled[slot]

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
                 seed: Optional[int] = None, device=None, progress: Optional[bool] = None
                 ) -> GenerateOutput:
        """Generate up to ``max_new_tokens`` per row (HF ``generate`` semantics; see the module docstring).

        Args:
            input_ids: int ``(batch, seq)``; attention_mask: 0/1 ``(batch, seq)`` (default all ones).
            eos_token_id: an id or a list (``"default"``: the model's generation config; None: never stop).
            pad_token_id: id written after a row's EOS (default: the model's pad id, else its first EOS id, else 0).
            seed: seed of the sampling generator (``do_sample``).
            device: the programs' device. progress: a tqdm bar over decode steps (default: when
                ``max_new_tokens >= 256``).

        Returns:
            :class:`GenerateOutput`.

        Raises:
            ValueError: bad ``input_ids``/``attention_mask``, an empty prompt row, a token or EOS id outside the
                vocabulary, ``max_new_tokens < 1``, prompt + ``max_new_tokens`` beyond the model's positions,
                a bad sampling parameter.
        """
        info = self.info
        rows = self._rows(input_ids, attention_mask)
        self._check_request(rows, max_new_tokens, temperature, top_k, top_p)
        eos = _as_eos(info.eos_token_id if isinstance(eos_token_id, str) else eos_token_id, info.vocab_size)
        pad = pad_token_id if pad_token_id is not None else (
            info.pad_token_id if info.pad_token_id is not None else (eos[0] if eos else 0))
        _check_pad(pad, info.vocab_size)
        device = device or input_ids.device
        sample = _sampler(do_sample, temperature, top_k, top_p, seed, device)
        batch = len(rows)
        stats = GenerationStats(batch=batch, prompt_tokens=sum(int(r.numel()) for r in rows), head=self.head.name,
                                budget=self.head.budget)

        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        plan = self._offload_engine(rows, max_new_tokens, device) if self.offload else None
        longest = max(int(r.numel()) for r in rows)
        engine = None
        if plan is not None:
            from .offload import OffloadEngine, initial_capacity, split_decode_inputs

            chunk = max(1, int(self.offload_chunk))
            cache, logits = self.prefill(rows, longest + max_new_tokens, device,
                                         initial_capacity(plan, longest, longest + max_new_tokens, chunk))
            if self._split is None:
                self._split = split_decode_inputs(self.decode_fn, self.info.num_layers)
            engine = OffloadEngine(cache, plan, int(self.head.budget), chunk, self._split)
            engine.record_timing = self.offload_timing
            engine.preallocate()
        else:
            cache, logits = self.prefill(rows, longest + max_new_tokens, device)
        self.head.prefill(cache, max_new_tokens)
        eos_t = torch.tensor(eos or [-1], device=device)
        running = torch.ones(batch, dtype=torch.bool, device=device)
        tok = sample(logits)
        out = [tok]
        running &= ~torch.isin(tok, eos_t)
        sync()
        t1 = time.perf_counter()
        stats.kv_bytes, stats.cache_max_length = cache.nbytes, cache.max_length
        stats.prefill_s = t1 - t0

        steps, produced = self._decode_loop(cache, tok, running, max_new_tokens - 1, sample, eos_t, pad, engine,
                                            stats, progress if progress is not None else max_new_tokens >= 256)
        out += steps
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
            stats.offload_bytes_per_step = off["offload_bytes_per_step"]
            stats.offload_full_bytes_per_step = off["offload_full_bytes_per_step"]
            stats.offload_layers_per_step = off["offload_layers_per_step"]
            stats.offload_moves = off["offload_moves"]
            stats.offload_copy_hidden = off["offload_copy_hidden"]
        new = new.to(input_ids.device)
        return GenerateOutput(torch.cat([input_ids.to(torch.long), new], dim=1), stats)

    @torch.no_grad()
    def decode_from(self, cache: KVCache, tokens: torch.Tensor, max_new_tokens: int, *,
                    eos_token_id: Union[int, Sequence[int], None] = None, pad_token_id: Optional[int] = None,
                    progress: bool = False) -> GenerateOutput:
        """Greedy decoding continued from a cache that already holds every row's context: ``tokens`` ``(batch,)``
        int64 are the next inputs (not yet in the cache), ``max_new_tokens`` decode steps follow (the head's
        :meth:`~.heads.RetrievalHead.prefill` runs first). What ``generate`` does after its prefill; the decode
        benchmark times decode steps at chosen context lengths with it (``kvtransform bench decode``).

        Rows that reach an EOS of ``eos_token_id`` get ``pad_token_id`` (default: the model's pad id, else the first
        EOS, else 0) after it; decoding stops when every row has finished, checked every 8 steps (as ``generate``),
        so up to 7 pad steps may follow the last EOS: they are in ``sequences`` and in the cache
        (``cache.cache_seqlens`` advances by ``stats.decode_steps``).

        Returns:
            :class:`GenerateOutput` whose ``sequences`` are the ``(batch, steps)`` generated ids (no prompt) and
            whose ``stats`` have the decode fields (``decode_s``, ``decode_steps``, ``ms_per_step``, overlap).

        Raises:
            ValueError: ``tokens`` not ``(cache.batch,)`` integer ids inside the vocabulary, a cache of another
                model's shape or with a negative length, ``max_new_tokens < 1``, a row whose context plus
                ``max_new_tokens`` does not fit ``cache.max_length``, an EOS or pad id outside the vocabulary.
        """
        info = self.info
        if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (cache.batch,) or \
                tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids of shape ({cache.batch},), one per cache row; got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= info.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {info.vocab_size})")
        max_new_tokens = int(max_new_tokens) if isinstance(max_new_tokens, torch.Tensor) and \
            max_new_tokens.dim() == 0 and not max_new_tokens.dtype.is_floating_point else max_new_tokens
        _check_steps(max_new_tokens)
        want = (info.num_layers, cache.batch, info.num_kv_heads, cache.max_length, info.head_dim)
        if tuple(cache.k.shape) != want or tuple(cache.v.shape) != want:
            raise ValueError(f"the cache is (layers, batch, H_kv, max_length, head_dim) = {tuple(cache.k.shape)} but "
                             f"this model needs ({info.num_layers}, batch, {info.num_kv_heads}, max_length, "
                             f"{info.head_dim}): allocate it with KVCache.allocate for this model")
        if int(cache.cache_seqlens.min()) < 0:
            raise ValueError("cache_seqlens has a negative entry: every row holds >= 0 tokens")
        longest = int(cache.cache_seqlens.max())
        if longest + max_new_tokens > cache.max_length:
            raise ValueError(f"a row holds {longest} tokens; {max_new_tokens} more do not fit the cache of "
                             f"{cache.max_length}: allocate a longer cache or decode fewer steps")
        device = cache.k.device
        eos = _as_eos(eos_token_id, info.vocab_size)
        if pad_token_id is None:
            pad_token_id = info.pad_token_id if info.pad_token_id is not None else (eos[0] if eos else 0)
        _check_pad(pad_token_id, info.vocab_size)
        eos_t = torch.tensor(eos or [-1], device=device)
        stats = GenerationStats(batch=cache.batch, head=self.head.name, budget=self.head.budget,
                                kv_bytes=cache.nbytes, cache_max_length=cache.max_length)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.head.prefill(cache, max_new_tokens)
        running = torch.ones(cache.batch, dtype=torch.bool, device=device)
        sync()
        t0 = time.perf_counter()
        out, produced = self._decode_loop(cache, tokens.to(device=device, dtype=torch.long), running,
                                          max_new_tokens, lambda logits: logits.argmax(dim=-1), eos_t,
                                          pad_token_id, None, stats, progress)
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
        produced tokens, one ``(batch,)`` tensor per step (pad after a row's EOS). Stops early when every row has
        finished (checked every 8 steps: a host sync)."""
        device = tok.device
        # CUDA graphs stop where offload begins: capturing the offload side stream's fork/join (elastic copies,
        # per-layer waits) fails on the H200 (cudaErrorStreamCaptureIsolation), so an offloaded request decodes
        # eagerly (the copies still overlap compute on the side stream).
        use_graph = self.cuda_graphs and torch.device(device).type == "cuda" and engine is None
        fused = self._fused() if engine is None else None  # offloaded steps run the unfused program
        if fused is not None:  # the fused projection weights = the model's now, however it was updated
            fused.refresh(force=True)
            stats.fused_weight_bytes = fused.extra_bytes
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
            nxt = sample(logits)
            tok = torch.where(running, nxt, torch.full_like(nxt, pad))
            out.append(tok)
            running &= ~torch.isin(tok, eos_t)
            stats.decode_steps += 1
        stats.selection_overlap = float(overlap) / n_overlap if n_overlap else None
        stats.selection_checksums = torch.stack(checksums).tolist() if checksums else []
        return out, produced


def _first_eos(new: torch.Tensor, eos: list) -> torch.Tensor:
    """Per row, the column of its first EOS in ``new`` ``(batch, n)``, or ``n`` when none."""
    n = new.shape[1]
    if not eos:
        return torch.full((new.shape[0],), n, dtype=torch.long)
    hit = torch.isin(new.cpu(), torch.tensor(eos))
    col = torch.where(hit, torch.arange(n)[None], torch.full_like(hit, n, dtype=torch.long))
    return col.amin(dim=1)


def _trim(new: torch.Tensor, eos: list) -> torch.Tensor:
    """Drop the columns after every row has finished (HF stops when the last row reaches EOS)."""
    last = int(_first_eos(new, eos).max())
    return new[:, :last + 1]


def _count_new(new: torch.Tensor, eos: list) -> int:
    """Tokens generated per row up to and including its first EOS, summed."""
    return int((_first_eos(new, eos) + 1).clamp(max=new.shape[1]).sum())


def _checksum(sel: torch.Tensor) -> torch.Tensor:
    """Per row, a hash of the selected set of each KV head (order-independent: heads may return their selection
    in any order; ``-1`` padding adds nothing)."""
    x = sel.to(torch.int64) + 1
    head = torch.arange(1, sel.shape[1] + 1, device=sel.device, dtype=torch.int64)[None, :, None]
    key = (x * 2654435761 + head * 40503) % 2147483647  # (position, KV head), then xor-shift-multiply rounds: no
    key = ((key ^ (key >> 13)) * 1103515245) % 2147483647  # linear term survives, so exchanging positions between
    key = key ^ (key >> 16)                                # heads changes the sum
    return (key * (x > 0)).sum(dim=(1, 2))


def _overlap(prev: torch.Tensor, cur: torch.Tensor, s_max: int) -> torch.Tensor:
    """Mean over (row, KV head) of |cur ∩ prev| / |cur| (valid entries only)."""
    b, h, _ = prev.shape
    member = torch.zeros(b, h, s_max + 1, dtype=torch.bool, device=prev.device)
    member.scatter_(2, (prev.long() + 1).clamp(min=0), True)
    member[:, :, 0] = False
    valid = cur >= 0
    hit = member.gather(2, (cur.long() + 1).clamp(min=0)) & valid
    return (hit.sum(-1).float() / valid.sum(-1).clamp(min=1).float()).mean()


def _sampler(do_sample: bool, temperature: float, top_k, top_p, seed, device) -> Callable:
    """``logits (batch, vocab) -> tokens (batch,)``: argmax, or transformers' temperature / top-k / top-p warpers
    then a multinomial draw from a generator seeded with ``seed``."""
    if not do_sample:
        return lambda logits: logits.argmax(dim=-1)
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        warpers.append(TopKLogitsWarper(int(top_k)))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(top_p)))
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2 ** 62, ()).item()))

    def draw(logits):
        scores = logits.float()
        for w in warpers:
            scores = w(None, scores)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    return draw


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
            # No uncaptured work may be pending on the offload side stream when it joins the capture (a layer
            # move's device-to-host copy would make the capture fail: cudaErrorStreamCaptureIsolation). Captures
            # happen only when a layer moves or the cache grows, so this host wait is rare.
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
