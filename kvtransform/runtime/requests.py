"""Checks of a generation request (HF ``generate`` semantics): prompt rows, step counts, EOS and pad ids, sampling
parameters. Each raises ``ValueError`` naming the argument and the fix."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ..utils import is_count, is_integer_dtype

__all__ = ["_prompt_rows", "_check_request", "_check_steps", "_as_eos", "_pad_id", "_plain"]


def _plain(value):
    """A NumPy scalar or a 0-d tensor as the Python number it holds (``np.int64(8)`` -> 8, ``torch.tensor(0.7)`` ->
    0.7, ``np.True_`` -> True), a NumPy array as a list; a list or tuple element-wise; anything else unchanged (the
    checks then name it)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):  # a scalar, or an array of ids
        return value.tolist()
    return value


def _check_steps(max_new_tokens) -> None:
    """Raises ValueError unless ``max_new_tokens`` is an int >= 1 (not a bool)."""
    if not is_count(max_new_tokens, 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")


def _as_eos(eos, vocab: int) -> list:
    """``eos_token_id`` (an id, a list / tuple / 1-D integer tensor of ids, or None: never stop) as a list of ints.

    Raises:
        ValueError: an id that is not an integer in ``[0, vocab)`` (a float such as ``2.0``, a bool, a string)."""
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()  # (float or bool values stay floats / bools: refused below)
    out = []
    for e in eos if isinstance(eos, (list, tuple)) else [eos]:
        if not is_count(_plain(e), 0, vocab - 1, numpy=True):
            raise ValueError(f"eos_token_id {e!r} is outside the vocabulary [0, {vocab}) or not an integer id: pass "
                             f"the tokenizer's eos_token_id (or a list of ids), or None to never stop early")
        out.append(int(e))
    return out


def _pad_id(pad_token_id, default_pad, eos: Sequence, vocab_size: int) -> int:
    """The pad id a generation writes into finished rows and feeds back as their next token: ``pad_token_id``, else
    the model's generation_config ``default_pad``, else the first EOS id, else 0.

    Raises:
        ValueError: not an int in ``[0, vocab_size)``; a bad default names the generation_config and the argument
            that overrides it.
    """
    pad = pad_token_id if pad_token_id is not None else (
        default_pad if default_pad is not None else (eos[0] if eos else 0))
    if is_count(pad, 0, vocab_size - 1):
        return pad
    if pad_token_id is None:  # the generation_config's, which the caller never passed
        hint = f" (e.g. pad_token_id={eos[0]}, the EOS id)" if eos else ""
        raise ValueError(f"the model's generation_config.pad_token_id={pad!r} is not an id in [0, {vocab_size}): "
                         f"pass pad_token_id=<an id>{hint} to generate")
    raise ValueError(f"pad_token_id must be an id in [0, {vocab_size}) or None; got {pad!r}")


def _prompt_rows(input_ids, attention_mask, vocab: int) -> list:
    """The real tokens of each row (1-D int tensors on the CPU): ``input_ids`` ``(batch, seq)`` where
    ``attention_mask`` (0/1, default all ones) is 1.

    Raises:
        ValueError: not an integer ``(batch, seq)`` tensor, no rows, a mask of another shape or not 0/1, an empty
            row, a token outside ``[0, vocab)``.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool:
        one_row = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1 and \
            not input_ids.dtype.is_floating_point and input_ids.dtype != torch.bool
        got = (f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else
               f"a {type(input_ids).__name__}: pass torch.tensor([ids]) (or the tokenizer's return_tensors='pt')")
        raise ValueError(f"input_ids must be an integer tensor (batch, seq); got {got}"
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
    for b, r in enumerate(rows):
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token id {lo if lo < 0 else hi} in prompt row {b} is outside the vocabulary "
                             f"[0, {vocab})")
    return rows


def _check_request(rows, max_new_tokens, temperature, top_k, top_p, max_positions: int,
                   do_sample: bool = True) -> None:
    """Raises ValueError for a request the programs cannot run: ``max_new_tokens < 1``, the longest prompt plus
    ``max_new_tokens`` beyond ``max_positions``, ``do_sample`` not a bool, a temperature that is not a finite number
    > 0 when sampling (greedy decoding ignores it, as HF does: any number or None), a bad ``top_k``/``top_p``."""
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False; got {do_sample!r}")
    _check_steps(max_new_tokens)
    longest = max(r.numel() for r in rows)
    if longest >= max_positions:  # no room for even one new token
        raise ValueError(f"a prompt of {longest} tokens leaves no room to generate within the model's {max_positions} "
                         f"positions: shorten it to at most {max_positions - 1} tokens ({longest - max_positions + 1} "
                         f"fewer)")
    if longest + max_new_tokens > max_positions:
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                         f"{max_positions} positions: shorten the prompt or lower max_new_tokens to "
                         f"{max_positions - longest}")
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if do_sample and not (number and 0 < temperature < math.inf):
        raise ValueError(f"temperature must be a finite number > 0 when do_sample=True; got {temperature!r}")
    if not do_sample and temperature is not None and not number:
        raise ValueError(f"temperature must be a number (ignored when do_sample=False) or None; got {temperature!r}")
    if top_k is not None and not is_count(top_k, 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 or None = off); got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1 or None = off); got {top_p!r}")


def _check_decode_from(info, cache, tokens, max_new_tokens, engine) -> int:
    """:meth:`~.generate.SpeContextRuntime.decode_from`'s checks (its docstring lists the errors); returns
    ``max_new_tokens`` as an int."""
    if engine is not None and getattr(engine, "cache", None) is not cache:
        raise ValueError("engine must be the OffloadEngine of this cache (engine.cache is cache), or None")
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (cache.batch,) or \
            not is_integer_dtype(tokens.dtype):
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
    return max_new_tokens
