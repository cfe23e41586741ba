"""``kvt::attention``: the canonical attention op every standard attention site is rewritten into.

It is what ``aten.scaled_dot_product_attention`` computes, with GQA visible (K/V keep their ``H_kv`` heads: query
head ``h`` reads KV head ``h // (H // H_kv)``) and the mask described by kind instead of a materialised
``(B, 1, S_q, S_k)`` tensor where that is provably equivalent:

* ``causal=True``: query ``i`` sees keys ``j <= i + (S_k - S_q)`` (bottom-right aligned, as flash-attention);
* ``key_padding``: optional bool ``(B, S_k)``, ``True`` = a real token; padding keys are never attended;
* ``attn_mask``: optional general mask (bool, ``True`` = keep, or additive float) broadcastable to
  ``(B, H, S_q, S_k)``, for sites whose mask is neither causal nor causal within a window (custom).

Three optional variants (``docs/ARCHITECTURE.md``; checked by
:func:`kvtransform.ops._common.check_attention_variants`), all off by default:

* ``window`` (int >= 1): HF ``sliding_window`` semantics (Mistral, Gemma 2/3, gpt-oss): query ``i`` (at position
  ``i + S_k - S_q``) sees keys ``i' - window < j <= i'``, i.e. causal within the last ``window`` keys;
* ``softcap`` (float > 0): Gemma 2's logit soft-capping ``s = softcap * tanh(s / softcap)`` on the scaled scores,
  before the mask;
* ``sinks`` (``(H,)`` float): gpt-oss's learned attention sinks, one extra term ``exp(sinks[h])`` in every row's
  softmax denominator (a virtual key with value 0); they receive a gradient.

Query rows that see no key at all (left padding rows) produce zeros, as PyTorch's fused SDPA kernels do.

On CUDA, PyTorch's SDPA runs the sites it can express (no mask tensor, no key padding; a window as a boolean band
when ``S_q <= S_k``); soft-capping and sinks, which SDPA cannot express, run the reference math on CUDA too.

The registered op (which a transformed graph calls directly, past :func:`attention`) checks the same shapes on the
host (``ValueError``; no data is read) before computing; its CPU reference and CUDA SDPA paths are PyTorch ops, which
bound-check every index, so no input makes it touch memory out of bounds.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._common import as_scale, autocast_inputs, check_attention_variants, renamed_kwargs


def _band(s_q: int, s_k: int, causal: bool, window: Optional[int], device) -> Optional[torch.Tensor]:
    """Bool ``(S_q, S_k)`` bottom-right aligned keep-mask: causal (``j <= i'``), within ``window`` when given
    (``i' - window < j <= i'``); None when neither."""
    if not causal and window is None:
        return None
    i = torch.arange(s_q, device=device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=device)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (j > i - window)
    return keep


def _combined_mask(q: torch.Tensor, k: torch.Tensor, attn_mask, key_padding, causal: bool,
                   window: Optional[int] = None):
    """Bool keep-mask (or additive float mask) broadcastable to (B, H, S_q, S_k), or None."""
    keep = _band(q.shape[-2], k.shape[-2], causal, window, q.device)
    if keep is not None:
        keep = keep[None, None]
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
                        causal: bool = False, window: Optional[int] = None, softcap: Optional[float] = None,
                        sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain-PyTorch (differentiable, sinks included) ``kvt::attention``. Shapes and variants as :func:`attention`;
    scores, soft-cap and softmax in fp32 (fp64 for fp64 inputs), output in ``q.dtype``."""
    h, h_kv = q.shape[1], k.shape[1]
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=1)
        v = v.repeat_interleave(h // h_kv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    soft = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = _combined_mask(q, k, attn_mask, key_padding, causal, window)
    scores = torch.matmul(q, k.transpose(-1, -2)).to(soft) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(soft)
    m = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:  # a virtual key with logit sinks[h] and value 0: one more denominator term
        sink = sinks.to(soft)[None, :, None, None].expand(scores.shape[0], -1, scores.shape[2], 1)
        m = torch.maximum(m, sink).detach()
    # fully masked rows (max -inf): 0 instead of NaN; a NaN (a NaN sink or score) stays NaN
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m).detach()
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.matmul(p.to(v.dtype), v).to(q.dtype)


def _check(q, k, v, attn_mask, key_padding, window=None, softcap=None, sinks=None):
    """Shape checks (host only, no data read) and the variants normalised: returns ``(window, softcap, sinks)``."""
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
    if not all(x.dtype.is_floating_point for x in (q, k, v)) or (
            len({q.dtype, k.dtype, v.dtype}) > 1 and not torch.is_autocast_enabled(q.device.type)):
        raise ValueError(f"q, k, v must share one float dtype (outside torch.autocast); got {q.dtype}, {k.dtype}, "
                         f"{v.dtype} (cast k and v with .to(q.dtype))")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, t in (("attn_mask", attn_mask), ("key_padding", key_padding)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor or None; got {type(t).__name__} (the order is q, k, v, "
                             f"attn_mask, key_padding, softmax_scale, causal: pass the scale and causal by keyword)")
    if key_padding is not None and tuple(key_padding.shape) != (q.shape[0], k.shape[2]):
        raise ValueError(f"key_padding must be (B, S_k) = {(q.shape[0], k.shape[2])}; got {tuple(key_padding.shape)}")
    if key_padding is not None and (key_padding.dtype.is_floating_point or key_padding.dtype.is_complex):
        raise ValueError(f"key_padding must be bool or 0/1 integers (True = a real token); got {key_padding.dtype} "
                         f"(an additive 0/-inf mask goes in attn_mask)")
    if attn_mask is not None:
        _check_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    if k.shape[2] == 0 or q.shape[-1] == 0:
        raise ValueError(f"kvt.attention needs at least one key and head_dim >= 1; got S_k={k.shape[2]}, "
                         f"head_dim={q.shape[-1]}")
    return check_attention_variants(window, softcap, sinks, q.shape[1], q.device)


def _check_mask(attn_mask: torch.Tensor, scores: tuple) -> None:
    """One line for an ``attn_mask`` that is neither bool nor float (a 0/1 integer mask was added to the scores),
    or that does not broadcast to the scores' ``(B, H, S_q, S_k)`` (PyTorch's SDPA refuses both)."""
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise ValueError(f"attn_mask must be bool (True = keep) or an additive float mask; got {attn_mask.dtype} "
                         f"(a 0/1 keep-mask: pass mask.bool())")
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(m != 1 and m != s for m, s in zip(shape[::-1], scores[::-1])):
        hint = " (a (B, S_q, S_k) mask: add the head axis, mask[:, None])" if len(shape) == 3 else ""
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to the scores' (B, H, S_q, S_k) = "
                         f"{scores}{hint}")


@torch.library.custom_op("kvt::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                  key_padding: Optional[torch.Tensor], softmax_scale: float, causal: bool,
                  window: Optional[int] = None, softcap: Optional[float] = None,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    window, softcap, sinks = _check(q, k, v, attn_mask, key_padding, window, softcap, sinks)
    s_q, s_k = q.shape[-2], k.shape[-2]
    if q.is_cuda and attn_mask is None and key_padding is None and softcap is None and sinks is None and (
            (window is None and (not causal or s_q == s_k)) or (window is not None and s_q <= s_k)):
        # PyTorch's fused (flash / memory-efficient) kernels; GQA without copying K/V. A window is a boolean band
        # (every row keeps at least its own key when S_q <= S_k, so no row is empty).
        band = None if window is None else _band(s_q, s_k, True, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band, is_causal=causal and band is None,
                                              scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1]).contiguous()
    return attention_reference(q, k, v, attn_mask, key_padding, softmax_scale, causal, window, softcap,
                               sinks).contiguous()


@_attention_op.register_fake
def _(q, k, v, attn_mask, key_padding, softmax_scale, causal, window=None, softcap=None, sinks=None):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def _setup_ctx(ctx, inputs, output):
    q, k, v, attn_mask, key_padding, softmax_scale, causal, window, softcap, sinks = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_padding, sinks)
    ctx.softmax_scale, ctx.causal, ctx.window, ctx.softcap = softmax_scale, causal, window, softcap


def _backward(ctx, grad_out):
    """Gradients by autograd through :func:`attention_reference` (dq, dk, dv; dsinks when sinks were given). Under
    ``create_graph=True`` (grad mode on here) they are built differentiably from the saved inputs, so second
    derivatives (a gradient penalty, a Hessian-vector product) are exact rather than silently dropped."""
    q, k, v, attn_mask, key_padding, sinks = ctx.saved_tensors
    create_graph = torch.is_grad_enabled()

    def leaf(t):  # the saved input itself where the gradients must stay connected to it
        return t if create_graph and t.requires_grad else t.detach().requires_grad_(True)

    with torch.enable_grad():
        leaves = [leaf(t) for t in (q, k, v)]
        sk = None if sinks is None else leaf(sinks)
        out = attention_reference(*leaves, attn_mask, key_padding, ctx.softmax_scale, ctx.causal, ctx.window,
                                  ctx.softcap, sk)
        grads = torch.autograd.grad(out, leaves + ([sk] if sk is not None else []), grad_out,
                                    create_graph=create_graph)
    dsinks = grads[3].to(sinks.dtype) if sk is not None else None
    return grads[0], grads[1], grads[2], None, None, None, None, None, None, dsinks


_attention_op.register_autograd(_backward, setup_context=_setup_ctx)


@renamed_kwargs(scale="softmax_scale")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              key_padding: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
              causal: bool = False, *, window: Optional[int] = None, softcap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Canonical attention ``softmax(q kᵀ · softmax_scale + mask) v`` with GQA by index mapping, optionally within a
    sliding window, soft-capped, with learned sinks.

    Args:
        q: ``(B, H, S_q, D)`` fp32/fp16/bf16.
        k, v: ``(B, H_kv, S_k, D)``, same dtype and device as ``q``; ``H % H_kv == 0``. Under ``torch.autocast``
            all three are cast to the autocast dtype first (as SDPA's are).
        attn_mask: optional bool (True = keep) or additive float mask broadcastable to ``(B, H, S_q, S_k)``.
        key_padding: optional bool ``(B, S_k)``, True for real tokens.
        softmax_scale: default ``D ** -0.5`` (``scale=`` is the deprecated name).
        causal: bottom-right aligned causal mask.
        window: keyword-only; int ``>= 1``: query ``i`` (position ``i' = i + S_k - S_q``) sees keys
            ``i' - window < j <= i'`` (HF ``sliding_window``; implies causal). ``None``: no window.
        softcap: keyword-only; float ``> 0``: scores ``s = softcap * tanh(s / softcap)`` before the mask
            (Gemma 2's ``attn_logit_softcapping``). ``None``: off.
        sinks: keyword-only; ``(H,)`` float tensor on q's device: gpt-oss's learned sink logit per query head, an
            extra ``exp(sinks[h])`` in every softmax denominator (computed in fp32; it receives a gradient).

    Returns:
        ``(B, H, S_q, D_v)`` in ``q.dtype`` (``D_v = v.shape[-1]``, usually ``D``).

    Raises:
        ValueError: rank, batch, head_dim or head-count mismatch, q/k/v of different dtypes or devices (or not
            floats), no keys or ``head_dim`` 0, a ``key_padding`` of the wrong shape or a float one, an
            ``attn_mask`` neither bool nor float or not broadcastable to ``(B, H, S_q, S_k)``, a window
            that is not a positive int, a soft-cap that is not a finite float > 0, sinks that are not ``(H,)``.
    """
    q, k, v = autocast_inputs(q, k, v)
    window, softcap, sinks = _check(q, k, v, attn_mask, key_padding, window, softcap, sinks)
    softmax_scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale)
    variants = {n: x for n, x in (("window", window), ("softcap", softcap), ("sinks", sinks)) if x is not None}
    return torch.ops.kvt.attention(q, k, v, attn_mask, key_padding, softmax_scale, bool(causal), **variants)
