"""ONNX emission of a transformed module: every ``kvt`` op translated into standard ONNX (no custom domain).

``OptimizedModule.export_onnx(path)`` calls :func:`export_onnx`: the module's ``core`` is exported with
``torch.export`` (the same program as the ``.pt2`` artifact, dynamic batch/sequence or packed tokens), then
converted with ``torch.onnx.export(..., dynamo=True)`` and a ``custom_translation_table`` holding one onnxscript
translation per ``kvt`` op:

* ``kvt.attention(q, k, v, attn_mask, key_padding, softmax_scale, causal)`` → opset 23 ``Attention`` (4-D inputs,
  GQA by head count, ``scale`` attribute) with one boolean (or additive float) mask built in the graph: the
  bottom-right aligned causal mask, ``key_padding`` and ``attn_mask`` combined. Query rows that see no key (left
  padding) give zeros, as the op does. The variants (``docs/ARCHITECTURE.md``) are all expressed in opset 23: a
  ``window`` is one more term of the keep-mask (``j > i - window``); ``softcap`` and ``sinks``, which opset 23's
  ``Attention`` cannot express exactly (its ``softcap`` attribute's order against the mask differs between
  onnxruntime versions; it has no sink input), run as explicit ``MatMul`` → ``Tanh`` → mask → ``Concat`` of the sink
  column → ``Softmax``-equivalent → drop the column → ``MatMul`` in fp32.
* ``kvt.dualkv_attention(q, k, v, cu_seqlens, segment_prefix, softmax_scale) -> (out, lse)`` → the DualKV mask
  (DualKV, arXiv 2605.15422, §2–3; ``docs/ARCHITECTURE.md``) computed in the graph from ``cu_seqlens`` /
  ``segment_prefix``: segment id of each token = number of segment ends ``<= t``; a query sees key ``j <= i`` whose
  segment is its own or its group's prefix; then ``Attention`` over ``(1, H, T, D)``. ``lse`` ``(H, T)`` fp32 comes
  from ``MatMul`` + ``ReduceLogSumExp`` and is removed as dead code when the graph does not use it. A ``window``
  keeps keys within it in each token's own sequence positions (a response token sits at ``P + r``); ``softcap`` /
  ``sinks`` write the attention out in fp32 (sinks in the lse too).
* ``kvt.prefix_tree_attention(q, k, v, *PrefixTreeLayout.kernel_tensors(), softmax_scale) -> (out, lse)`` → the
  prefix-tree mask (Tree Training, arXiv 2511.00413; ``docs/PREFIX_TREES.md``) computed in the graph, loop-free,
  from ``cu_seqlens`` and the ancestor token ranges ``key_range_ptr`` / ``key_ranges``: a token sees every token
  of every ancestor node and, causally, its own node; then the same ``Attention`` and ``lse`` as DualKV's.

One op from transformers is translated too: ``transformers.grouped_mm_fallback(input (S, I), weight (E, I, O),
offs (E,))``, the mixture-of-experts matmul of Qwen3-MoE / gpt-oss captured on CPU (rows sorted by expert, ``offs``
the cumulative row counts): each row's expert is the number of ``offs`` entries ``<= row``, its weight gathered and
multiplied (``Gather`` + ``MatMul``; memory ``S·I·O``, fine for the models ONNX emission is checked on).

Ops with no ONNX translation (``kvt.retrieval_topk``, ``kvt.sparse_decode_attention``: the sparse decode step of
the SpeContext runtime) are refused by name before anything is written. The file is written atomically.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

__all__ = ["OPSET", "check_onnx_target", "export_onnx", "onnx_translations", "refuse_ops", "run_onnx",
           "UnsupportedOpError"]

OPSET = 23  # the first opset with the standard Attention operator

_NEG_INF = float("-inf")


class UnsupportedOpError(ValueError):
    """The program holds a ``kvt`` op that has no translation into standard ONNX (nothing was written)."""


def _ops():
    from onnxscript import opset23 as op

    return op


def _bool():
    from onnxscript import ir

    return ir.DataType.BOOL


def _int64():
    from onnxscript import ir

    return ir.DataType.INT64


def _float():
    from onnxscript import ir

    return ir.DataType.FLOAT


def _i64(*values):
    return _ops().Constant(value_ints=list(values))


def _arange(n):
    """int64 ``[0, n)`` for a 1-element int64 shape tensor ``n``."""
    op = _ops()
    return op.Range(op.Constant(value_int=0), op.Squeeze(n, _i64(0)), op.Constant(value_int=1))


def _safe_attention(q, k, v, keep, scale: float):
    """``Attention`` with keep-mask ``keep`` (bool, broadcastable to (B, H, S_q, S_k)) where rows with no visible key
    give zeros: such rows are opened (any value) for the softmax and zeroed after."""
    op = _ops()
    row_any = op.Greater(op.ReduceMax(op.Cast(keep, to=_float()), _i64(-1), keepdims=1), op.Constant(value_float=0.0))
    mask = op.Or(keep, op.Not(row_any))
    out = op.Attention(q, k, v, mask, scale=float(scale))[0]
    return op.Where(row_any, out, op.CastLike(op.Constant(value_float=0.0), out))


def _repeat_kv(x, h):
    """``(B, H_kv, S, D)`` → ``(B, H, S, D)``: KV head ``h // (H // H_kv)`` for query head ``h`` (``h``: the
    1-element int64 query head count)."""
    op = _ops()
    h_kv = op.Shape(x, start=1, end=2)
    b, rest = op.Shape(x, start=0, end=1), op.Shape(x, start=2, end=4)
    x5 = op.Expand(op.Unsqueeze(x, _i64(2)), op.Concat(b, h_kv, op.Div(h, h_kv), rest, axis=0))
    return op.Reshape(x5, op.Concat(b, h, rest, axis=0))


def _explicit_attention(q, k, v, keep, add, scale: float, softcap: Optional[float], sinks):
    """Attention written out in fp32 for what ``Attention`` cannot express: soft-capped scores (before the mask),
    learned sinks (an extra ``(H,)`` logit column, dropped after normalisation). ``keep``: bool keep-mask or None;
    ``add``: additive float mask or None (broadcastable to ``(B, H, S_q, S_k)``). Rows with nothing to attend give
    zeros."""
    op = _ops()
    h = op.Shape(q, start=1, end=2)
    kk, vv = _repeat_kv(k, h), _repeat_kv(v, h)
    s = op.Mul(op.Cast(op.MatMul(q, op.Transpose(kk, perm=[0, 1, 3, 2])), to=_float()),
               op.Constant(value_float=float(scale)))
    if softcap is not None:
        c = op.Constant(value_float=float(softcap))
        s = op.Mul(op.Tanh(op.Div(s, c)), c)
    if add is not None:
        s = op.Add(s, op.Cast(add, to=_float()))
    if keep is not None:
        s = op.Where(keep, s, op.Constant(value_float=_NEG_INF))
    if sinks is not None:
        col_shape = op.Concat(op.Shape(s, start=0, end=3), _i64(1), axis=0)
        col = op.Expand(op.Reshape(op.Cast(sinks, to=_float()), _i64(1, -1, 1, 1)), col_shape)
        s = op.Concat(s, col, axis=-1)
    m = op.ReduceMax(s, _i64(-1), keepdims=1)
    m = op.Where(op.IsInf(m), op.CastLike(op.Constant(value_float=0.0), m), m)
    p = op.Exp(op.Sub(s, m))
    denom = op.ReduceSum(p, _i64(-1), keepdims=1)
    p = op.Div(p, op.Where(op.Greater(denom, op.Constant(value_float=0.0)), denom, op.Constant(value_float=1.0)))
    if sinks is not None:
        p = op.Slice(p, _i64(0), _i64(-1), _i64(-1))
    return op.CastLike(op.MatMul(p, op.Cast(vv, to=_float())), q)


def kvt_attention_onnx(q, k, v, attn_mask=None, key_padding=None, softmax_scale: float = 1.0, causal: bool = False,
                       window: Optional[int] = None, softcap: Optional[float] = None, sinks=None):
    """ONNX translation of ``kvt.attention``: q ``(B, H, S_q, D)``, k/v ``(B, H_kv, S_k, D)`` → ``(B, H, S_q, D)``;
    ``window`` a keep-mask term, ``softcap`` / ``sinks`` the explicit path (:func:`_explicit_attention`)."""
    op = _ops()
    keep = None
    if causal or window is not None:
        sq = op.Shape(q, start=2, end=3)
        sk = op.Shape(k, start=2, end=3)
        i = op.Add(op.Unsqueeze(_arange(sq), _i64(1)), op.Sub(sk, sq))
        j = op.Unsqueeze(_arange(sk), _i64(0))
        keep = op.LessOrEqual(j, i)  # (S_q, S_k)
        if window is not None:  # i - window < j
            keep = op.And(keep, op.Greater(j, op.Sub(i, op.Constant(value_ints=[int(window)]))))
    if key_padding is not None:
        kp = op.Unsqueeze(op.Cast(key_padding, to=_bool()), _i64(1, 2))  # (B, 1, 1, S_k)
        keep = kp if keep is None else op.And(keep, kp)
    if attn_mask is not None and attn_mask.dtype == _bool():
        keep = attn_mask if keep is None else op.And(keep, attn_mask)
        attn_mask = None
    if softcap is not None or sinks is not None:
        return _explicit_attention(q, k, v, keep, attn_mask, softmax_scale, softcap, sinks)
    if attn_mask is not None:  # additive float mask
        add = attn_mask if keep is None else op.Where(keep, attn_mask, op.CastLike(op.Constant(value_float=_NEG_INF),
                                                                                   attn_mask))
        row_ok = op.Greater(op.ReduceMax(op.Cast(add, to=_float()), _i64(-1), keepdims=1),
                            op.Constant(value_float=_NEG_INF))
        add = op.Where(row_ok, add, op.CastLike(op.Constant(value_float=0.0), add))
        out = op.Attention(q, k, v, op.CastLike(add, q), scale=float(softmax_scale))[0]
        return op.Where(row_ok, out, op.CastLike(op.Constant(value_float=0.0), out))
    if keep is None:
        return op.Attention(q, k, v, scale=float(softmax_scale))[0]
    return _safe_attention(q, k, v, keep, softmax_scale)


def _segment_of(cu_seqlens, t):
    """``(T,)`` int64 segment (node) of each token ``t``: the number of segment ends ``<= t``."""
    op = _ops()
    ends = op.Slice(op.Cast(cu_seqlens, to=_int64()), _i64(1), _i64(2 ** 62))  # (S,)
    return op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(ends, _i64(0)), op.Unsqueeze(t, _i64(1))), to=_int64()),
                        _i64(1), keepdims=0)


def _windowed(keep, pos, window: Optional[int]):
    """``keep`` and, with a window, ``pos_j > pos_i - window`` (positions in each token's own sequence)."""
    if window is None:
        return keep
    op = _ops()
    lo = op.Sub(op.Unsqueeze(pos, _i64(1)), op.Constant(value_ints=[int(window)]))
    return op.And(keep, op.Greater(op.Unsqueeze(pos, _i64(0)), lo))


def dualkv_keep_mask(cu_seqlens, segment_prefix, t_len, window: Optional[int] = None):
    """Bool ``(T, T)`` DualKV keep-mask from int32 ``cu_seqlens (S+1,)``, ``segment_prefix (S,)`` and the int64
    1-element token count ``t_len``; with ``window``, only keys whose sequence position (a response token sits at
    ``P + r``) is within the window of the query's."""
    op = _ops()
    t = _arange(t_len)  # (T,)
    seg = _segment_of(cu_seqlens, t)
    sp = op.Gather(op.Cast(segment_prefix, to=_int64()), seg)  # (T,) -1 on a prefix
    grp = op.Where(op.Less(sp, op.Constant(value_int=0)), seg, sp)  # (T,) the group's prefix segment
    seg_j = op.Unsqueeze(seg, _i64(0))
    causal = op.LessOrEqual(op.Unsqueeze(t, _i64(0)), op.Unsqueeze(t, _i64(1)))
    same = op.Or(op.Equal(seg_j, op.Unsqueeze(seg, _i64(1))), op.Equal(seg_j, op.Unsqueeze(grp, _i64(1))))
    if window is None:
        return op.And(causal, same)
    cu = op.Cast(cu_seqlens, to=_int64())
    starts = op.Slice(cu, _i64(0), _i64(-1))  # (S,)
    lens = op.Sub(op.Slice(cu, _i64(1), _i64(2 ** 62)), starts)
    prefix_len = op.Where(op.Less(sp, op.Constant(value_int=0)), op.Constant(value_int=0), op.Gather(lens, grp))
    pos = op.Add(op.Sub(t, op.Gather(starts, seg)), prefix_len)  # (T,) position in the token's own sequence
    return _windowed(op.And(causal, same), pos, window)


def prefix_tree_keep_mask(cu_seqlens, key_range_ptr, key_ranges, t_len, window: Optional[int] = None):
    """Bool ``(T, T)`` prefix-tree keep-mask from int32 ``cu_seqlens (N+1,)``, ``key_range_ptr (N+1,)``,
    ``key_ranges (RK, 2)`` (:class:`kvtransform.tree_layout.PrefixTreeLayout`) and the int64 1-element token count
    ``t_len``: query ``i`` of node ``n`` sees key ``j`` iff ``j`` lies in one of ``n``'s ancestor token ranges, or
    ``j`` is in node ``n`` and ``j <= i``. Loop-free: range ``r``'s owner node = number of ``key_range_ptr[1:]``
    entries ``<= r``; node × key visibility ``(N, T)`` = one-hot(owner) ``(N, RK)`` @ range hits ``(RK, T)`` > 0.
    With ``window``: a token's position in its trajectory = its node's ancestor token count (one-hot(owner) @ range
    lengths) + its offset in the node."""
    op = _ops()
    t = _arange(t_len)  # (T,)
    node = _segment_of(cu_seqlens, t)  # (T,) node of each token
    kr = op.Cast(key_ranges, to=_int64())  # (RK, 2)
    lo = op.Slice(kr, _i64(0), _i64(1), _i64(1))  # (RK, 1)
    hi = op.Slice(kr, _i64(1), _i64(2), _i64(1))
    tj = op.Unsqueeze(t, _i64(0))  # (1, T)
    hit = op.Cast(op.And(op.LessOrEqual(lo, tj), op.Less(tj, hi)), to=_float())  # (RK, T)
    r = _arange(op.Shape(key_ranges, start=0, end=1))  # (RK,)
    rends = op.Slice(op.Cast(key_range_ptr, to=_int64()), _i64(1), _i64(2 ** 62))  # (N,)
    owner = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(rends, _i64(0)), op.Unsqueeze(r, _i64(1))),
                                 to=_int64()), _i64(1), keepdims=0)  # (RK,)
    n_ids = _arange(op.Shape(rends, start=0, end=1))  # (N,)
    onehot = op.Cast(op.Equal(op.Unsqueeze(n_ids, _i64(1)), op.Unsqueeze(owner, _i64(0))), to=_float())  # (N, RK)
    anc = op.Greater(op.MatMul(onehot, hit), op.Constant(value_float=0.5))  # (N, T) key j in an ancestor of n
    anc_tok = op.Gather(anc, node, axis=0)  # (T, T)
    causal = op.LessOrEqual(tj, op.Unsqueeze(t, _i64(1)))
    same = op.Equal(op.Unsqueeze(node, _i64(0)), op.Unsqueeze(node, _i64(1)))
    keep = op.Or(anc_tok, op.And(causal, same))
    if window is None:
        return keep
    depth = op.Cast(op.Squeeze(op.MatMul(onehot, op.Cast(op.Sub(hi, lo), to=_float())), _i64(1)), to=_int64())
    starts = op.Slice(op.Cast(cu_seqlens, to=_int64()), _i64(0), _i64(-1))  # (N,)
    pos = op.Add(op.Sub(t, op.Gather(starts, node)), op.Gather(depth, node))  # (T,)
    return _windowed(keep, pos, window)


def _packed_attention(q, k, v, keep, softmax_scale: float, softcap: Optional[float] = None, sinks=None):
    """Attention of packed q ``(T, H, D)``, k/v ``(T, H_kv, D)`` under keep-mask ``(T, T)`` (every row keeps
    its own token) → ``(out (T, H, D), lse (H, T) fp32)``; soft-cap and sinks (in the lse too) written out in fp32."""
    op = _ops()
    perm = [1, 0, 2]
    qh, kh, vh = (op.Transpose(x, perm=perm) for x in (q, k, v))  # (H, T, D), (H_kv, T, D)
    # scores of query head h against KV head h // G, as (H_kv, G, T, D) @ (H_kv, 1, D, T)
    h = op.Shape(q, start=1, end=2)
    h_kv = op.Shape(k, start=1, end=2)
    q4 = op.Reshape(qh, op.Concat(h_kv, op.Div(h, h_kv), op.Shape(qh, start=1, end=3), axis=0))
    k4 = op.Unsqueeze(op.Transpose(kh, perm=[0, 2, 1]), _i64(1))
    scores = op.Mul(op.Cast(op.MatMul(q4, op.CastLike(k4, q4)), to=_float()), op.Constant(value_float=softmax_scale))
    scores = op.Reshape(scores, op.Concat(h, op.Shape(scores, start=2, end=4), axis=0))  # (H, T, T)
    if softcap is not None:
        c = op.Constant(value_float=float(softcap))
        scores = op.Mul(op.Tanh(op.Div(scores, c)), c)
    scores = op.Where(op.Unsqueeze(keep, _i64(0)), scores, op.Constant(value_float=_NEG_INF))
    if softcap is None and sinks is None:
        out = op.Attention(op.Unsqueeze(qh, _i64(0)), op.Unsqueeze(kh, _i64(0)), op.Unsqueeze(vh, _i64(0)),
                           op.Unsqueeze(keep, _i64(0, 1)), scale=float(softmax_scale))[0]
        return op.Transpose(op.Squeeze(out, _i64(0)), perm=perm), op.ReduceLogSumExp(scores, _i64(-1), keepdims=0)
    full = scores
    if sinks is not None:  # one more logit per row: the head's sink
        col = op.Expand(op.Reshape(op.Cast(sinks, to=_float()), _i64(-1, 1, 1)),
                        op.Concat(op.Shape(scores, start=0, end=2), _i64(1), axis=0))
        full = op.Concat(scores, col, axis=-1)
    lse = op.ReduceLogSumExp(full, _i64(-1), keepdims=0)  # (H, T)
    p = op.Exp(op.Sub(scores, op.Unsqueeze(lse, _i64(-1))))  # (H, T, T)
    p4 = op.Reshape(p, op.Concat(h_kv, op.Div(h, h_kv), op.Shape(p, start=1, end=3), axis=0))
    out = op.MatMul(p4, op.Unsqueeze(op.Cast(vh, to=_float()), _i64(1)))  # (H_kv, G, T, D)
    out = op.Reshape(out, op.Concat(h, op.Shape(out, start=2, end=4), axis=0))
    return op.CastLike(op.Transpose(out, perm=perm), q), lse


def kvt_dualkv_attention_onnx(q, k, v, cu_seqlens, segment_prefix, softmax_scale: float = 1.0,
                              window: Optional[int] = None, softcap: Optional[float] = None, sinks=None):
    """ONNX translation of ``kvt.dualkv_attention``: q ``(T, H, D)``, k/v ``(T, H_kv, D)`` → ``(out (T, H, D),
    lse (H, T) fp32)``; window / soft-cap / sinks as ``kvt.attention``'s."""
    keep = dualkv_keep_mask(cu_seqlens, segment_prefix, _ops().Shape(q, start=0, end=1), window)  # (T, T)
    return _packed_attention(q, k, v, keep, softmax_scale, softcap, sinks)


def kvt_prefix_tree_attention_onnx(q, k, v, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr,
                                   query_ranges, softmax_scale: float = 1.0, window: Optional[int] = None,
                                   softcap: Optional[float] = None, sinks=None):
    """ONNX translation of ``kvt.prefix_tree_attention``: q ``(T, H, D)``, k/v ``(T, H_kv, D)`` and the layout's
    six int32 tensors → ``(out (T, H, D), lse (H, T) fp32)``; the mask from ``cu_seqlens`` and the ancestor key
    ranges (:func:`prefix_tree_keep_mask`). ``parent`` and the query ranges (dK/dV only) are not read."""
    keep = prefix_tree_keep_mask(cu_seqlens, key_range_ptr, key_ranges, _ops().Shape(q, start=0, end=1), window)
    return _packed_attention(q, k, v, keep, softmax_scale, softcap, sinks)


def grouped_mm_onnx(x, weight, offs):
    """ONNX translation of ``transformers.grouped_mm_fallback``: x ``(S, I)`` rows sorted by expert, weight
    ``(E, I, O)``, offs ``(E,)`` int cumulative row counts → ``(S, O)``."""
    op = _ops()
    rows = _arange(op.Shape(x, start=0, end=1))  # (S,)
    ends = op.Unsqueeze(op.Cast(offs, to=_int64()), _i64(0))  # (1, E)
    expert = op.ReduceSum(op.Cast(op.LessOrEqual(ends, op.Unsqueeze(rows, _i64(1))), to=_int64()), _i64(1),
                          keepdims=0)  # (S,)
    w = op.Gather(weight, expert, axis=0)  # (S, I, O)
    return op.Squeeze(op.MatMul(op.Unsqueeze(x, _i64(1)), w), _i64(1))


def onnx_translations() -> dict:
    """``{torch op overload: onnxscript translation}`` for ``torch.onnx.export(custom_translation_table=...)``."""
    table = {torch.ops.kvt.attention.default: kvt_attention_onnx,
             torch.ops.kvt.dualkv_attention.default: kvt_dualkv_attention_onnx,
             torch.ops.kvt.prefix_tree_attention.default: kvt_prefix_tree_attention_onnx}
    try:  # registered when transformers' MoE integration is imported
        table[torch.ops.transformers.grouped_mm_fallback.default] = grouped_mm_onnx
    except (AttributeError, RuntimeError):
        pass
    return table


_WHY_NOT = {
    "retrieval_topk": "the top-k selection of the SpeContext decode step (arXiv 2512.00722) runs in the runtime",
    "sparse_decode_attention": "the sparse decode step (Gather + Attention over the selected positions) follows with "
                               "the SpeContext runtime",
    "dualkv_attention_backward": "ONNX emission is inference only (no backward)",
    "prefix_tree_attention_backward": "ONNX emission is inference only (no backward)",
}


def refuse_ops(names: Sequence[str]) -> None:
    """UnsupportedOpError naming why each ``kvt`` op of ``names`` (e.g. ``"sparse_decode_attention"``) has no ONNX
    translation, and what does."""
    why = "; ".join(f"kvt.{n}: {_WHY_NOT.get(n, 'no ONNX translation')}" for n in names)
    raise UnsupportedOpError(f"cannot emit ONNX: {why}. Exportable: kvt.attention, kvt.dualkv_attention, "
                             f"kvt.prefix_tree_attention")


def _check_translatable(ep: torch.export.ExportedProgram) -> None:
    table = onnx_translations()
    bad = sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"
                  and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "kvt"
                  and n.target not in table})
    if bad:
        refuse_ops([b.split(".")[-2] if b.count(".") >= 2 else b for b in bad])


def check_onnx_target(path: str | os.PathLike, overwrite: bool = False, names: Sequence[str] = ()) -> Path:
    """Check that the ONNX file ``path`` (and the files ``names`` beside it, e.g. its ``.data``) may be written;
    returns ``path`` as a :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``path`` is a directory or inside a file, or it (or one of ``names``) exists and
            ``overwrite`` is false.
        PermissionError: its directory cannot be written (or made).
        ValueError: ``overwrite`` is not a bool.
    """
    if not isinstance(overwrite, bool):  # (a string such as "false" is truthy: it would replace the file)
        raise ValueError(f"overwrite must be True or False; got {overwrite!r}")
    if str(path).endswith(("/", os.sep)):  # (Path drops the separator: a missing "dir/" became a file named dir)
        raise FileExistsError(f"{str(path)!r} names a directory: give the ONNX file's path, e.g. "
                              f"{str(Path(path) / 'model.onnx')!r}")
    path = Path(path).expanduser()
    if path.is_dir():
        raise FileExistsError(f"{str(path)!r} is a directory: give the ONNX file's path, e.g. "
                              f"{str(path / 'model.onnx')!r}")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise FileExistsError(f"{str(parent)!r} is a file: the ONNX file {str(path)!r} cannot be inside it")
    from .utils import check_writable

    check_writable(path, "the ONNX file", "path=...")  # its directory, probed before the export (seconds)
    for p in [path, *(path.parent / n for n in names)]:
        if p.exists() and not p.is_file():  # a device, FIFO or socket is never replaced
            raise FileExistsError(f"{str(p)!r} exists and is not a regular file (a device, FIFO or socket): choose "
                                  f"another path")
        if not overwrite and (p.exists() or p.is_symlink()):
            raise FileExistsError(f"{str(p)!r} exists; choose another path or pass overwrite=True to replace it")
    return path


def export_onnx(ep: torch.export.ExportedProgram, path: str | os.PathLike, input_names: Sequence[str],
                output_names: Sequence[str] = ("logits",), opset: int = OPSET,
                check: Optional[Callable[[Path], None]] = None, overwrite: bool = False) -> Path:
    """Convert ``ep`` to ONNX (``kvt`` ops translated, dynamic dims kept) and write it atomically to ``path``.

    Args:
        ep: an exported program whose ``kvt`` ops are ``kvt.attention`` / ``kvt.dualkv_attention``.
        path: the ``.onnx`` file; weights are stored inside it (models over 2 GB: in ``<name>.data`` beside it).
            An existing file is replaced only with ``overwrite``.
        input_names / output_names: ONNX graph input and output names.
        opset: ONNX opset (>= 23 for ``Attention``).
        check: called with the written temporary file before it is renamed into place (e.g. onnxruntime against
            the PyTorch module); an exception it raises leaves ``path`` untouched.
        overwrite: replace an existing ``path`` (default false: ``FileExistsError``, checked before the export).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false, or ``path`` is a directory; nothing written.
        UnsupportedOpError: a ``kvt`` op without a translation (named); nothing written.
        ValueError: ``opset < 23``.
        RuntimeError: the ONNX exporter failed (its message included); nothing written.
        Whatever ``check`` raises (nothing written).
    """
    if opset < OPSET:
        raise ValueError(f"opset {opset}: the kvt translations need the Attention operator of opset {OPSET} or later")
    path = check_onnx_target(path, overwrite)
    _check_translatable(ep)
    import logging

    # torch's exporter warns once per torchvision op it cannot register when torchvision is absent: noise here
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        # opset 23 + dynamic shapes: onnxscript's optimizer folds the dynamic Attention shapes wrongly; the program
        # is exported unoptimised and only dead nodes are removed (an unused lse, constant-shape scaffolding).
        with warnings.catch_warnings():  # torch's own decomposition deep-copies tree specs through a deprecated path
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                    category=FutureWarning)
            prog = torch.onnx.export(ep, (), dynamo=True, opset_version=opset, optimize=False,
                                     custom_translation_table=onnx_translations(), input_names=list(input_names),
                                     output_names=list(output_names), verbose=False, report=False)
    except Exception as e:
        raise RuntimeError(f"torch.onnx.export failed: {type(e).__name__}: {e}") from e
    finally:
        registration.setLevel(level)
    from onnxscript.ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(prog.model)
    _drop_unused_attention_outputs(prog.model)
    size = sum(p.numel() * p.element_size() for p in ep.state_dict.values())
    external = size > (1 << 31) - (1 << 26)
    path.parent.mkdir(parents=True, exist_ok=True)  # (after the export: a failed one leaves no directories behind)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        prog.save(tmp / path.name, external_data=external)
        if check is not None:
            check(tmp / path.name)
        files = sorted(tmp.iterdir(), key=lambda f: f.name == path.name)  # the .onnx last: it names the data file
        check_onnx_target(path, overwrite, [f.name for f in files])  # again: one may have appeared meanwhile
        for f in files:
            os.replace(f, path.parent / f.name)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return path


def _drop_unused_attention_outputs(model) -> None:
    """``Attention`` declares four outputs (Y, present_key, present_value, qk_matmul_output); keep only Y when the
    rest are unused, so the runtime does not materialise them."""
    graph_outputs = set(map(id, model.graph.outputs))
    for node in model.graph:
        if node.op_type == "Attention" and hasattr(node, "resize_outputs") and not any(
                v.uses() or id(v) in graph_outputs for v in node.outputs[1:]):
            node.resize_outputs(1)


def run_onnx(path: str | os.PathLike, inputs: dict, session=None):
    """Run the ONNX file in onnxruntime (CPU) on ``{input name: tensor}``; returns the first output as a tensor."""
    import onnxruntime as ort

    sess = session or ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {k: v.detach().cpu().numpy() for k, v in inputs.items()}
    return torch.from_numpy(sess.run(None, feeds)[0])


def max_rel_error(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """``(max |a - b|, max |a - b| / max |b|)`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).abs().max())
    return err, err / max(float(b.abs().max()), 1e-30)


def compare_onnx(path, module, inputs: dict, tolerance: Optional[float] = None, session=None) -> tuple[float, float]:
    """Run ``module(**inputs)`` and the ONNX file on the same inputs; ``(max abs, max rel)`` error of the first
    output. With ``tolerance``, raises :class:`kvtransform.verify.VerificationError` beyond it."""
    with torch.no_grad():
        ref = module(*inputs.values())
    got = run_onnx(path, inputs, session)
    err = max_rel_error(got, ref)
    if tolerance is not None and not err[1] <= tolerance:
        from kvtransform.verify import VerificationError

        raise VerificationError(f"the ONNX file {str(path)!r} differs from the PyTorch module in onnxruntime: max "
                                f"abs {err[0]:.3g}, rel {err[1]:.3g} > tolerance {tolerance:g}")
    return err
