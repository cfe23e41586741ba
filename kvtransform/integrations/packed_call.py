"""The checks :func:`kvtransform.integrations.transformers.enable` runs before every forward of an enabled model
(a pre-hook on the model and every transformers model inside it): a packed call (a DualKV or prefix-tree layout)
brings matching ``position_ids`` and ids, no KV cache, no padding, no labels; a call without a layout whose
``position_ids`` fall back mid-row (a packed batch passed without its layout) is refused. A nested hooked model
(the backbone inside the LM) does not check the same objects again."""
from __future__ import annotations

import inspect
import weakref

import torch

#: the name the DualKV attention and mask functions are registered under with transformers
ATTENTION_NAME = "kvt_dualkv"


def _call_arguments(module, args, kwargs) -> dict:
    """The call's arguments by name (positional ones bound to ``module.forward``'s parameters, ``**kwargs``
    flattened)."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError:  # the forward itself will say what is wrong
        return dict(kwargs, **({"input_ids": args[0]} if args else {}))
    named = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


#: The inputs of the last packed call that passed :func:`_check_packed_call` (weak references and the tensors'
#: version counters): the backbone's own hook, called inside the top model's forward with the same objects, does not
#: check again. Only a nested call reuses it (:data:`_depth`): every outermost call is checked.
_last_checked: list = []
#: The same for the ``position_ids`` of the last call without a layout that passed
#: :func:`_refuse_packed_positions_without_layout` (one device sync per forward, not one per hooked model).
_last_positions: list = []
#: How many hooked models' forwards are running (a pre-hook adds one, an always-called forward hook takes it off).
_depth: list = [0]


def _ref(obj):
    return (lambda: None) if obj is None else weakref.ref(obj)


def _version(obj):
    """A tensor's version counter (None for anything else); inference-mode tensors keep none, so they get a fresh
    object each time (never taken as checked)."""
    if not isinstance(obj, torch.Tensor):
        return None
    return object() if obj.is_inference() else obj._version


def _checked_already(objs, memo=None) -> bool:
    """Inside a hooked model's forward, ``objs`` are the very objects of ``memo`` (default :data:`_last_checked`),
    the tensors unmodified since; an outermost call is never taken as checked."""
    memo = _last_checked if memo is None else memo
    return _depth[0] > 1 and len(memo) == len(objs) and all(
        ref() is o and ver == _version(o) for (ref, ver), o in zip(memo, objs))


def _leave_call(module, args, output):
    """Forward hook (always called, also when the forward or a pre-hook raised) paired with
    :func:`_check_packed_call`: one hooked forward less is running."""
    _depth[0] = max(0, _depth[0] - 1)


def _refuse_packed_positions_without_layout(model, args, kwargs) -> None:
    """A call without a layout whose ``position_ids`` fall back to a value above 0 between two attended tokens (a
    segment continuing its prefix's positions: a DualKV or prefix-tree batch): without a mask transformers would
    read the drop as the start of another packed sequence (which restarts at 0) and cut the branch off its prefix,
    with one (a tokenizer's all-ones mask) attend causally across the branches: silently wrong answers either way.
    Padding (mask 0) is not looked at, nor are calls with a custom (4-D) mask. packed_inputs' ``attention_mask``
    marker without its layout keywords (they were dropped) is refused too."""
    from kvtransform.packing import PackedLayoutMask

    pos = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, PackedLayoutMask):
        raise ValueError("this call has packed_inputs(batch)'s attention_mask but not its layout (cu_seqlens/"
                         "segment_prefix or prefix_tree_layout): pass all of model(**packed_inputs(batch))")
    if pos is None and len(args) > 1:
        named = _call_arguments(model, args, kwargs)
        pos, mask = named.get("position_ids"), named.get("attention_mask")
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] < 2:
        return
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.shape == pos.shape):
        return  # a custom (4-D) mask defines the attention itself
    if _checked_already((pos, mask), _last_positions):
        return
    drop = _position_drop(pos, mask)
    if drop is not None:
        raise ValueError(f"position_ids fall back to {drop[1]} at token {drop[0]} without a packed layout (a "
                         f"shared-prefix or tree batch?): call model(**kvt.integrations.transformers."
                         f"packed_inputs(batch)), which passes the layout")
    _last_positions[:] = [(_ref(o), _version(o)) for o in (pos, mask)]


def _position_drop(pos: torch.Tensor, mask=None):
    """``(token, position)`` of the first fall-back in ``(B, T)`` ``position_ids`` (a value above 0 that is not above
    its predecessor; with a ``(B, T)`` ``attention_mask``, between two attended tokens only: padding's positions are
    anyone's), or None; one device sync."""
    nxt = pos[:, 1:]
    drop = (nxt <= pos[:, :-1]) & (nxt != 0)
    if mask is not None:
        drop = drop & mask[:, 1:].bool() & mask[:, :-1].bool()
    if not bool(drop.any()):
        return None
    row, col = (int(x) for x in drop.nonzero()[0])
    return col + 1, int(pos[row, col + 1])


def _check_packed_call(model, args, kwargs):
    """Forward pre-hook that :func:`enable` installs on the model and on every transformers model inside it (a
    direct call of the backbone, ``model.model(...)``, is checked too): a call with a packed layout
    (``prefix_tree_layout``, or ``cu_seqlens``/``segment_prefix``) must bring the batch's ``position_ids`` (without
    them transformers numbers the packed axis 0..T-1, a silently wrong answer), ids inside the vocabulary, and no KV
    cache; such a call never writes a cache (``use_cache`` is forced off: a cache of a packed batch mixes every
    branch's K/V). Arguments given by position count as given (the call continues with every argument by name).

    Raises:
        ValueError: no ``position_ids``, ``position_ids`` or ids that disagree with the layout, a KV cache
            (``past_key_values`` or ``cache``), an ``attention_mask`` that is not all ones (a packed batch has no
            padding), ``labels`` (shifted along the packed axis they pair tokens of different branches),
            ``output_attentions`` (no attention matrix is formed).
    """
    from kvtransform.layout import DualKVLayout, _has_data
    from kvtransform.model_features import position_limits
    from kvtransform.packing import PackedLayoutMask, check_packed, check_rope_lengths
    from kvtransform.tree_layout import PrefixTreeLayout

    _depth[0] += 1  # (first: :func:`_leave_call` runs even when this hook raises)
    if not {"prefix_tree_layout", "cu_seqlens", "segment_prefix"} & set(kwargs):
        _refuse_packed_positions_without_layout(model, args, kwargs)
        return None  # (a forward takes the layout through **kwargs only: by name)
    named = _call_arguments(model, args, kwargs)
    tree, cu, sp = (named.get(k) for k in ("prefix_tree_layout", "cu_seqlens", "segment_prefix"))
    if tree is None and cu is None and sp is None:  # layout keywords given as None: an unpacked call
        _refuse_packed_positions_without_layout(model, args, kwargs)
        return None
    if isinstance(named.get("attention_mask"), PackedLayoutMask):  # packed_inputs' marker: no mask, dropped
        named["attention_mask"] = None
    impl = getattr(getattr(model, "config", None), "_attn_implementation", ATTENTION_NAME)
    if isinstance(impl, str) and impl != ATTENTION_NAME:  # its attention would ignore the layout
        raise ValueError(f"this model's attention implementation is {impl!r}, set after kvt.integrations."
                         f"transformers.enable(), and it ignores a packed layout: call enable(model, 'dualkv') again "
                         f"before a packed batch")
    for key in ("past_key_values", "cache"):  # (the cache argument's two names across transformers 5.x)
        if named.get(key) is not None:
            raise ValueError(f"a packed batch runs without a KV cache: drop {key} (and use_cache)")
    if named.get("output_attentions"):  # HF's sdpa path only warns and returns none; a packed call refuses
        raise ValueError("packed attention computes no attention weights: drop output_attentions (or run the "
                         "unpacked model with attn_implementation='eager' to inspect them)")
    if named.get("labels") is not None:  # transformers shifts labels along the packed axis, across node boundaries
        raise ValueError("a packed batch cannot take labels= (the model's loss would pair tokens of different "
                         "branches): compute the loss from batch.trajectory_logprobs(logits) (a TreeBatch) or "
                         "batch.response_logprobs(logits) (a PackedBatch)")
    input_ids, position_ids = named.get("input_ids"), named.get("position_ids")
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError("a packed batch needs input_ids (1, T): call model(**kvt.integrations.transformers."
                         "packed_inputs(batch))")
    if position_ids is None:
        raise ValueError("a packed batch needs position_ids=batch.position_ids (each segment continues its parent's "
                         "positions): call model(**kvt.integrations.transformers.packed_inputs(batch))")
    mask = named.get("attention_mask")
    objs = (input_ids, position_ids, tree, cu, sp, mask)
    if not _checked_already(objs):
        want = (1, input_ids.shape[-1])
        if isinstance(mask, torch.Tensor) and tuple(mask.shape) != want:
            raise ValueError(f"a packed batch's attention_mask must be (1, T) = {want} of ones (it is not used); got "
                             f"{tuple(mask.shape)}: drop it")
        if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
            raise ValueError("a packed batch has no padding, so its attention_mask must be all ones (it is not used): "
                             "drop it, or pack the unpadded rows (model(**kvt.integrations.transformers."
                             "packed_inputs(batch)) passes none)")
        if isinstance(tree, PrefixTreeLayout) and cu is None and sp is None:
            layout = tree
        elif tree is None and isinstance(cu, torch.Tensor) and isinstance(sp, torch.Tensor):
            if not (_has_data(cu) and _has_data(sp)):  # fake tensors of a trace (torch.compile, a backend's
                return (), {**named, "use_cache": False}  # export): nothing to read; the DualKV op checks them at run
            try:
                layout = DualKVLayout.from_tensors(cu, sp)
            except ValueError as e:
                raise ValueError(f"invalid packed layout: {e}") from None
        else:  # the attention function names what is wrong with the layout arguments
            return (), named
        check_packed(input_ids, position_ids, layout, getattr(model.config, "vocab_size", None))
        check_rope_lengths(position_limits(model), layout)
        _last_checked[:] = [(_ref(o), _version(o)) for o in objs]
    return (), {**named, "use_cache": False}
