"""Read and steer a Hugging Face model's attention from the inside: the teacher of the retrieval heads and the
sparse-decode emulator of ``kvtransform eval-sparse`` (SpeContext, arXiv 2512.00722 §4.1, §9).

:func:`probing` registers an attention function in transformers' ``AttentionInterface`` and switches the model to
it for the duration of a ``with`` block. Every attention layer then calls :class:`Probe`, which

* records the layer's post-RoPE queries (only the query positions asked for) and keys ``(batch, H_kv, S, D)``
  (the whole sequence seen so far, cache included) when ``capture`` is on;
* attends causally (``S - q_len`` cached tokens before the queries), or, when :attr:`Probe.keep` is set, only to the
  keys ``keep`` allows: a bool ``(batch, H_kv, q_len, S)`` mask per KV head (a decode step's sparse selection; the
  query's own position must be allowed by the caller).

The probe computes attention in fp32 with ``torch.nn.functional.scaled_dot_product_attention``; it never changes
the model's weights.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

__all__ = ["Probe", "probing", "cache_probs"]

_NAME = "kvt_probe"
_ACTIVE: list = []


class Probe:
    """State shared by every attention layer during a probed forward.

    Attributes:
        capture: record queries/keys per layer (``q[layer]`` ``(batch, H, P, D)`` at :attr:`q_positions` of the
            current forward's queries, ``k[layer]`` ``(batch, H_kv, S, D)``), fp32.
        q_positions: int64 ``(P,)`` indices into the current forward's query axis to record (None: all).
        keep: None (causal), or bool ``(batch, H_kv, q_len, S)``: which keys each query of each KV head attends.
        scale: the softmax scale of each layer, from the model's attention module.
    """

    def __init__(self):
        self.capture = False
        self.q_positions: Optional[torch.Tensor] = None
        self.keep: Optional[torch.Tensor] = None
        self.q: dict = {}
        self.k: dict = {}
        self.scale: dict = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = int(getattr(module, "layer_idx", 0))
        b, h, q_len, d = query.shape
        h_kv, s = key.shape[1], key.shape[2]
        scale = float(scaling if scaling is not None else d ** -0.5)
        self.scale[layer] = scale
        if self.capture:
            qp = query if self.q_positions is None else query[:, :, self.q_positions]
            self.q[layer] = qp.detach().float()
            self.k[layer] = key.detach().float()
        if self.keep is not None:
            mask = self.keep
            if tuple(mask.shape) != (b, h_kv, q_len, s):
                raise ValueError(f"Probe.keep must be bool (batch, H_kv, q_len, S) = {(b, h_kv, q_len, s)}; got "
                                 f"{tuple(mask.shape)}")
        else:
            pos_q = torch.arange(q_len, device=query.device) + (s - q_len)
            mask = (torch.arange(s, device=query.device)[None, :] <= pos_q[:, None])[None, None]
        g = h // h_kv
        causal = self.keep is None and q_len == s
        if causal:
            mask = None
        elif mask.shape[1] != 1:
            mask = mask.repeat_interleave(g, dim=1)
        kx = key.repeat_interleave(g, dim=1) if g > 1 else key
        vx = value.repeat_interleave(g, dim=1) if g > 1 else value
        out = torch.nn.functional.scaled_dot_product_attention(query.float(), kx.float(), vx.float(), attn_mask=mask,
                                                               is_causal=causal, scale=scale)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


@contextmanager
def probing(model):
    """``with probing(model) as probe:`` -- every attention of ``model`` runs through ``probe`` (a :class:`Probe`);
    the model's attention implementation is restored on exit.

    Raises:
        ValueError: the model does not use transformers' attention interface (its attention modules ignore
            ``config._attn_implementation``); no probe can see its queries.
    """
    from transformers import AttentionInterface

    probe = Probe()
    _ACTIVE.append(probe)
    AttentionInterface.register(_NAME, lambda *a, **k: _ACTIVE[-1](*a, **k))
    cfg = model.config
    before = cfg._attn_implementation
    try:
        model.set_attn_implementation(_NAME)
    except (ValueError, TypeError):
        cfg._attn_implementation = _NAME
    try:
        yield probe
    finally:
        _ACTIVE.pop()
        try:
            model.set_attn_implementation(before)
        except (ValueError, TypeError):
            cfg._attn_implementation = before


def cache_probs(q: torch.Tensor, k: torch.Tensor, t: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention probabilities of queries at absolute positions ``t`` over the keys before them.

    Args:
        q: ``(H, P, D)`` post-RoPE queries of one layer (fp32); k: ``(H_kv, S, D)`` its keys; t: int64 ``(P,)``
            the absolute position of each query (its cache is positions ``[0, t)``; the query's own key at ``t`` is
            included in the softmax like the model does, then dropped from the result).
        scale: the layer's softmax scale.

    Returns:
        fp32 ``(H, P, S)`` per-query-head probabilities (0 at and after ``t``): what each query head puts on each
        cached token.
    """
    s_len = k.shape[1]
    h, h_kv = q.shape[0], k.shape[0]
    kx = k.repeat_interleave(h // h_kv, dim=0)
    logits = torch.einsum("hpd,hsd->hps", q, kx) * scale
    pos = torch.arange(s_len, device=q.device)
    logits = logits.masked_fill(pos[None, None, :] > t[None, :, None], float("-inf"))
    p = logits.softmax(dim=-1)
    return p.masked_fill(pos[None, None, :] >= t[None, :, None], 0.0)
