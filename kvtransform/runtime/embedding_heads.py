"""Retrieval heads that score from token embeddings (SpeContext, arXiv 2512.00722 §4.1–4.3, §9).

The target model's attention at a decode step is predicted, before the LLM step runs, from what is known then: the
id and position of the token being decoded (``cache.token_ids`` at ``cache.cache_seqlens``) and the cached tokens.
Selection is the one ``kvt::retrieval_topk`` makes (arXiv 2512.00722 §4.3): softmax per query head over the row's
cached positions, max over the GQA group, top-``budget`` per KV head.

* ``self`` (:class:`SelfHead`, training-free): the target's own early-layer query projection applied to the
  current token's embedding (input RMSNorm, ``q_proj``, RoPE at its position), scored against that layer's real
  keys already in the KV cache; max over the chosen layers of the group-max log-probabilities.
* :class:`EmbeddingKeyHead`: the base of heads with their own one-layer key cache ``(batch, H_kv, max_length, D)``
  built from the cached tokens' embeddings at :meth:`~EmbeddingKeyHead.prefill` and extended by one key per step
  (``distilled`` in :mod:`.distilled`, ``eagle3`` in :mod:`.eagle3`).

All of them are pure tensor code with static shapes and no host synchronisation in ``step`` (CUDA-graph safe).
The target's embedding matrix is shared with the model (looked up by parameter name, never copied).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kvtransform.kernels.retrieval import select_topk

from .heads import RetrievalHead, _scores, register_head

__all__ = ["find_param", "rope", "yarn_inv_freq", "yarn_rows", "row_lengths", "rms_norm", "current_tokens",
           "copy_sources", "SelfHead",
           "EmbeddingKeyHead"]


def find_param(module, suffix: str, detach: bool = True) -> torch.Tensor:
    """The parameter or buffer of ``module`` whose name ends with ``suffix`` (the HF model, or a captured
    program whose parameters keep the model's names under a prefix), detached; ``detach=False``: the
    ``Parameter`` object itself (read ``.detach()`` at use time to follow a later ``param.data = ...``).

    Raises:
        ValueError: none, naming the suffix (the module is not the target this head was built for).
    """
    owner, _, leaf = suffix.rpartition(".")
    # a PEFT adapter (LoRA) wraps a linear as ``<owner>.base_layer``: the head reads the base weight (the adapter's
    # low-rank delta does not enter the selection; the decode program runs the adapted layer)
    wanted = (suffix,) if not owner else (suffix, f"{owner}.base_layer.{leaf}")
    for want in wanted:
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if name == want or name.endswith("." + want):
                return p.detach() if detach else p
    raise ValueError(f"the model has no parameter named '*{suffix}': this retrieval head needs the target's "
                     f"{suffix} (a Llama-style decoder)")


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm in fp32 over the last dim (weight None: no gain)."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """Rotary embedding, Hugging Face's rotate-half layout.

    Args:
        x: ``(..., heads, D)``; positions: int64 ``x.shape[:-2]``; inv_freq: fp32 ``(D/2,)``, or ``(batch, D/2)``
            per row (``batch = positions.shape[0]``, :func:`yarn_rows`); mscale: YaRN's attention factor
            (multiplies cos and sin): a float, or fp32 ``(batch,)`` per row.

    Returns:
        fp32 ``x.shape``.
    """
    inv = inv_freq.float()
    if inv.dim() == 2:                                               # per row: broadcast over positions' other dims
        inv = inv.view(inv.shape[0], *([1] * (positions.dim() - 1)), inv.shape[1])
    ang = positions.float()[..., None] * inv                         # (..., D/2)
    emb = torch.cat([ang, ang], dim=-1)[..., None, :]                # (..., 1, D)
    if isinstance(mscale, torch.Tensor):
        mscale = mscale.float().view(-1, *([1] * (emb.dim() - 1)))
    cos, sin = emb.cos() * mscale, emb.sin() * mscale
    x = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def yarn_inv_freq(base: float, dim: int, factor: float, original_max: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) frequencies for running ``factor`` × beyond ``original_max`` positions.

    Returns:
        ``(inv_freq fp32 (dim/2,), mscale)``: plain RoPE (``mscale`` 1) when ``factor <= 1``.
    """
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if factor <= 1.0:
        return inv.float(), 1.0

    def corr(rot):
        return (dim * math.log(original_max / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo = max(math.floor(corr(beta_fast)), 0)
    hi = min(math.ceil(corr(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp                                            # 1: high frequency, kept as trained
    inv = inv / factor * (1 - extrapolate) + inv * extrapolate
    return inv.float(), 0.1 * math.log(factor) + 1.0


def yarn_rows(base: float, dim: int, lengths, original_max: int):
    """:func:`yarn_inv_freq` for each row's own length, so one row's RoPE never depends on another's.

    Args:
        lengths: an int (every row; returns what :func:`yarn_inv_freq` returns) or a sequence of ints, one per row
            (each row's final length: :func:`row_lengths`); the factor is ``length / original_max``.

    Returns:
        ``(inv_freq, mscale)``: fp32 ``(D/2,)`` and a float for an int; fp32 ``(batch, D/2)`` and fp32 ``(batch,)``
        for a sequence.
    """
    if isinstance(lengths, int):
        return yarn_inv_freq(base, dim, lengths / original_max, original_max)
    per = {n: yarn_inv_freq(base, dim, n / original_max, original_max) for n in set(lengths)}
    return (torch.stack([per[n][0] for n in lengths]),
            torch.tensor([per[n][1] for n in lengths], dtype=torch.float32))


def row_lengths(cache, max_new_tokens: Optional[int] = None) -> tuple:
    """Each row's final length at prefill: its context (``cache_seqlens`` then) plus ``max_new_tokens`` (None: the
    room left past the longest row, ``max_length`` minus it, which is ``max_new_tokens`` in ``generate``). A head
    that extends RoPE (YaRN) per row from these gives a row the same selections alone as in any batch. Reads
    ``cache_seqlens`` on the host (call it at prefill, outside CUDA graphs)."""
    seq = [int(x) for x in cache.cache_seqlens.tolist()]
    room = cache.max_length - max(seq, default=0) if max_new_tokens is None else int(max_new_tokens)
    return tuple(n + room for n in seq)


def current_tokens(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (batch,) int64, positions (batch,) int64)`` of the token being decoded (written by
    ``KVCache.set_current``).

    Raises:
        ValueError: the cache carries no ``token_ids``.
    """
    if cache.token_ids is None:
        raise ValueError("this retrieval head needs the cache's token_ids (KVCache.allocate makes them)")
    pos = cache.cache_seqlens.long().clamp(max=cache.max_length - 1)
    return cache.token_ids.gather(1, pos[:, None])[:, 0], pos


def copy_sources(token_ids: torch.Tensor, tok: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                 max_occurrences: int = 0) -> torch.Tensor:
    """The positions a copy (induction) step reads: every earlier occurrence ``i`` of the current token and the
    token after it, ``i + 1`` (what an induction head attends to when the model continues a repeated span); where
    the previous token matches too (``token_ids[i - 1]`` is the token before the current one: a repeated bigram),
    also ``i + 2`` and ``i + 3``, the rest of a phrase the model may be copying across a line break (``conflict
    of`` / ``law``; docs/specontext_heads.md, "Held-out kind").

    Args:
        token_ids: int64 ``(batch, S)`` the row's ids; tok: int64 ``(batch,)`` the token being decoded.
        lengths: ``(batch,)`` valid positions per row, the current token's position (its predecessor is at
            ``lengths - 1``): occurrences at ``>= lengths[b]`` do not count towards ``max_occurrences`` (without a
            cap they are marked, and the caller's mask drops them); None: all, and no bigram matches.
        max_occurrences: keep only the most recent this many occurrences (0: all). A frequent current token (a
            newline in 32K tokens of code) would otherwise mark thousands of positions and crowd the budget.

    Returns:
        fp32 ``(batch, S)``: 1 at ``i`` and ``i + 1`` for every kept ``i`` with ``token_ids[b, i] == tok[b]`` (and at
        ``i + 2``, ``i + 3`` for those that follow the previous token), else 0 (the current position itself is among
        them; callers mask positions ``>= cache_seqlens``).
    """
    eq = token_ids == tok[:, None]
    if max_occurrences > 0:  # occurrences at or after i, counted from the row's end: static shapes, no sync
        if lengths is not None:
            eq = eq & (torch.arange(token_ids.shape[1], device=token_ids.device)[None] < lengths.long()[:, None])
        later = eq.flip(-1).to(torch.int32).cumsum(-1).flip(-1)
        eq = eq & (later <= max_occurrences)
    marks = eq | _shifted(eq, 1)
    if lengths is not None:
        lengths = lengths.long()
        prev = token_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])
        bigram = eq & _shifted(token_ids == prev, 1) & (lengths > 0)[:, None]
        marks = marks | _shifted(bigram, 2) | _shifted(bigram, 3)
    return marks.float()


def _shifted(x: torch.Tensor, s: int) -> torch.Tensor:
    """``x`` ``(batch, S)`` moved ``s`` positions right along the last axis, ``False`` shifted in."""
    n = x.shape[-1]
    return torch.nn.functional.pad(x[:, :max(n - s, 0)], (min(s, n), 0))


def _forced_windows(budget: int, sink: int, recent: int) -> tuple[int, int]:
    """``(sink, recent)`` clamped so that the always-kept tokens fit the budget: the first ``min(sink, budget)``
    tokens, then the most recent ones up to what is left. A head's own minimum windows (``SINK``, ``RECENT``, a
    fraction of the budget) can otherwise outnumber a small budget, and top-k would then choose among forced
    (``+inf``) positions by its tie order, which depends on the score row's width (an offloaded step and a resident
    one kept different tokens at budget 4)."""
    sink = min(int(sink), int(budget))
    return sink, max(0, min(int(recent), int(budget) - sink))


def _model_config(model):
    cfg = getattr(model, "config", None)
    return cfg if cfg is not None and hasattr(cfg, "num_attention_heads") else None


def _embedding_scale(model, weight: torch.Tensor) -> float:
    """The factor the model's input embedding module applies to its table rows (Gemma's ``sqrt(hidden)``; 1.0 for
    a plain ``nn.Embedding``), probed on a few token ids."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        return 1.0
    ids = torch.arange(min(8, weight.shape[0]), device=weight.device)
    with torch.no_grad():
        rows, out = weight[ids].detach().float(), emb(ids).detach().float()
        return float((out * rows).sum() / (rows * rows).sum().clamp_min(1e-30))


def _norm_gain_offset(model, layer: int, weight: torch.Tensor, eps: float) -> float:
    """0.0 where layer ``layer``'s ``input_layernorm`` computes ``x̂ · w`` (Llama, Qwen, Mistral, gpt-oss), 1.0 where
    it computes ``x̂ · (1 + w)`` (Gemma's RMSNorm stores the gain's offset from 1), probed on a random input.

    Raises:
        ValueError: the norm is neither (the self head could not reproduce the model's query), naming head='quest'.
    """
    mod = next((m for n, m in model.named_modules() if n.endswith(f"layers.{layer}.input_layernorm")), None)
    if mod is None:
        return 0.0
    x = torch.randn(4, weight.shape[-1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = mod(x.to(weight.device, weight.dtype)).float().cpu()
    w = weight.detach().float().cpu()
    err = {off: (got - rms_norm(x, w + off, eps)).abs().max().item() for off in (0.0, 1.0)}
    best = min(err, key=err.get)
    if err[best] > 2e-2 * max(1.0, got.abs().max().item()):
        raise ValueError(f"head='self' cannot reproduce layer {layer}'s input norm ({type(mod).__name__} is neither "
                         f"RMSNorm form x*w nor x*(1+w)): use head='quest' (training-free, reads only the KV cache)")
    return best


@register_head("self")
class SelfHead(RetrievalHead):
    """Training-free: the target's own layer-``l`` query of the current token computed from its embedding alone
    (``RoPE(q_proj(RMSNorm_l(embed[token])))``, plus ``q_norm`` where the family has one, the embedding scale and
    the norm's form as the model's modules compute them: :meth:`query`), scored against layer
    ``l``'s real keys in the KV cache (the keys are exact, only the query skips the layers below ``l``); the
    group-max log-probabilities of the :attr:`LAYERS` are maxed, top-``budget``.

    The construction was chosen by measured recall (share of every layer's attention mass over the cache captured,
    mean over the 30 layers of SmolLM2-135M; budget 1024 of ≈4.1K cached tokens; 96 decode positions after a
    4096-token prefix of ``argparse.py`` / ``idlelib/NEWS2x.txt``)::

        construction                                   argparse   NEWS2x
        recent (no sink)                                 0.560     0.582
        layer 0                                          0.525     0.546
        layer 0 + 4 sink tokens                          0.818     0.801
        layer 0 + 4 sink + 25 % of the budget recent     0.829     0.810
        layer 0 + 4 sink + 50 % of the budget recent     0.833     0.816   <- chosen
        layers 0,1,2 + 4 sink + 50 % recent              0.830     0.781
        (layer 1 alone 0.36, layer 2 0.24, layers 0-5 0.45 without sinks: deeper embedding-only queries drift)

    So: :attr:`LAYERS` ``(0,)``, the first :attr:`SINK` = 4 tokens (the attention sink) and the most recent
    :attr:`RECENT_FRACTION` = half of the budget always kept, the rest by the layer-0 score.

    Needs ``bind(model)`` (the HF model, or the captured decode program on reload: only the embedding is read from
    it then, the rest comes from :meth:`load_state_dict`).
    """

    LAYERS = (0,)
    SINK = 4               # first tokens always kept (on top of num_sink)
    RECENT_FRACTION = 0.5  # share of the budget always given to the most recent tokens (on top of num_recent)
    needs_model = True

    def __init__(self, config, scale=None):
        super().__init__(config, scale)
        self.embed: Optional[torch.Tensor] = None
        self.w: dict = {}

    #: the model's parameters the head reads (suffixes; ``{l}`` = a layer of :attr:`LAYERS`): a family whose
    #: attention fuses its projections (Phi-3's ``qkv_proj``) or names its RoPE otherwise (Gemma 3's local and
    #: global ``rotary_emb``) has no such query to borrow
    NEEDS = ("embed_tokens.weight", "rotary_emb.inv_freq", "layers.{l}.input_layernorm.weight",
             "layers.{l}.self_attn.q_proj.weight")

    @classmethod
    def missing(cls, model) -> Optional[str]:
        """The first parameter of :attr:`NEEDS` that the transformers ``model`` lacks, or None (the head binds)."""
        for suffix in cls.NEEDS:
            for l in (cls.LAYERS if "{l}" in suffix else (None,)):
                try:
                    find_param(model, suffix.format(l=l))
                except ValueError:
                    return suffix.format(l=l)
        return None

    @classmethod
    def unavailable(cls, model) -> Optional[str]:
        """Why the head cannot bind the transformers ``model`` (a parameter of :attr:`NEEDS` it lacks, or an input
        norm that is not RMSNorm: Phi-2's LayerNorm), or None."""
        gone = cls.missing(model)
        if gone is not None:
            return f"no '*{gone}'"
        cfg = _model_config(model)
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        for l in (l for l in cls.LAYERS if l < cfg.num_hidden_layers):
            try:
                _norm_gain_offset(model, l, find_param(model, f"layers.{l}.input_layernorm.weight"), eps)
            except ValueError as e:
                return str(e)
        return None

    def bind(self, model) -> None:
        """Read the model's embedding and, for a transformers model, its layer-0 query projection and RoPE.

        Raises:
            ValueError: a model without them (:meth:`missing`), naming the training-free head that needs none."""
        cfg = _model_config(model)
        gone = self.missing(model) if cfg is not None else None
        if gone is not None:
            raise ValueError(f"head='self' borrows the model's own '*{gone}', which {type(model).__name__} does not "
                             f"have: use head='quest' (training-free, reads only the KV cache)")
        self.embed = find_param(model, "embed_tokens.weight")
        if cfg is None:  # a reloaded program: the projections come from load_state_dict
            if not self.w:
                raise ValueError("head='self' over a saved program needs the projections its artifact's head.pt "
                                 "stores, and head.pt holds none: save the artifact again")
            return
        h = cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
        layers = [l for l in self.LAYERS if l < cfg.num_hidden_layers]
        inv = find_param(model, "rotary_emb.inv_freq").float()
        scaling = getattr(getattr(model, "model", model), "rotary_emb", None)
        w = {"layers": torch.tensor(layers), "inv_freq": inv.clone(),
             "mscale": torch.tensor(float(getattr(scaling, "attention_scaling", 1.0))),
             "eps": torch.tensor(float(getattr(cfg, "rms_norm_eps", 1e-6))), "heads": torch.tensor(h),
             "head_dim": torch.tensor(d), "embed_scale": torch.tensor(_embedding_scale(model, self.embed))}
        for l in layers:  # the model's own parameters (not copies): updates between generate calls are followed
            pre = f"layers.{l}."
            w[f"norm{l}"] = find_param(model, pre + "input_layernorm.weight", detach=False)
            w[f"norm_offset{l}"] = torch.tensor(_norm_gain_offset(model, l, w[f"norm{l}"], float(w["eps"])))
            w[f"q{l}"] = find_param(model, pre + "self_attn.q_proj.weight", detach=False)
            try:
                w[f"qb{l}"] = find_param(model, pre + "self_attn.q_proj.bias", detach=False)
            except ValueError:
                pass
            try:
                w[f"qn{l}"] = find_param(model, pre + "self_attn.q_norm.weight", detach=False)
            except ValueError:
                pass
        self.w = w

    def state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.w.items()}  # values, not the model's parameters

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: a state without the scalars, RoPE table, norm gains and query projections of its layers."""
        if not state:
            return
        need = ["layers", "inv_freq", "mscale", "eps", "heads", "head_dim"]
        layers = state.get("layers")
        if isinstance(layers, torch.Tensor) and layers.dim() == 1 and not layers.is_floating_point():
            need += [f"{k}{int(l)}" for l in layers.tolist() for k in ("norm", "q")]
        missing = [k for k in need if not isinstance(state.get(k), torch.Tensor)]
        if missing:
            raise ValueError(f"the self head's state lacks {', '.join(missing[:4])}")
        self.w = dict(state)

    def prefill(self, cache, max_new_tokens=None) -> None:
        """Move the projections to the cache's device and read the scalars (outside any CUDA graph). The
        projections are the model's parameters as they are now (no copy on their device)."""
        w = self.w
        self._dev = {k: v.detach().to(cache.k.device) for k, v in w.items()}
        self._layers = [int(l) for l in w["layers"].tolist()]
        self._h, self._d, self._eps = int(w["heads"]), int(w["head_dim"]), float(w["eps"])
        self._mscale = float(w["mscale"])
        # the norms' gains, with Gemma's offset of 1 (a Python float read here, outside any CUDA graph)
        self._gain = {l: self._dev[f"norm{l}"].float() + float(w.get(f"norm_offset{l}", 0.0)) for l in self._layers}
        self._embed_scale = float(w.get("embed_scale", 1.0))

    def query(self, tok: torch.Tensor, pos: torch.Tensor, l: int) -> torch.Tensor:
        """Layer ``l``'s query of tokens ``tok`` (int64 ``(b,)``) at positions ``pos`` (int64 ``(b,)``) from their
        embeddings alone: fp32 ``(b, heads, head_dim)``, RoPE applied. The norm's gain is ``w`` or, where the model's
        norm computes ``x̂ · (1 + w)`` (Gemma's RMSNorm), ``1 + w``; the embedding rows are scaled as the model's
        embedding module scales them (Gemma's ``sqrt(hidden)``, which matters through the norm's eps); both probed at
        :meth:`bind`. Needs :meth:`prefill` first."""
        w = self._dev
        eps = self._eps
        q = rms_norm(self.embed[tok].float() * self._embed_scale, self._gain[l], eps) @ w[f"q{l}"].float().t()
        if f"qb{l}" in w:
            q = q + w[f"qb{l}"].float()
        q = q.view(-1, self._h, self._d)
        if f"qn{l}" in w:
            q = rms_norm(q, w[f"qn{l}"], eps)
        return rope(q, pos, w["inv_freq"], self._mscale)

    def select(self, cache, queries):
        tok, pos = current_tokens(cache)
        scale = self.scale or self._d ** -0.5
        best = None
        for l in self._layers:
            q = self.query(tok, pos, l)
            s = _scores(q.to(cache.k.dtype), cache.k[l], cache.cache_seqlens, scale,
                        *_forced_windows(self.budget, max(self.num_sink, self.SINK),
                                        max(self.num_recent, int(self.RECENT_FRACTION * self.budget))))
            best = s if best is None else torch.maximum(best, s)
        return select_topk(best, self.budget, ordered=False)  # decode sorts by position


class EmbeddingKeyHead(RetrievalHead):
    """Base of heads with their own one-layer key cache computed from token embeddings (``distilled``,
    ``eagle3``): subclasses implement :meth:`qk`; this class owns the key cache and the selection.

    The first :attr:`SINK` tokens are always selected (SmolLM2 puts a large share of most layers' attention on the
    first token, the attention sink; without it the embedding-only ``self`` head captures 0.52 instead of 0.82).
    ``prefill(cache)`` computes the keys of every cached position from ``cache.token_ids`` (a window of
    :attr:`window` tokens ending at each position); ``step`` computes the current token's query and key, writes the
    key at ``cache_seqlens[b]`` and selects among positions ``[0, cache_seqlens[b])``.
    """

    needs_model = True
    window = 1
    SINK = 4  # the first tokens (the attention sink) are always kept, on top of num_sink
    PREFILL_TOKENS = 16384  # tokens per chunk of the key-cache prefill
    REQUEST_STATE = ("keys",)
    COPY_BONUS = 0.0  # added to the scores of copy_sources (earlier occurrences of the current token and their
    # successors); 0: off
    # only the most recent this many occurrences get the bonus (0: all). Off: a cap of 64 raised the distilled head's
    # NLL increase from +0.020 to +0.062 (argparse.py: +0.005 -> +0.130; the copy source was further back), measured
    # with `kvtransform eval-sparse` on the 3 evaluation documents, 128-token continuations, budget 1024
    COPY_MAX_OCCURRENCES = 0
    RECENT = 0  # the most recent tokens always kept, on top of num_recent

    def __init__(self, config, scale=None):
        super().__init__(config, scale)
        self.embed: Optional[torch.Tensor] = None
        self.keys: Optional[torch.Tensor] = None

    def rope_tables(self, lengths: tuple, device) -> tuple:
        """``(inv_freq fp32 (batch, D/2), mscale fp32 (batch,))`` on ``device``: the head's RoPE for rows of final
        lengths ``lengths`` (:func:`row_lengths`; a per-row extension such as YaRN). Built once at :meth:`prefill`,
        so the per-step code reads tensors only (no Python value for ``torch.compile`` to guard on)."""
        raise NotImplementedError

    def qk(self, emb: torch.Tensor, positions: torch.Tensor, tables: tuple):
        """``emb`` ``(batch, S, window, hidden)`` (the window's embeddings, oldest first, zeros before position 0),
        ``positions`` int64 ``(batch, S)`` → ``(q (batch, S, H, D), k (batch, S, H_kv, D))`` post-RoPE.
        ``tables``: :meth:`rope_tables` of the request."""
        raise NotImplementedError

    def _window(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Embeddings ``(batch, S, window, hidden)`` of the ``window`` tokens ending at ``pos`` ``(batch, S)``."""
        off = torch.arange(self.window - 1, -1, -1, device=pos.device)
        p = pos[..., None] - off                                          # (b, S, W)
        ok = (p >= 0)[..., None]
        idx = ids.gather(1, p.clamp(min=0).flatten(1)).view(p.shape)
        return torch.where(ok, self.embed[idx].float(), torch.zeros((), device=pos.device))

    def prefill(self, cache, max_new_tokens=None) -> None:
        """Keys of every cache position, ``PREFILL_TOKENS`` tokens (over all rows) at a time, so the window's
        ``(tokens, window, hidden)`` fp32 temporary stays bounded at any batch and cache length. The key cache is
        kept in the embedding's dtype (bf16 for a bf16 model: half the bytes every step reads)."""
        if cache.token_ids is None:
            raise ValueError("this retrieval head needs the cache's token_ids (KVCache.allocate makes them)")
        b, s_max = cache.token_ids.shape
        dev = cache.k.device
        dtype = self.embed.dtype if self.embed.dtype.is_floating_point else torch.float32
        chunk = max(1, self.PREFILL_TOKENS // b)
        self.keys = None
        self._lengths = row_lengths(cache, max_new_tokens)
        self._rope_tables = self.rope_tables(self._lengths, dev)
        for lo in range(0, s_max, chunk):
            pos = torch.arange(lo, min(lo + chunk, s_max), device=dev).expand(b, -1)
            _, k = self.qk(self._window(cache.token_ids, pos), pos, self._rope_tables)
            if self.keys is None:
                self.keys = torch.empty(b, k.shape[2], s_max, k.shape[3], dtype=dtype, device=dev)
            self.keys[:, :, lo:lo + pos.shape[1]] = k.transpose(1, 2).to(dtype)   # (b, H_kv, S_max, D)

    def select(self, cache, queries):
        tok, pos = current_tokens(cache)
        q, k = self.qk(self._window(cache.token_ids, pos[:, None]), pos[:, None], self._rope_tables)
        rows = torch.arange(cache.batch, device=pos.device)
        self.keys[rows, :, pos] = k[:, 0].to(self.keys.dtype)
        scale = self.scale_override() or q.shape[-1] ** -0.5
        s = _scores(q[:, 0], self.keys, cache.cache_seqlens, scale,
                    *_forced_windows(self.budget, max(self.num_sink, self.SINK), max(self.num_recent, self.RECENT)))
        if self.COPY_BONUS:  # a class constant: no data-dependent branch
            src = copy_sources(cache.token_ids, tok, cache.cache_seqlens, self.COPY_MAX_OCCURRENCES)
            s = s + self.COPY_BONUS * src[:, None, :].to(s.dtype)
        return select_topk(s, self.budget, ordered=False)  # decode sorts by position

    def scale_override(self) -> Optional[float]:
        """The head's own softmax scale (None: ``head_dim ** -0.5``); not the LLM's."""
        return None
