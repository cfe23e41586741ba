"""``kvt::attention``: the canonical attention op every standard attention site is rewritten into.

It is what ``aten.scaled_dot_product_attention`` computes, with GQA visible (K/V keep their ``H_kv`` heads: query
head ``h`` reads KV head ``h // (H // H_kv)``) and the mask described by kind instead of a materialised
``(B, 1, S_q, S_k)`` tensor where that is provably equivalent:

* ``causal=True``: query ``i`` sees keys ``j <= i + (S_k - S_q)`` (bottom-right aligned, as flash-attention);
* ``key_padding``: optional bool ``(B, S_k)``, ``True`` = a real token; padding keys are never attended;
* ``attn_mask``: optional general mask (bool, ``True`` = keep, or additive float) broadcastable to
  ``(B, H, S_q, S_k)``, for sites whose mask is not plain causal (sliding window, custom).

Query rows that see no key at all (left padding rows) produce zeros, as PyTorch's fused SDPA kernels do.

The registered op (which a transformed graph calls directly, past :func:`attention`) checks the same shapes on the
host (``ValueError``; no data is read) before computing; its CPU reference and CUDA SDPA paths are PyTorch ops, which
bound-check every index, so no input makes it touch memory out of bounds.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._common import renamed_kwargs


def _combined_mask(q: torch.Tensor, k: torch.Tensor, attn_mask, key_padding, causal: bool):
    """Bool keep-mask (or additive float mask) broadcastable to (B, H, S_q, S_k), or None."""
    s_q, s_k = q.shape[-2], k.shape[-2]
    keep = None
    if causal:
        i = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
        j = torch.arange(s_k, device=q.device)[None, :]
        keep = (j <= i)[None, None]
    if key_padding is not None:
        kp = key_padding.to(torch.bool)[:, None, None, :]
        keep = kp if keep is None else keep & kp
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask if keep is None else keep & attn_mask
        else:
            if keep is None:
                return attn_mask
            return attn_mask.masked_fill(~keep, float("-inf"))
    return keep


def attention_reference(q, k, v, attn_mask=None, key_padding=None, scale: Optional[float] = None,
                        causal: bool = False) -> torch.Tensor:
    """Plain-PyTorch (differentiable) ``kvt::attention``. Shapes as :func:`attention`; math in the input dtype
    promoted to at least fp32 for the softmax, output in ``q.dtype``."""
    h, h_kv = q.shape[1], k.shape[1]
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=1)
        v = v.repeat_interleave(h // h_kv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = _combined_mask(q, k, attn_mask, key_padding, causal)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # fully masked rows give 0 instead of NaN
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.matmul(p.to(v.dtype), v).to(q.dtype)


def _check(q, k, v, attn_mask, key_padding):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"kvt.attention expects q, k, v of shape (B, H, S, D); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must match q in batch and head_dim: q (B, H, S_q, D) = {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}")
    if k.shape != v.shape[:-1] + (k.shape[-1],) or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in (B, H_kv, S_k); got {tuple(k.shape)} and {tuple(v.shape)}")
    if key_padding is not None and tuple(key_padding.shape) != (q.shape[0], k.shape[2]):
        raise ValueError(f"key_padding must be (B, S_k) = {(q.shape[0], k.shape[2])}; got {tuple(key_padding.shape)}")


@torch.library.custom_op("kvt::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  key_padding: Optional[torch.Tensor], softmax_scale: float, causal: bool) -> torch.Tensor:
    _check(q, k, v, attn_mask, key_padding)
    s_q, s_k = q.shape[-2], k.shape[-2]
    if q.is_cuda and attn_mask is None and key_padding is None and (not causal or s_q == s_k):
        # PyTorch's fused (flash / memory-efficient) kernels; GQA without copying K/V.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                              enable_gqa=q.shape[1] != k.shape[1]).contiguous()
    return attention_reference(q, k, v, attn_mask, key_padding, softmax_scale, causal).contiguous()


@_attention_op.register_fake
def _(q, k, v, attn_mask, key_padding, softmax_scale, causal):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def _setup_ctx(ctx, inputs, output):
    q, k, v, attn_mask, key_padding, softmax_scale, causal = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_padding)
    ctx.softmax_scale, ctx.causal = softmax_scale, causal


def _backward(ctx, grad_out):
    q, k, v, attn_mask, key_padding = ctx.saved_tensors
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = attention_reference(qq, kk, vv, attn_mask, key_padding, ctx.softmax_scale, ctx.causal)
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad_out)
    return dq, dk, dv, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_ctx)


@renamed_kwargs(scale="softmax_scale")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              key_padding: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
              causal: bool = False) -> torch.Tensor:
    """Canonical attention ``softmax(q kᵀ · softmax_scale + mask) v`` with GQA by index mapping.

    Args:
        q: ``(B, H, S_q, D)`` fp32/fp16/bf16.
        k, v: ``(B, H_kv, S_k, D)``, same dtype and device as ``q``; ``H % H_kv == 0``.
        attn_mask: optional bool (True = keep) or additive float mask broadcastable to ``(B, H, S_q, S_k)``.
        key_padding: optional bool ``(B, S_k)``, True for real tokens.
        softmax_scale: default ``D ** -0.5`` (``scale=`` is the deprecated name).
        causal: bottom-right aligned causal mask.

    Returns:
        ``(B, H, S_q, D_v)`` in ``q.dtype`` (``D_v = v.shape[-1]``, usually ``D``).

    Raises:
        ValueError: rank, batch, head_dim or head-count mismatch, or a ``key_padding`` of the wrong shape.
    """
    _check(q, k, v, attn_mask, key_padding)
    softmax_scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return torch.ops.kvt.attention(q, k, v, attn_mask, key_padding, softmax_scale, bool(causal))
