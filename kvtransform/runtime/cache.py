"""The static KV cache of the SpeContext runtime (arXiv 2512.00722 §4.3).

One K and one V buffer for all layers, ``(L, batch, H_kv, max_length, D)`` in the model dtype (so a layer's cache
``k[l]`` is the ``(batch, H_kv, S_max, D)`` layout the ops expect, last dim contiguous), and ``cache_seqlens``
``(batch,)`` int32: row ``b`` holds its tokens at positions ``[0, cache_seqlens[b])``, without padding (a
left-padded prompt is stored compactly). ``max_length`` is the request's longest prompt plus ``max_new_tokens``,
never the model's maximum positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class KVCache:
    """Static per-layer KV cache.

    Attributes:
        k, v: ``(L, batch, H_kv, max_length, D)``, model dtype.
        cache_seqlens: ``(batch,)`` int32, valid tokens per row.
        token_ids: ``(batch, max_length)`` int64, the token id of every cached position, and at position
            ``cache_seqlens[b]`` the id of the token being decoded (written by :meth:`set_current` before the
            retrieval head runs): what heads that score from token embeddings read (``self``, ``distilled``,
            ``eagle3``; arXiv 2512.00722 §4.1). Its position is ``cache_seqlens[b]`` (compact rows). None for a
            cache built without ids.
    """

    k: torch.Tensor
    v: torch.Tensor
    cache_seqlens: torch.Tensor
    token_ids: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, num_layers: int, batch: int, num_kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype, device) -> "KVCache":
        """Zeroed buffers for ``batch`` rows of up to ``max_length`` tokens; ``cache_seqlens`` all 0.

        Raises:
            ValueError: a non-positive size.
        """
        dims = dict(num_layers=num_layers, batch=batch, num_kv_heads=num_kv_heads, max_length=max_length,
                    head_dim=head_dim)
        bad = {k: v for k, v in dims.items() if int(v) < 1}
        if bad:
            raise ValueError(f"KV cache sizes must be >= 1; got {bad}")
        shape = (num_layers, batch, num_kv_heads, max_length, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k, torch.zeros_like(k), torch.zeros(batch, dtype=torch.int32, device=device),
                   torch.zeros(batch, max_length, dtype=torch.long, device=device))

    @property
    def max_length(self) -> int:
        return int(self.k.shape[3])

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V."""
        return 2 * self.k.numel() * self.k.element_size()

    def write_prompts(self, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list,
                      input_ids: Optional[torch.Tensor] = None) -> None:
        """Store a packed prefill's K/V: ``k``/``v`` ``(L, 1, H_kv, T, D)`` hold row ``b``'s tokens at packed
        positions ``[cu_seqlens[b], cu_seqlens[b+1])``; sets ``cache_seqlens`` to the prompt lengths.
        ``input_ids`` ``(1, T)`` (the packed ids, optional) fill :attr:`token_ids`.

        Raises:
            ValueError: a prompt longer than ``max_length``.
        """
        lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(self.batch)]
        if max(lens) > self.max_length:
            raise ValueError(f"a prompt of {max(lens)} tokens does not fit the cache of {self.max_length}")
        for b, n in enumerate(lens):
            lo = cu_seqlens[b]
            self.k[:, b, :, :n] = k[:, 0, :, lo:lo + n]
            self.v[:, b, :, :n] = v[:, 0, :, lo:lo + n]
            if input_ids is not None and self.token_ids is not None:
                self.token_ids[b, :n] = input_ids[0, lo:lo + n]
        self.cache_seqlens.copy_(torch.tensor(lens, dtype=torch.int32))

    def set_current(self, tokens: torch.Tensor) -> None:
        """Write the ids of the tokens about to be decoded, ``tokens`` ``(batch,)``, at position
        ``cache_seqlens[b]`` of :attr:`token_ids` (before the retrieval head's step; K/V follow in
        :meth:`append`). No host synchronisation (CUDA-graph safe)."""
        if self.token_ids is None:
            return
        rows = torch.arange(self.batch, device=self.k.device)
        pos = self.cache_seqlens.to(torch.long).clamp(max=self.max_length - 1)
        self.token_ids[rows, pos] = tokens.to(self.token_ids.dtype)

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write one new token per row, ``k_new``/``v_new`` ``(L, batch, H_kv, D)``, at position
        ``cache_seqlens[b]`` and advance ``cache_seqlens`` by one. No host synchronisation (CUDA-graph safe); the
        caller sizes the cache so that no row outgrows it."""
        rows = torch.arange(self.batch, device=self.k.device)
        pos = self.cache_seqlens.to(torch.long).clamp(max=self.max_length - 1)
        self.k[:, rows, :, pos] = k_new.transpose(0, 1).to(self.k.dtype)
        self.v[:, rows, :, pos] = v_new.transpose(0, 1).to(self.v.dtype)
        self.cache_seqlens.add_(1)
