"""Token choice of a decode step: greedy, or Hugging Face's temperature / top-k / top-p warpers and a seeded
multinomial draw; optionally with each chosen token's log-probability under the distribution it was drawn from."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["_sampler", "_greedy", "_greedy_logprobs"]


def _sampler(do_sample: bool, temperature: float, top_k, top_p, seed, device, logprobs: bool = False) -> Callable:
    """``logits (batch, vocab) -> tokens (batch,)``: argmax, or transformers' temperature / top-k / top-p warpers
    then a multinomial draw from a generator seeded with ``seed``.

    With ``logprobs`` the function returns ``(tokens (batch,) int64, logprobs (batch,) float32)`` instead, the
    log-probability of each chosen token under the distribution it was drawn from: sampling: ``log_softmax`` of the
    warped scores (temperature applied, then tokens outside top-k / the top-p nucleus removed and the rest
    renormalised: exactly the distribution of the multinomial draw; vLLM calls this ``processed_logprobs``); greedy
    (and rows that fall back to greedy, below): see :func:`_greedy_logprobs`.

    A temperature so small that ``logits / temperature`` overflows float32 (e.g. ``1e-38``: the scaled scores hold
    ``inf``, and the softmax NaN) is the limit of sampling as the temperature goes to 0: such a row takes its
    argmax, as greedy decoding would (decided per row on the device, no host sync; the draw still consumes the
    generator, so the other rows' draws do not depend on it); its log-probability is 0 (the limit distribution is
    the point mass on the argmax).
    """
    if not do_sample:
        return _greedy_logprobs if logprobs else _greedy
    if seed is not None and (isinstance(seed, bool) or not hasattr(seed, "__index__") or not 0 <= int(seed) < 2 ** 64):
        raise ValueError(f"seed must be an integer in [0, 2**64) (or None: a random one); got {seed!r}")
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
        overflow = ~torch.isfinite(probs).all(dim=-1, keepdim=True)  # inf - inf in the softmax: NaN
        greedy = torch.nn.functional.one_hot(_greedy(logits), probs.shape[-1]).to(probs.dtype)
        probs = torch.where(overflow, greedy, probs)
        tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
        if not logprobs:
            return tok
        lp = torch.log_softmax(scores, dim=-1).gather(1, tok[:, None])[:, 0]
        return tok, torch.where(overflow[:, 0], torch.zeros_like(lp), lp)

    return draw


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits (batch, vocab) -> (batch,)`` int64 argmax."""
    return logits.argmax(dim=-1)


def _greedy_logprobs(logits: torch.Tensor) -> tuple:
    """``logits (batch, vocab) -> (tokens (batch,) int64, logprobs (batch,) float32)``: the argmax and its
    ``log_softmax`` of the raw logits (temperature 1, no top-k/top-p). A greedy choice has no sampling distribution
    (its own would be a point mass, log-probability 0); what is returned is the model's log-probability of the
    chosen token, the number a trainer compares with its recomputed log-probs at temperature 1 (an importance weight
    of 1 when the decode is exact)."""
    tok = logits.argmax(dim=-1)
    return tok, torch.log_softmax(logits.float(), dim=-1).gather(1, tok[:, None])[:, 0]
