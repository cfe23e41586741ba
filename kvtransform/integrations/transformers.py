"""DualKV as a Hugging Face attention implementation: packed shared-prefix batches through a model's own forward.

::

    kvt.integrations.transformers.enable(model, "dualkv")
    batch = kvt.pack_shared_prefix_groups([(prompt, [r1, r2, r3])])
    logits = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                   segment_prefix=batch.segment_prefix, use_cache=False).logits      # (1, T, vocab)
    logprobs = batch.response_logprobs(logits)

    tree = kvt.pack_trajectories([traj_1, traj_2, traj_3], loss_masks=[...])  # prefix trees, any depth
    logits = model(tree.input_ids, position_ids=tree.position_ids, prefix_tree_layout=tree.layout,
                   use_cache=False).logits
    logprobs = tree.trajectory_logprobs(logits)

    logits = model(**packed_inputs(batch_or_tree)).logits                   # either kind, the same call

:func:`enable` registers ``kvt_dualkv`` with transformers' ``AttentionInterface`` (attention) and
``AttentionMaskInterface`` (its mask function) and switches the model to it. The keyword arguments of the model's
forward reach every attention layer (transformers' ``**kwargs`` path), so the layout (``cu_seqlens`` int32 ``(S+1,)``,
``segment_prefix`` int32 ``(S,)``; :class:`kvtransform.layout.DualKVLayout`) arrives with the queries, and the
attention runs ``kvt.dualkv_attention`` (DualKV, arXiv 2605.15422, §2–3; ``docs/ARCHITECTURE.md``): a response token
sees its group's prompt and its own response so far, so log-probs and gradients equal those of the N separate
sequences. A :class:`~kvtransform.tree_packing.TreeBatch`'s layout (``prefix_tree_layout``, a
:class:`~kvtransform.tree_layout.PrefixTreeLayout`) runs ``kvt.prefix_tree_attention`` instead (Tree Training, arXiv
2511.00413): a token sees every ancestor node and its own node so far, so each trajectory's log-probs and gradients
equal those of the trajectory run alone. Calls without a layout (generation, a plain padded batch) fall through to
transformers' SDPA attention (or, for soft-capped or sink attention, which SDPA cannot express, to the model's own
eager attention).

Attention variants (:func:`attention_variants`): a sliding-window layer (Mistral, Gemma 2/3, gpt-oss: the
``sliding_window`` keyword transformers passes per layer), Gemma 2's logit soft-cap (``softcap``) and gpt-oss's
learned sinks (``s_aux``) reach the ops as their ``window``/``softcap``/``sinks`` arguments, the window over each
sequence's own positions (a response token sees the prompt tokens within its window). Mixture-of-experts models
(Qwen3-MoE, gpt-oss) and fused QKV projections (Phi-3) need nothing here: only the attention is replaced.

The mask function is transformers' SDPA mask, registered under the same name: without one, transformers builds no
causal mask for a custom attention name and the fallback path would silently attend to future tokens. In the
packed path the mask is ignored (the layout defines the attention); transformers still builds it once per forward
(a ``(1, 1, T, T)`` bool, since the restarting ``position_ids`` look like packed sequences to it). A packed call's own
``attention_mask``, if given, must be all ones (a packed batch has no padding).
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from .packed_call import ATTENTION_NAME, _check_packed_call, _leave_call

__all__ = ["ATTENTION_NAME", "enable", "disable", "dualkv_attention_forward", "dualkv_mask", "packed_inputs",
           "attention_variants"]


def dualkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers attention function (``AttentionInterface``): ``query (1, H, T, D)``, ``key``/``value``
    ``(1, H_kv, T, D)`` → ``(attn_output (1, T, H, D), None)``.

    With ``cu_seqlens`` and ``segment_prefix`` (int32) in ``kwargs`` it runs ``kvt.dualkv_attention`` over the packed
    layout; with ``prefix_tree_layout`` (a :class:`~kvtransform.tree_layout.PrefixTreeLayout`),
    ``kvt.prefix_tree_attention``; without either, transformers' ``sdpa_attention_forward`` with the given mask.

    Raises:
        ValueError: only one of the two DualKV layout tensors, both kinds of layout, a ``prefix_tree_layout`` that is
            not a PrefixTreeLayout, a batch other than 1, keys of another length than the queries (a KV cache),
            attention dropout (none of these is expressible in a packed layout), or a window, soft-cap or sinks
            (:func:`attention_variants`) that the installed op does not take yet.
    """
    cu, sp = kwargs.pop("cu_seqlens", None), kwargs.pop("segment_prefix", None)
    tree = kwargs.pop("prefix_tree_layout", None)
    if cu is None and sp is None and tree is None:
        return _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if tree is not None and (cu is not None or sp is not None):
        raise ValueError("pass either prefix_tree_layout (a TreeBatch) or cu_seqlens/segment_prefix (a PackedBatch), "
                         "not both")
    if tree is None and (cu is None or sp is None):
        raise ValueError("a packed DualKV batch needs both cu_seqlens and segment_prefix")
    if tree is None and not (isinstance(cu, torch.Tensor) and isinstance(sp, torch.Tensor)):
        raise ValueError(f"cu_seqlens and segment_prefix must be int32 tensors (PackedBatch.cu_seqlens and "
                         f".segment_prefix from kvt.pack_shared_prefix); got {type(cu).__name__} and "
                         f"{type(sp).__name__}")
    what = "packed DualKV" if tree is None else "packed prefix-tree"
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError(f"a {what} batch is one row (1, T) without a KV cache (use_cache=False); got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by packed attention (set the model's "
                         f"attention_dropout to 0)")
    variants = attention_variants(module, kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, D)
    dv = v.shape[-1]
    if dv != k.shape[-1]:  # MLA (DeepSeek-V2/V3): a value head size other than the query/key one
        # zero columns change neither q·k nor the kept output columns: exact, as HF pads V for FlashAttention
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        width = max(dv, k.shape[-1])
        q, k, v = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    if tree is not None:
        from kvtransform.ops.prefix_tree import PrefixTreeLayout, prefix_tree_attention

        if not isinstance(tree, PrefixTreeLayout):
            raise ValueError(f"prefix_tree_layout must be a PrefixTreeLayout (TreeBatch.layout from "
                             f"kvt.pack_trajectories); got {type(tree).__name__}")
        # a one-level tree runs DualKV's kernels (faster on that shape); float64 (CPU) only has the tree op
        one_level = tree.as_dualkv() if q.dtype != torch.float64 else None
        if one_level is None:
            extra = _op_variant_kwargs(prefix_tree_attention, variants, what)
            return prefix_tree_attention(q, k, v, tree, softmax_scale=scaling, **extra)[None, ..., :dv], None
        cu, sp = one_level.cu_seqlens, one_level.segment_prefix
    from kvtransform.ops.dualkv import dualkv_attention

    extra = _op_variant_kwargs(dualkv_attention, variants, what)
    out = dualkv_attention(q, k, v, cu.to(q.device), sp.to(q.device), softmax_scale=scaling, **extra)
    return out[None, ..., :dv], None


def attention_variants(module: torch.nn.Module, kwargs: dict) -> dict:
    """The attention variant of one HF attention call, as the kvt ops' keyword arguments (only those that are on):
    ``window`` (int, HF ``sliding_window`` semantics: the query at position i sees keys i - window < j <= i; from
    the ``sliding_window`` keyword Mistral, Qwen, Phi-3, Gemma 2/3 and gpt-oss pass, else the module's attribute),
    ``softcap`` (float, Gemma 2's ``softcap`` keyword only: HF's attention functions read no module attribute for
    it, and Gemma 3 keeps an ``attn_logit_softcapping`` it never applies) and ``sinks`` (gpt-oss's learned per-head
    sink logits ``(H,)``: the ``s_aux`` keyword, else the module's ``sinks`` parameter, which gpt-oss's eager
    attention reads). Reads ``kwargs`` without removing anything."""
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    out = {}
    if window is not None:
        out["window"] = window
    if softcap is not None:
        out["softcap"] = softcap
    if sinks is not None:
        out["sinks"] = sinks
    return out


def _op_variant_kwargs(op, variants: dict, what: str) -> dict:
    """``variants`` if the packed attention function ``op`` takes each of them; else a one-line ValueError (an
    argument is never dropped: the attention would silently be another one)."""
    missing = [name for name in variants if name not in _parameters(op)]
    if missing:
        raise ValueError(f"this model's attention uses {', '.join(f'{m}={_show(variants[m])}' for m in missing)}, "
                         f"which the {what} attention op ({op.__name__}) does not support yet")
    return variants


@functools.lru_cache(maxsize=16)
def _parameters(op) -> frozenset:
    """The parameter names of ``op`` (read once per function: every attention layer asks on every call)."""
    return frozenset(inspect.signature(op).parameters)


def _show(x) -> str:
    return f"Tensor{tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


def _fallback_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs):
    """A call without a packed layout: transformers' SDPA attention, or, for a soft-capped or sink attention (which
    SDPA cannot express), the model's own ``eager_attention_forward`` with the SDPA mask turned additive (a skipped
    mask, ``None``, is the bottom-right causal one, limited to the layer's window)."""
    if not {"softcap", "sinks"} & set(attention_variants(module, kwargs)):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    import sys

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__} soft-caps its logits or has attention sinks but its modeling "
                         f"module has no eager_attention_forward to run a call without a packed layout")
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        i = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device)[None, :]
        keep = j <= i
        window = attention_variants(module, kwargs).get("window")
        if window is not None:
            keep = keep & (j > i - window)
        attention_mask = keep[None, None]
    if attention_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        attention_mask = torch.where(attention_mask[..., :kv_len], zero, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def packed_inputs(batch) -> dict:
    """The keyword arguments of ``model(**packed_inputs(batch))`` for a :class:`~kvtransform.packing.PackedBatch`
    (``cu_seqlens``, ``segment_prefix``) or a :class:`~kvtransform.tree_packing.TreeBatch` (``prefix_tree_layout``),
    with ``input_ids`` and ``position_ids`` ``(1, T)``, ``use_cache=False`` and ``attention_mask``, a
    :class:`~kvtransform.packing.PackedLayoutMask`: a model under :func:`enable` drops it, and a model without
    packed attention raises ``UnpackedModelError`` (a ``ValueError``) when its mask code reads it, instead of
    computing every branch without its prefix.

    Raises:
        ValueError: ``batch`` is neither (build one with kvt.pack_shared_prefix_groups or kvt.pack_trajectories).
    """
    from kvtransform.packing import PackedBatch, PackedLayoutMask
    from kvtransform.tree_packing import TreeBatch

    out = {"input_ids": getattr(batch, "input_ids", None), "position_ids": getattr(batch, "position_ids", None),
           "attention_mask": PackedLayoutMask(), "use_cache": False}
    if isinstance(batch, TreeBatch):
        return {**out, "prefix_tree_layout": batch.layout}
    if isinstance(batch, PackedBatch):
        return {**out, "cu_seqlens": batch.cu_seqlens, "segment_prefix": batch.segment_prefix}
    raise ValueError(f"packed_inputs takes a PackedBatch (kvt.pack_shared_prefix_groups) or a TreeBatch "
                     f"(kvt.pack_trajectories); got {type(batch).__name__}")


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
    """Register the DualKV attention and mask functions with transformers and switch ``model`` to them (packed
    shared-prefix batches and prefix-tree batches, :func:`dualkv_attention_forward`).

    Args:
        model: a transformers ``PreTrainedModel`` (decoder-only, causal; sliding-window layers, soft-capped logits
            and attention sinks run through the ops' ``window``/``softcap``/``sinks`` arguments).
        kind: ``"dualkv"``.

    Returns:
        ``model`` (modified in place: its attention implementation is ``"kvt_dualkv"``).

    Raises:
        ValueError: another ``kind``, a model that is not a transformers model, one with non-causal (bidirectional)
            attention, one whose attention does not go through transformers' attention interface (Falcon), a head_dim
            the packed ops do not take (above 256), a config window or soft-cap the ops refuse (a window below 1, a
            soft-cap of 0), or one whose attention variant (window, soft-cap, sinks) an installed packed attention op
            does not take.
    """
    if kind != "dualkv":
        raise ValueError(f"kvt.integrations.transformers.enable supports 'dualkv'; got {kind!r}")
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation"):
        raise ValueError(f"enable() takes a transformers model; got {type(model).__name__}")
    from kvtransform.model_features import check_attention_only_mixing, config_attention_variants
    from kvtransform.models import check_causal_lm

    check_causal_lm(model)  # packed attention is causal: a bidirectional model (EmbeddingGemma) would silently change
    check_attention_only_mixing(model, "enable()")
    if getattr(model, "_supports_attention_backend", True) is False:  # (its attention never calls the interface)
        raise ValueError(f"{type(model).__name__} runs its own attention code, not transformers' attention "
                         f"interface, so enable() cannot give it packed attention (each packed row would attend "
                         f"across its segments): use kvt.transform(model, 'dualkv') or unpacked batches")
    needed = config_attention_variants(model)
    from kvtransform.ops._common import check_attention_variants
    from kvtransform.ops.dualkv import check_head_dim, dualkv_attention

    heads, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    try:  # the config's values, at enable() rather than at the first packed forward
        check_attention_variants(needed.get("window"), needed.get("softcap"), None, int(heads or 1))
    except ValueError as e:
        raise ValueError(f"{type(model).__name__}'s config (sliding_window / attn_logit_softcapping): {e}") from None
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads and hidden else None)
    if isinstance(head_dim, int):
        check_head_dim(int(head_dim))  # at enable(), not at the first packed forward
    from kvtransform.ops.prefix_tree import prefix_tree_attention

    for op, what in ((dualkv_attention, "packed DualKV"), (prefix_tree_attention, "packed prefix-tree")):
        _op_variant_kwargs(op, needed, what)
    _register()
    _remove_hooks(model, "_kvt_disabled_guard")
    if "_kvt_previous_attn" not in model.__dict__:
        model._kvt_previous_attn = cfg._attn_implementation
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:  # pragma: no cover - older transformers
        cfg._attn_implementation = ATTENTION_NAME
    if "_kvt_packed_hook" not in model.__dict__:  # the model and each transformers model in it
        from transformers import PreTrainedModel

        hooked = [m for m in model.modules() if m is model or isinstance(m, PreTrainedModel)]
        model._kvt_packed_hook = ([m.register_forward_pre_hook(_check_packed_call, with_kwargs=True) for m in hooked]
                                  + [m.register_forward_hook(_leave_call, always_call=True) for m in hooked])
    return model


def _lift(model: torch.nn.Module) -> bool:
    """Undo :func:`enable` on ``model`` (its previous attention implementation, the hooks removed); whether it was
    enabled."""
    enabled = False
    # (the module's own attributes: a wrapper such as PEFT's forwards getattr to the model it wraps)
    prev = model.__dict__.pop("_kvt_previous_attn", None)
    if prev is not None:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(prev)
        else:  # pragma: no cover
            model.config._attn_implementation = prev
        enabled = True
    _remove_hooks(model, "_kvt_disabled_guard")
    return _remove_hooks(model, "_kvt_packed_hook") or enabled


def _remove_hooks(model: torch.nn.Module, attr: str) -> bool:
    """Remove the hook handles listed in ``model.<attr>`` and the attribute; whether there were any."""
    hooks = model.__dict__.pop(attr, None)
    for hook in hooks or ():
        hook.remove()
    return hooks is not None


def _refuse_layout_while_disabled(model, args, kwargs):
    """Forward pre-hook that :func:`disable` leaves: transformers' own attention ignores a packed layout (it passes
    unknown keywords through), which would cut every branch off its prefix without an error."""
    if {"prefix_tree_layout", "cu_seqlens", "segment_prefix"} & set(kwargs):
        raise ValueError("this model's packed attention is disabled (kvt.integrations.transformers.disable): call "
                         "kvt.integrations.transformers.enable(model, 'dualkv') before a packed batch")


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Switch ``model`` back to the attention implementation it had before :func:`enable`. A packed batch's layout
    keywords are then refused in one line (the model's own attention would ignore them, a silently wrong answer)
    until :func:`enable` again. A model never enabled refuses ``model(**packed_inputs(batch))`` too (its
    ``attention_mask``, :class:`~kvtransform.packing.PackedLayoutMask`); layout keywords passed by hand without
    :func:`packed_inputs` it cannot see. A model enabled inside ``model`` (e.g. the base model of a PEFT wrapper)
    is switched back too."""
    guarded = "_kvt_disabled_guard" in model.__dict__
    lifted = [_lift(m) for m in list(model.modules())]  # every enabled model in it, ``model`` first
    if any(lifted) or guarded:  # (a second disable() keeps the guard)
        _guard(model)
    return model


def _guard(model: torch.nn.Module) -> None:
    from transformers import PreTrainedModel

    model._kvt_disabled_guard = [m.register_forward_pre_hook(_refuse_layout_while_disabled, with_kwargs=True)
                                 for m in model.modules() if m is model or isinstance(m, PreTrainedModel)]


@contextlib.contextmanager
def suspended(model: torch.nn.Module):
    """The block runs ``model`` as it was before :func:`enable` (its own attention, no hooks: what ``torch.export``
    captures in :func:`kvtransform.transform`); an enabled model is enabled again afterwards."""
    guarded = "_kvt_disabled_guard" in model.__dict__
    enabled = _lift(model)
    try:
        yield model
    finally:
        if enabled:
            enable(model)
        elif guarded:
            _guard(model)
