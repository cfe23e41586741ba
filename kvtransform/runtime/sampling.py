"""Token choice of a decode step: greedy, or Hugging Face's temperature / top-k / top-p warpers and a seeded
multinomial draw."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["_sampler", "_greedy"]


def _sampler(do_sample: bool, temperature: float, top_k, top_p, seed, device) -> Callable:
    """``logits (batch, vocab) -> tokens (batch,)``: argmax, or transformers' temperature / top-k / top-p warpers
    then a multinomial draw from a generator seeded with ``seed``.

    A temperature so small that ``logits / temperature`` overflows float32 (e.g. ``1e-38``: the scaled scores hold
    ``inf``, and the softmax NaN) is the limit of sampling as the temperature goes to 0: such a row takes its
    argmax, as greedy decoding would (decided per row on the device, no host sync; the draw still consumes the
    generator, so the other rows' draws do not depend on it).
    """
    if not do_sample:
        return _greedy
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
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    return draw


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits (batch, vocab) -> (batch,)`` int64 argmax."""
    return logits.argmax(dim=-1)
