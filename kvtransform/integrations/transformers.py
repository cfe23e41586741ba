"""DualKV as a Hugging Face attention implementation: packed shared-prefix batches through a model's own forward.

::

    kvt.integrations.transformers.enable(model, "dualkv")
    batch = kvt.pack_shared_prefix_groups([(prompt, [r1, r2, r3])])
    logits = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                   segment_prefix=batch.segment_prefix, use_cache=False).logits      # (1, T, vocab)
    logprobs = batch.response_logprobs(logits)

:func:`enable` registers ``kvt_dualkv`` with transformers' ``AttentionInterface`` (attention) and
``AttentionMaskInterface`` (its mask function) and switches the model to it. The keyword arguments of the model's
forward reach every attention layer (transformers' ``**kwargs`` path), so the layout (``cu_seqlens`` int32 ``(S+1,)``,
``segment_prefix`` int32 ``(S,)``; :class:`kvtransform.layout.DualKVLayout`) arrives with the queries, and the
attention runs ``kvt.dualkv_attention`` (DualKV, arXiv 2605.15422, §2–3; ``docs/ARCHITECTURE.md``): a response token
sees its group's prompt and its own response so far, so log-probs and gradients equal those of the N separate
sequences. Calls without a layout (generation, a plain padded batch) fall through to transformers' SDPA attention.

The mask function is transformers' SDPA mask, registered under the same name: without one, transformers builds no
causal mask for a custom attention name and the fallback path would silently attend to future tokens. In the
packed path the mask is ignored (the layout defines the attention); transformers still builds it once per forward
(a ``(1, 1, T, T)`` bool, since the restarting ``position_ids`` look like packed sequences to it).
"""
from __future__ import annotations

import torch

ATTENTION_NAME = "kvt_dualkv"

__all__ = ["ATTENTION_NAME", "enable", "disable", "dualkv_attention_forward", "dualkv_mask"]


def dualkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers attention function (``AttentionInterface``): ``query (1, H, T, D)``, ``key``/``value``
    ``(1, H_kv, T, D)`` → ``(attn_output (1, T, H, D), None)``.

    With ``cu_seqlens`` and ``segment_prefix`` in ``kwargs`` it runs ``kvt.dualkv_attention`` over the packed
    layout; without them, transformers' ``sdpa_attention_forward`` with the given mask.

    Raises:
        ValueError: only one of the two layout tensors, a batch other than 1, keys of another length than the
            queries (a KV cache), attention dropout, or a sliding-window layer: none of these is expressible in the
            packed layout.
    """
    cu, sp = kwargs.pop("cu_seqlens", None), kwargs.pop("segment_prefix", None)
    if cu is None and sp is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if cu is None or sp is None:
        raise ValueError("a packed DualKV batch needs both cu_seqlens and segment_prefix")
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"a packed DualKV batch is one row (1, T) without a KV cache (use_cache=False); got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by kvt.dualkv_attention (set the model's "
                         f"attention_dropout to 0)")
    if getattr(module, "sliding_window", None):
        raise ValueError(f"sliding-window attention (window {module.sliding_window}) cannot be expressed in the "
                         f"packed shared-prefix layout")
    from kvtransform.ops.dualkv import dualkv_attention

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    out = dualkv_attention(q, k, v, cu.to(q.device), sp.to(q.device), softmax_scale=scaling)
    return out[None], None


def dualkv_mask(*args, **kwargs):
    """transformers mask function (``AttentionMaskInterface``) paired with :func:`dualkv_attention_forward`: the
    SDPA mask (causal, padding-aware; ``None`` where ``is_causal`` suffices), used by the non-packed fallback."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, dualkv_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, dualkv_mask)


def enable(model: torch.nn.Module, kind: str = "dualkv") -> torch.nn.Module:
    """Register the DualKV attention and mask functions with transformers and switch ``model`` to them.

    Args:
        model: a transformers ``PreTrainedModel`` (decoder-only, causal, full attention).
        kind: ``"dualkv"``.

    Returns:
        ``model`` (modified in place: its attention implementation is ``"kvt_dualkv"``).

    Raises:
        ValueError: another ``kind``, a model that is not a transformers model, or one with sliding-window layers.
    """
    if kind != "dualkv":
        raise ValueError(f"kvt.integrations.transformers.enable supports 'dualkv'; got {kind!r}")
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation"):
        raise ValueError(f"enable() takes a transformers model; got {type(model).__name__}")
    layer_types = getattr(cfg, "layer_types", None) or []
    if any("sliding" in str(t) for t in layer_types) or (getattr(cfg, "use_sliding_window", False) and
                                                         getattr(cfg, "sliding_window", None)):
        raise ValueError(f"{type(model).__name__} has sliding-window attention layers, which the packed shared-prefix "
                         f"layout cannot express")
    _register()
    if not hasattr(model, "_kvt_previous_attn"):
        model._kvt_previous_attn = cfg._attn_implementation
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:  # pragma: no cover - older transformers
        cfg._attn_implementation = ATTENTION_NAME
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` back to the attention implementation it had before :func:`enable`."""
    prev = getattr(model, "_kvt_previous_attn", None)
    if prev is not None:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(prev)
        else:  # pragma: no cover
            model.config._attn_implementation = prev
        del model._kvt_previous_attn
    return model
