"""Retrieval heads: once per decode step, pick the cached tokens every layer attends to (SpeContext, arXiv
2512.00722 §4.3; one selection per step, per KV head, shared by all layers).

Interface (:class:`RetrievalHead`): ``prefill(cache)`` after the prompts are in the cache, then once per decode step
``step(cache, queries) -> indices`` ``(batch, H_kv, W)`` int32, positions into the cache, ``-1`` padding (the
contract of :mod:`kvtransform.ops.sparse_decode`). ``queries`` are the previous step's post-RoPE queries of every
layer ``(L, batch, H, D)`` (None before the first decode step). Every head is pure tensor code with static shapes
and no host synchronisation, so the step can be captured in a CUDA graph and replayed with exactly the selections
eager makes (no length-dependent Python branches).

Training-free heads (selected by ``SpeContextConfig(head=...)``):

* ``dense``: every cached token (the budget is ignored): full attention through the same runtime, the honest
  in-house baseline;
* ``recent``: the first ``num_sink`` tokens plus the most recent ``budget - num_sink`` (StreamingLLM-style);
* ``quest``: ``page_size``-token pages scored by ``Σ_d max(q_d·kmax_d, q_d·kmin_d)`` with per-page min/max keys
  (Quest), the best ``ceil(budget / page_size)`` pages;
* ``oracle``: the LLM's own attention of the previous step: per layer the group-max (over the GQA group) of the
  softmax probabilities of the previous step's queries, max over layers, top-``budget``. An accuracy upper bound
  for the trained heads, not a speed path.

Heads that score with queries (``oracle``, ``quest``) select every token on the first decode step (no previous
query exists yet). Heads that score from token embeddings (``self``, ``distilled``, ``eagle3``;
:mod:`.embedding_heads`) read the id of the token being decoded from ``cache.token_ids[b, cache_seqlens[b]]``
(the runtime writes it with ``KVCache.set_current`` before ``step``) and the target's weights given to
:meth:`RetrievalHead.bind`. :func:`register_head` adds heads by name (trained heads plug in here);
:func:`make_head` builds one.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch

from kvtransform.kernels.retrieval import retrieval_scores_reference, retrieval_scores_triton, select_topk

from .cache import KVCache

HEADS: dict[str, type] = {}


def register_head(name: str) -> Callable[[type], type]:
    """Class decorator: register a :class:`RetrievalHead` subclass under ``name`` (``SpeContextConfig.head``)."""

    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, RetrievalHead)):
            raise TypeError(f"register_head takes a RetrievalHead subclass; got {cls!r}")
        cls.name = name
        HEADS[name] = cls
        return cls

    return deco


def make_head(name: str, config, scale: Optional[float] = None) -> "RetrievalHead":
    """Build the head ``name`` for a :class:`~kvtransform.config.SpeContextConfig` ``config``.

    Args:
        scale: the model's softmax scale (default ``head_dim ** -0.5`` at the first step).

    Raises:
        ValueError: an unknown head name (the message lists the registered ones).
    """
    if name not in HEADS:
        raise ValueError(f"unknown retrieval head {name!r}; choose one of {sorted(HEADS)} "
                         f"(SpeContextConfig(head=...), transform.head=... on the command line)")
    return HEADS[name](config, scale)


class RetrievalHead:
    """Base class: holds ``budget``, ``num_sink``, ``num_recent`` (tokens per KV head) from the config.

    Subclasses implement :meth:`select` (and optionally :meth:`prefill`, :meth:`state_dict`,
    :meth:`load_state_dict` for heads with state that the artifact must carry).
    """

    name = "abstract"
    needs_queries = False  # scores with the previous step's queries (dense on the first decode step)
    needs_model = False  # reads the target's weights: bind(model) before prefill
    # every cached token: the runtime may run the decode program in slot mode (each layer reads its cache up to
    # cache_seqlens, no index per token; kvtransform.passes.sparse_decode.slot_mode_program) and its selection
    # (all_positions) only feeds the statistics
    slot_mode = False
    # the layers whose attention reads the selection (heads that score per layer use only these): the global layers
    # of a model with sliding-window layers, which attend densely to a window that fits in the budget (the
    # transform sets it from the decode program); None: every layer
    score_layers: Optional[tuple] = None

    def __init__(self, config, scale: Optional[float] = None):
        self.budget = int(config.budget)
        self.num_sink = int(config.num_sink)
        self.num_recent = int(config.num_recent)
        self.page_size = int(getattr(config, "page_size", 16))
        self.scale = scale

    def bind(self, model) -> None:
        """Attach the target's weights: the HF model at transform time, the captured decode program (parameters
        under the model's names) when an artifact is reloaded, after :meth:`load_state_dict`. No-op here.

        Raises:
            ValueError: the model does not fit the head (another model's trained head, a missing projection)."""

    def prefill(self, cache: KVCache, max_new_tokens: Optional[int] = None) -> None:
        """Called once after the prompts are written into ``cache`` (build per-token or per-page state).
        ``max_new_tokens``: the decode steps the request may take (None: the cache's room past its longest row);
        heads whose state depends on a row's final length (a per-row RoPE extension) use it."""

    def step(self, cache: KVCache, queries: Optional[torch.Tensor]) -> torch.Tensor:
        """The selection for the coming decode step: int32 ``(batch, H_kv, W)`` positions, ``-1`` padding.

        Args:
            cache: the KV cache (``cache_seqlens`` = tokens each row holds before this step).
            queries: the previous step's queries ``(L, batch, H, D)``, or None before the first decode step.
        """
        if self.needs_queries and queries is None:
            return all_positions(cache)
        return self.select(cache, queries)

    def select(self, cache: KVCache, queries: Optional[torch.Tensor]) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    @contextlib.contextmanager
    def budget_at_most(self, tokens: int):
        """Within the block :attr:`budget` is at most ``tokens`` (the cache's length): a selection never needs more
        positions than a row can hold, and a larger budget only pads every selection, and every buffer sized by
        it, with ``-1``. The configured budget is back afterwards."""
        configured = self.budget
        self.budget = min(configured, int(tokens))
        try:
            yield self
        finally:
            self.budget = configured

    def release(self) -> None:
        """Drop the per-request state :meth:`prefill` built (its memory returns to the allocator; the next
        ``prefill`` rebuilds it)."""
        for attr in self.REQUEST_STATE:
            setattr(self, attr, None)

    REQUEST_STATE: tuple = ()  # attributes :meth:`release` drops

    def state_dict(self) -> dict:
        """Tensors and values the artifact stores (``head.pt``); none for training-free heads."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""


def all_positions(cache: KVCache) -> torch.Tensor:
    """Every valid position of every row: ``(batch, H_kv, S_max)`` int32, ``-1`` past ``cache_seqlens[b]``."""
    _, b, h_kv, s_max, _ = cache.k.shape
    pos = torch.arange(s_max, device=cache.k.device, dtype=torch.int32)
    idx = torch.where(pos[None, :] < cache.cache_seqlens[:, None], pos[None, :], torch.full_like(pos, -1)[None])
    return idx[:, None, :].expand(b, h_kv, s_max).contiguous()


@register_head("dense")
class DenseHead(RetrievalHead):
    """Every cached token (budget ignored): full attention through the sparse runtime, in slot mode (the kernel
    reads each row's cache up to its length instead of walking ``S_max`` indices)."""

    slot_mode = True

    def select(self, cache, queries):
        return all_positions(cache)


@register_head("recent")
class RecentHead(RetrievalHead):
    """The first ``num_sink`` tokens and the last ``budget - num_sink`` (all tokens when a row has at most
    ``budget``); ``num_recent`` is implied (the whole rest of the budget is recent)."""

    def select(self, cache, queries):
        _, b, h_kv, _, _ = cache.k.shape
        width = self.budget
        j = torch.arange(width, device=cache.k.device, dtype=torch.int32)[None, :]
        lens = cache.cache_seqlens[:, None]
        short = torch.where(j < lens, j, torch.full_like(j, -1))              # len <= budget: 0..len-1
        long = torch.where(j < self.num_sink, j, lens - width + j)            # sink, then the last budget - sink
        idx = torch.where(lens <= width, short, long)
        return idx[:, None, :].expand(b, h_kv, width).contiguous()


def _finite(x: torch.Tensor) -> torch.Tensor:
    """±inf (the min/max of an empty page) → 0; such pages are masked when scored."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _scores(q: torch.Tensor, k: torch.Tensor, lens: torch.Tensor, scale: float, sink: int, recent: int):
    """Group-max retrieval log-probabilities ``(batch, H_kv, S_max)`` fp32 (Triton on CUDA, reference on CPU)."""
    if q.is_cuda:  # the kernel's dots take one dtype: the key cache's (a bf16 model's head keeps bf16 keys)
        return retrieval_scores_triton(q.to(k.dtype).contiguous(), k, lens, scale, sink, recent)
    return retrieval_scores_reference(q, k, lens, scale, sink, recent, dtype=torch.float32)


@register_head("oracle")
class OracleHead(RetrievalHead):
    """The LLM's own attention of the previous step: max over layers (:attr:`RetrievalHead.score_layers`) of the
    group-max softmax probabilities, top-``budget`` (``num_sink`` / ``num_recent`` always kept)."""

    needs_queries = True

    def select(self, cache, queries):
        scale = self.scale or queries.shape[-1] ** -0.5
        best = None
        for layer in self.score_layers or range(queries.shape[0]):
            s = _scores(queries[layer], cache.k[layer], cache.cache_seqlens, scale, self.num_sink, self.num_recent)
            best = s if best is None else torch.maximum(best, s)
        return select_topk(best, self.budget)


@register_head("quest")
class QuestHead(RetrievalHead):
    """Quest-style page selection: per ``page_size``-token page the element-wise min and max of the keys of every
    layer; page score per query head ``Σ_d max(q_d·kmax_d, q_d·kmin_d)`` (an upper bound of the page's best
    logit), log-softmax over the row's pages, max over the GQA group and the layers; the best
    ``ceil(budget / page_size)`` pages (the pages of the first ``num_sink`` and last ``num_recent`` tokens and the
    newest page always kept; where they are more pages than that, the newest page first, then the recent pages
    from the newest, then the sink's). Indices: the pages' valid positions, ``-1`` padding."""

    needs_queries = True
    REQUEST_STATE = ("kmax", "kmin")

    def prefill(self, cache, max_new_tokens=None):
        """Page min/max keys, one layer at a time (the temporaries are one layer's cache, not all of them)."""
        L, b, h_kv, s_max, d = cache.k.shape
        ps = self.page_size
        # a multiple of 8 pages: the page scores' row stride (bf16) stays 16-byte aligned for cuBLAS (an odd count
        # ran on an unaligned CUTLASS GEMM, docs/TRL.md); the pages past the cache are never valid
        pages = math.ceil(math.ceil(s_max / ps) / 8) * 8
        pad = pages * ps - s_max
        pos = torch.arange(pages * ps, device=cache.k.device)
        valid = (pos[None, :] < cache.cache_seqlens[:, None].long())[:, None, :, None]  # (b,1,S',1)
        self.kmax = cache.k.new_empty(L, b, h_kv, pages, d)
        self.kmin = cache.k.new_empty(L, b, h_kv, pages, d)
        for layer in range(L):
            k = torch.nn.functional.pad(cache.k[layer], (0, 0, 0, pad))
            self.kmax[layer] = _finite(k.masked_fill(~valid, float("-inf")).view(b, h_kv, pages, ps, d).amax(dim=3))
            self.kmin[layer] = _finite(k.masked_fill(~valid, float("inf")).view(b, h_kv, pages, ps, d).amin(dim=3))

    def _refresh_last_page(self, cache):
        """Recompute the page holding each row's newest token (appended since the last step)."""
        L, b, h_kv, s_max, d = cache.k.shape
        ps = self.page_size
        lens = cache.cache_seqlens.long()
        page = ((lens - 1).clamp(min=0) // ps)                                  # (b,)
        pos = page[:, None] * ps + torch.arange(ps, device=lens.device)[None]  # (b, ps)
        valid = pos < lens[:, None]
        gidx = pos.clamp(max=s_max - 1)[None, :, None, :, None].expand(L, b, h_kv, ps, d)
        keys = cache.k.gather(3, gidx)
        vmask = valid[None, :, None, :, None]
        kmax = _finite(keys.masked_fill(~vmask, float("-inf")).amax(dim=3))    # (L, b, h_kv, d)
        kmin = _finite(keys.masked_fill(~vmask, float("inf")).amin(dim=3))
        rows = torch.arange(b, device=lens.device)
        self.kmax[:, rows, :, page] = kmax.transpose(0, 1)
        self.kmin[:, rows, :, page] = kmin.transpose(0, 1)

    def select(self, cache, queries):
        self._refresh_last_page(cache)
        L, b, h_kv, s_max, d = cache.k.shape
        ps, pages = self.page_size, self.kmax.shape[3]
        h = queries.shape[2]
        # Σ_d max(q_d·kmax_d, q_d·kmin_d) = relu(q)·kmax + min(q, 0)·kmin: two matmuls, no (…, P, D) temporary
        q = queries.to(self.kmax.dtype).view(L, b, h_kv, h // h_kv, d)
        kmax, kmin = self.kmax, self.kmin
        if self.score_layers:
            q, kmax, kmin = (x[list(self.score_layers)] for x in (q, kmax, kmin))
        s = (torch.matmul(q.clamp(min=0), kmax.transpose(-1, -2)).float()
             + torch.matmul(q.clamp(max=0), kmin.transpose(-1, -2)).float())  # (L', b, h_kv, G, P)
        lens = cache.cache_seqlens.long()
        p = torch.arange(pages, device=lens.device)
        start = p[None, :] * ps
        valid = start < lens[:, None]                                           # (b, P)
        s = s.masked_fill(~valid[None, :, None, None, :], float("-inf")).log_softmax(dim=-1)
        score = s.amax(dim=3).amax(dim=0)                                       # (b, h_kv, P)
        last = (lens - 1).clamp(min=0) // ps
        newest = p[None, :] == last[:, None]
        recent = (start + ps > lens[:, None] - self.num_recent) & (self.num_recent > 0)
        sink = start < self.num_sink
        # forced pages outrank every score (log-probabilities, <= 0) in this order when they are more than the
        # budget's pages: the newest page, the recent pages (newest first), the sink pages (oldest first: a strict
        # order, so which of them fit does not depend on top-k's tie order, i.e. on the page table's width)
        prio = torch.where(newest, float("inf"), torch.where(recent, 1e30 + p[None, :].float() * 1e24,
                                                              torch.where(sink, 1e20 + (pages - p[None, :]).float()
                                                                          * 1e14, float("nan"))))
        forced = (newest | recent | sink) & valid
        score = torch.where(forced[:, None, :], prio[:, None, :], score)
        score = score.masked_fill(~valid[:, None, :], float("-inf"))
        top = select_topk(score, math.ceil(self.budget / ps)).long()            # (b, h_kv, n_pages), -1 pad
        tok = top[..., None] * ps + torch.arange(ps, device=lens.device)        # (b, h_kv, n_pages, ps)
        ok = (top[..., None] >= 0) & (tok < lens[:, None, None, None])
        return torch.where(ok, tok, torch.full_like(tok, -1)).flatten(2).to(torch.int32).contiguous()
