"""The ``decode`` suite's Hugging Face baselines: ``hf_sdpa`` (``generate`` with a DynamicCache) and ``hf_static``
(``generate`` with a StaticCache, the decode step compiled by transformers), timed from caches pre-filled with random
tokens like our methods'.
"""
from __future__ import annotations

import gc
import time

import torch

from kvtransform.utils import cache_kwarg

from .decode_model import model_shape
from .decode_sampling import per_step, timed_prefill
from .timing import sync

__all__ = ["hf_cache", "hf_seconds", "time_hf", "prefill_hf"]


def hf_cache(model, method, requests, ctx, max_length, dtype, device, seed):
    """A Hugging Face cache holding ``ctx`` random tokens per row: DynamicCache (``hf_sdpa``) or StaticCache of
    ``max_length`` (``hf_static``)."""
    from transformers import DynamicCache, StaticCache

    s = model_shape(model)
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(n):
        return torch.randn(requests, s["kv_heads"], n, s["head_dim"], generator=g, device=device, dtype=dtype)

    if method == "hf_sdpa":
        cache = DynamicCache()
        for layer in range(s["layers"]):
            cache.update(rnd(ctx), rnd(ctx), layer)
        return cache
    cache = StaticCache(config=model.config, max_cache_len=max_length)
    one = rnd(1)
    for layer, lay in enumerate(cache.layers):
        lay.lazy_initialization(one, one)
        lay.keys[:, :, :ctx].normal_(generator=g)
        lay.values[:, :, :ctx].normal_(generator=g)
        if hasattr(lay, "cumulative_length"):
            lay.cumulative_length.fill_(ctx)
    return cache


def hf_seconds(model, method, ids, ctx, n, max_length, dtype, device, seed) -> float:
    """Seconds of ``generate`` producing ``n`` tokens per row of ``ids`` ``(requests, ctx + 1)`` from a cache
    pre-filled with ``ctx`` random tokens (the cache is built outside the timed part)."""
    cache = hf_cache(model, method, ids.shape[0], ctx, max_length, dtype, device, seed)
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   pad_token_id=0, eos_token_id=None, **{cache_kwarg(model): cache})
    sync(device)
    dt = time.perf_counter() - t0
    del cache
    gc.collect()
    return dt


def time_hf(model, method, requests, contexts, max_length, n0, steps, dtype, device, seed) -> tuple:
    """(ms per step at each context, seconds of the first (warm-up/compile) call): ``generate`` continuing from
    a cache pre-filled with the context, (n0 + steps) − n0 steps."""
    vocab = model.config.vocab_size
    out, first = [], None
    for ctx in contexts:
        ids = torch.randint(3, vocab, (requests, ctx + 1), device=device)

        def run(n, ctx=ctx, ids=ids):
            return hf_seconds(model, method, ids, ctx, n, max_length, dtype, device, seed)

        if first is None:
            first = run(n0)  # warm-up (HF compiles a static-cache decode step here)
        out.append(per_step(run, n0, steps))
        del ids
    return out, first


def prefill_hf(model, method, input_len, requests, prefill_tokens, max_length, device) -> tuple:
    """:func:`timed_prefill` of the model's forward into a fresh DynamicCache / StaticCache, last logits only."""
    from transformers import DynamicCache, StaticCache

    def prefill(g):
        ids = torch.randint(3, model.config.vocab_size, (g, input_len), device=device)
        cache = DynamicCache() if method == "hf_sdpa" else StaticCache(config=model.config, max_cache_len=max_length)
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})

    return timed_prefill(prefill, input_len, requests, prefill_tokens, device)
