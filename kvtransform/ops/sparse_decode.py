"""SpeContext sparse-retrieval decode ops (arXiv 2512.00722, §4.3): ``kvt::retrieval_topk`` and
``kvt::sparse_decode_attention``.

Once per decode step a small retrieval head picks, for every KV head, the ``B`` cached tokens the new token will
attend to (:func:`retrieval_topk`); every layer then attends only to those (:func:`sparse_decode_attention`), or to
a dense budget-sized slot buffer that already holds them (:func:`slot_decode_attention`, for layers whose full KV
lives on CPU). Decode is memory-bound: the attention reads ``2 * batch * H_kv * B * D * itemsize`` bytes instead of
the whole cache.

Contract (shared by the runtime that calls these):

* **Cache layout** ``(batch, H_kv, S_max, D)`` for K and V, last dim contiguous; ``cache_seqlens`` ``(batch,)``
  int32 (int64 is converted) = number of valid cached tokens of each row, positions ``[0, cache_seqlens[b])``.
* **Indices** are **int32** ``(batch, H_kv, B)``: token positions into the cache, shared by every layer of the
  step. :func:`retrieval_topk` returns them in descending score order, valid entries first, then ``-1`` padding
  when a row has fewer than ``B`` valid tokens (a row with ``cache_seqlens[b] <= B`` gets all of its tokens). It never
  repeats a position.
* **Masking / bad indices.** In the attention, an entry is used iff ``0 <= idx < cache_seqlens[b]`` (and ``< S_max``);
  ``-1`` is the padding value. With validation on (the default for CPU tensors outside tracing; opt-in on CUDA
  because it synchronises), any entry ``< -1`` or ``>= cache_seqlens[b]`` and any position listed twice for one
  (row, KV head) raise ``ValueError``. With validation off the kernel still never reads out of range (such entries
  are masked) but a duplicate is counted twice.
* **The new token.** ``k_new``/``v_new`` ``(batch, H_kv, D)`` are the new token's own key/value; when given they are
  always attended (in addition to the selected cache tokens) whether or not they are in the cache yet. If the
  runtime has already appended the new token to the cache and wants it attended, either pass it here and do not
  list its position in ``indices``, or list its position and pass ``k_new=v_new=None`` -- not both (it would count
  twice).
* **GQA**: query head ``h`` uses KV head ``h // (H // H_kv)``; indices are per KV head.
* ``B >= cache_seqlens[b]`` with indices ``0..cache_seqlens[b]-1`` equals full attention over the row's cache (tested).
* **Attention variants** (keyword-only, off by default; ``docs/ARCHITECTURE.md``): ``window`` (a sliding-window
  layer never attends outside its window; dense within it when the window fits in the budget), ``softcap``,
  ``sinks`` (see :func:`sparse_decode_attention`).

CPU tensors run the PyTorch references in ``kvtransform.kernels.{retrieval,sparse_decode}``; CUDA tensors run the
Triton kernels there. No autograd: decode is inference.

**The registered ops** (``torch.ops.kvt.retrieval_topk`` / ``torch.ops.kvt.sparse_decode_attention``, which a
transformed graph calls directly, past the wrappers) check every shape, dtype, device and scalar argument on the host
(``ValueError``, the wrappers' messages; no data is read) and never read out of bounds for any *value*: on every
device, ``cache_seqlens`` is clamped into ``[0, S_max]`` (negative = an empty row) and an index entry outside
``[0, min(cache_seqlens[b], S_max))`` is masked (never read), as described above. Only the wrappers validate values.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvtransform.kernels._common import last_dim_contiguous
from kvtransform.kernels.retrieval import retrieval_topk_reference, retrieval_topk_triton
from kvtransform.kernels.sparse_decode import sparse_decode_reference, sparse_decode_triton
from ._common import as_int, as_scale, check_attention_variants, is_tracing, kernel_path, renamed_kwargs

# Tests flip this to run the Triton kernels on CPU tensors under TRITON_INTERPRET=1.
USE_TRITON_ON_CPU = False

__all__ = ["retrieval_topk", "sparse_decode_attention", "slot_decode_attention", "check_indices"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("kvt::retrieval_topk", mutates_args=())
def _retrieval_topk_op(q: torch.Tensor, k: torch.Tensor, cache_seqlens: torch.Tensor, budget: int, num_sink: int,
                       num_recent: int, softmax_scale: float) -> torch.Tensor:
    cache_seqlens = _check_retrieval_inputs(q, k, cache_seqlens, budget, num_sink, num_recent)
    if kernel_path(q, USE_TRITON_ON_CPU):
        return retrieval_topk_triton(q, k, cache_seqlens, budget, num_sink, num_recent, softmax_scale)
    return retrieval_topk_reference(q, k, cache_seqlens, budget, num_sink, num_recent, softmax_scale)


@_retrieval_topk_op.register_fake
def _(q, k, cache_seqlens, budget, num_sink, num_recent, softmax_scale):
    return q.new_empty((q.shape[0], k.shape[1], budget), dtype=torch.int32)


@torch.library.custom_op("kvt::sparse_decode_attention", mutates_args=())
def _sparse_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      indices: Optional[torch.Tensor], cache_seqlens: torch.Tensor, k_new: Optional[torch.Tensor],
                      v_new: Optional[torch.Tensor], softmax_scale: float, window: Optional[int] = None,
                      softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    q, indices, cache_seqlens, k_new, v_new = _check_decode_inputs(q, k_cache, v_cache, indices, cache_seqlens,
                                                                   k_new, v_new)
    window, softcap, sinks = check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    variants = dict(window=window, softcap=softcap, sinks=sinks)
    if q.shape[0] == 0:  # no rows (as retrieval_topk takes them)
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    if kernel_path(q, USE_TRITON_ON_CPU):
        return sparse_decode_triton(q, k_cache, v_cache, indices, cache_seqlens, k_new, v_new, softmax_scale,
                                    **variants)
    return sparse_decode_reference(q, k_cache, v_cache, indices, cache_seqlens, k_new, v_new,
                                   softmax_scale, **variants).contiguous()


@_sparse_decode_op.register_fake
def _(q, k_cache, v_cache, indices, cache_seqlens, k_new, v_new, softmax_scale, window=None, softcap=None,
      sinks=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _no_backward(ctx, grad_out):
    raise RuntimeError("kvt.sparse_decode_attention / slot_decode_attention are decode-only (SpeContext inference) "
                       "and have no gradient: train through kvt.attention or kvt.dualkv_attention")


_sparse_decode_op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


# ----------------------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------------------
def _want_validate(validate: Optional[bool], *tensors) -> bool:
    if is_tracing(*tensors):
        return False
    if validate is None:
        return all(t is None or t.device.type == "cpu" for t in tensors)
    return bool(validate)


def _check_lengths(lengths: torch.Tensor, batch: int, device: torch.device, name: str = "cache_seqlens"
                   ) -> torch.Tensor:
    if not isinstance(lengths, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of shape (batch,) = ({batch},), int32; got {type(lengths)}")
    if lengths.dim() != 1 or lengths.shape[0] != batch:
        raise ValueError(f"{name} must have shape (batch,) = ({batch},); got {tuple(lengths.shape)}")
    if lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 (or int64); got {lengths.dtype}: pass cache_seqlens.to(torch.int32)")
    if lengths.device != device:
        raise ValueError(f"{name} is on {lengths.device} but the tensors are on {device}: move it with .to()")
    return lengths.to(torch.int32).contiguous()


def _check_length_values(lengths: torch.Tensor, limit: int, what: str) -> None:
    if lengths.numel() == 0:
        return
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 0:
        raise ValueError(f"cache_seqlens must be >= 0; got min {lo}")
    if hi > limit:
        raise ValueError(f"cache_seqlens must be <= {what} = {limit}; got max {hi}: grow the cache or clamp "
                         f"cache_seqlens")


def check_indices(indices: torch.Tensor, lengths: torch.Tensor) -> None:
    """Raise ``ValueError`` if any entry of ``indices`` ``(batch, H_kv, B)`` is ``< -1`` or ``>= lengths[b]``, or if
    a valid position appears twice for one (row, KV head). ``-1`` entries are padding. Synchronises on CUDA."""
    idx = indices.to(torch.int64)
    lens = lengths.to(device=idx.device, dtype=torch.int64)[:, None, None]
    bad = (idx < -1) | (idx >= lens)
    if bool(bad.any()):
        b, h, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"indices[{b}, {h}, {j}] = {int(idx[b, h, j])} is out of range for cache_seqlens[{b}] = "
                         f"{int(lens[b, 0, 0])}: entries must be in [0, cache_seqlens[b]) or -1 for padding")
    if idx.shape[-1] > 1:
        srt = idx.sort(dim=-1).values
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        if bool(dup.any()):
            b, h, j = (int(x) for x in dup.nonzero()[0])
            raise ValueError(f"indices[{b}, {h}] lists position {int(srt[b, h, j])} more than once: each selected "
                             f"token must appear once (use -1 for unused entries)")


def _check_retrieval_inputs(q, k, cache_seqlens, budget: int, sink: int, recent: int) -> torch.Tensor:
    """Shape, dtype, device and count checks of :func:`retrieval_topk` (no data read); returns ``cache_seqlens`` as
    contiguous int32."""
    if budget < 1:
        raise ValueError(f"budget must be an int >= 1; got {budget!r}")
    if sink < 0 or recent < 0:
        raise ValueError(f"num_sink and num_recent must be >= 0; got num_sink={sink}, num_recent={recent}")
    if sink + recent > budget:
        raise ValueError(f"num_sink + num_recent ({sink} + {recent}) exceeds the budget {budget}: lower them or "
                         f"raise the budget")
    if q.dim() != 3:
        raise ValueError(f"q must be (batch, H_r, D_r); got {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"k must be the retrieval key cache (batch, H_r_kv, S_max, D_r); got {tuple(k.shape)}")
    bsz, h_r, d = q.shape
    if k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    if k.shape[1] == 0 or h_r % k.shape[1] != 0:
        hint = (f"; if k {tuple(k.shape)} is laid out (batch, S, H_kv, D): the cache layout is (batch, H_kv, S_max, "
                f"D), pass k.transpose(1, 2)" if k.shape[1] > h_r and h_r % k.shape[2] == 0 else "")
        raise ValueError(f"retrieval query heads ({h_r}) must be a multiple of its KV heads ({k.shape[1]}){hint}")
    if q.dtype not in _FLOATS or k.dtype != q.dtype:
        raise ValueError(f"q and k must share one dtype of fp16/bf16/fp32; got {q.dtype} and {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k is on {k.device}, q on {q.device}")
    if k.stride(-1) != 1:
        raise ValueError(f"k must have a contiguous last dim; got strides {k.stride()}")
    return _check_lengths(cache_seqlens, bsz, q.device)


def _check_qkv(q, k, v, k_new, v_new, what: str):
    if q.dim() != 3:
        raise ValueError(f"q must be (batch, H, D) for one new token per row; got {tuple(q.shape)} "
                         f"(squeeze the sequence dim of a (batch, H, 1, D) query)")
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{what} must be (batch, H_kv, S, D); got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v {what} must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    bsz, h, d = q.shape
    if k.shape[0] != bsz or k.shape[3] != d:
        raise ValueError(f"{what} {tuple(k.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    h_kv = k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({h_kv})")
    if q.dtype not in _FLOATS:
        raise ValueError(f"q must be fp16, bf16 or fp32; got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}: cast one of them")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} {what} must have a contiguous last (head_dim) dim; got strides {t.stride()}: "
                             f"store the cache as (batch, H_kv, S, D) contiguous")
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new (the new token's own key/value) or neither")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if tuple(t.shape) != (bsz, h_kv, d):
                raise ValueError(f"{name} must be (batch, H_kv, D) = {(bsz, h_kv, d)}; got {tuple(t.shape)} "
                                 f"(squeeze the sequence dim of a (batch, H_kv, 1, D) tensor)")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}); got "
                                 f"{t.dtype}, {t.device}")
        k_new, v_new = last_dim_contiguous(k_new), last_dim_contiguous(v_new)
    return last_dim_contiguous(q), k_new, v_new


def _check_decode_inputs(q, k, v, indices, cache_seqlens, k_new, v_new):
    """Shape, dtype and device checks of :func:`sparse_decode_attention` (gather mode, ``indices`` given) or
    :func:`slot_decode_attention` (``indices`` None); no data read. Returns ``(q, indices, cache_seqlens, k_new,
    v_new)``: indices contiguous; q, k_new, v_new with a contiguous last dim (a strided view such as the new
    token's value sliced out of a fused projection is passed as it is: the kernels take its batch and head strides,
    so no copy kernel runs per layer); cache_seqlens contiguous int32."""
    q, k_new, v_new = _check_qkv(q, k, v, k_new, v_new, "slots" if indices is None else "cache")
    bsz, h_kv = q.shape[0], k.shape[1]
    if indices is not None:
        if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.shape[:2] != (bsz, h_kv):
            raise ValueError(f"indices must be (batch, H_kv, B) = ({bsz}, {h_kv}, B); got "
                             f"{tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices)}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"indices must be int32 (or int64); got {indices.dtype}")
        if indices.device != q.device:
            raise ValueError(f"indices are on {indices.device}, q on {q.device}")
        indices = indices.contiguous()
    return q, indices, _check_lengths(cache_seqlens, bsz, q.device), k_new, v_new


# ----------------------------------------------------------------------------------------------------------------
# public wrappers
# ----------------------------------------------------------------------------------------------------------------
@renamed_kwargs(lengths="cache_seqlens", sink="num_sink", recent="num_recent", scale="softmax_scale")
def retrieval_topk(q: torch.Tensor, k: torch.Tensor, cache_seqlens: torch.Tensor, budget: int, *, num_sink: int = 0,
                   num_recent: int = 0, softmax_scale: Optional[float] = None,
                   validate: Optional[bool] = None) -> torch.Tensor:
    """Select ``budget`` cached tokens per KV head with the SpeContext retrieval head (§4.3).

    Score of token ``j`` for KV head ``k``: ``max_{h in group k} softmax_j(q[b, h] · K[b, k, j] · softmax_scale)`` (softmax
    per query head over the row's valid tokens, element-wise max over the GQA group); the ``budget`` best are kept.

    Args:
        q: ``(batch, H_r, D_r)`` retrieval-head queries of the new token, fp16/bf16/fp32.
        k: ``(batch, H_r_kv, S_max, D_r)`` retrieval-head key cache, same dtype/device, last dim contiguous.
            ``H_r % H_r_kv == 0``; ``H_r_kv`` is the KV-head count of the returned indices (the model's ``H_kv``).
        cache_seqlens: ``(batch,)`` int32, valid tokens per row (include the new token's key if it may be selected).
        budget: ``B >= 1``, tokens kept per (row, KV head). ``budget``, ``num_sink`` and ``num_recent`` are ints or
            NumPy / torch integer scalars; a float or a bool is a ValueError.
        num_sink: always keep the first ``num_sink`` tokens (default 0, as the paper).
        num_recent: always keep the last ``num_recent`` tokens (default 0). ``num_sink + num_recent <= budget``.
        softmax_scale: default ``D_r ** -0.5``.
        validate: check ``cache_seqlens`` values (default: on for CPU tensors, off on CUDA to avoid a sync).

    Deprecated keyword names (one release): ``lengths``, ``sink``, ``recent``, ``scale``.

    Returns:
        int32 ``(batch, H_r_kv, budget)``: positions, descending score; ``-1`` padding after the valid ones when a
        row has fewer than ``budget`` tokens (then all its tokens are returned). No position repeats.

    Raises:
        ValueError: bad ranks/shapes/dtypes, a non-integer ``budget``/``num_sink``/``num_recent``, ``budget < 1``,
            ``num_sink``/``num_recent`` negative or ``num_sink + num_recent > budget``, head counts that do not
            divide, or (when validating) ``cache_seqlens`` outside ``[0, S_max]``.
    """
    budget, sink, recent = (as_int(x, name, " token count", keyword=name)
                            for x, name in ((budget, "budget"), (num_sink, "num_sink"), (num_recent, "num_recent")))
    lengths = _check_retrieval_inputs(q, k, cache_seqlens, budget, sink, recent)
    if _want_validate(validate, q, k, lengths):
        _check_length_values(lengths, k.shape[2], "S_max")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale)
    return torch.ops.kvt.retrieval_topk(q.contiguous(), k, lengths, int(budget), int(sink), int(recent), scale)


@renamed_kwargs(lengths="cache_seqlens", scale="softmax_scale")
def sparse_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            indices: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                            k_new: Optional[torch.Tensor] = None, v_new: Optional[torch.Tensor] = None, *,
                            softmax_scale: Optional[float] = None, validate: Optional[bool] = None,
                            window: Optional[int] = None, softcap: Optional[float] = None,
                            sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode step of attention over the selected cache tokens (gather mode), SpeContext §4.3.

    ``out[b, h] = softmax(q[b,h] · K[b,k,sel] · softmax_scale ∪ q·k_new) · (V[b,k,sel] ∪ v_new)``, ``k = h // (H/H_kv)``.
    With ``indices=None`` this is :func:`slot_decode_attention` (``k_cache``/``v_cache`` are slot buffers).

    Args:
        q: ``(batch, H, D)`` query of the new token, fp16/bf16/fp32.
        k_cache, v_cache: ``(batch, H_kv, S_max, D)``, same dtype/device, last dim contiguous; ``H % H_kv == 0``.
        indices: ``(batch, H_kv, B)`` int32 (int64 accepted) positions into the cache, ``-1`` = padding (see the
            module docstring for masking, duplicates and validation); ``B >= 1``.
        cache_seqlens: ``(batch,)`` int32, valid cached tokens per row (``<= S_max``), not counting ``k_new``.
        k_new, v_new: optional ``(batch, H_kv, D)``, the new token's own K/V, always attended.
        softmax_scale: default ``D ** -0.5``.
        validate: check ``cache_seqlens`` and index values (out of range, duplicates); default on for CPU tensors
            outside tracing, off on CUDA (it would synchronise).
        window: int >= 1 or None, a sliding-window layer (HF ``sliding_window``): the new token, at position
            ``cache_seqlens[b]``, sees cache positions ``j > cache_seqlens[b] - window`` only, never an older one at
            any budget. When the window's ``window - 1`` cache tokens fit in ``B``, they are all attended (dense
            within the window; ``indices`` is not read); otherwise the selected ones inside the window.
        softcap: finite float > 0 or None, Gemma 2's logit soft-capping ``c · tanh(s / c)`` of the scaled scores.
        sinks: ``(H,)`` float tensor or None, gpt-oss's learned per-head sink logits (an extra softmax-denominator
            term, a virtual key of value 0).

    Deprecated keyword names (one release): ``lengths``, ``scale``.

    Returns:
        ``(batch, H, D)`` in ``q.dtype``; a row with no valid index gives ``v_new`` (zeros without
        ``k_new``/``v_new``); cache entries that are not attended never contribute, whatever they hold (NaN, inf).

    Raises:
        ValueError: shape/dtype/device mismatch, ``B < 1``, head counts that do not divide, non-integer indices,
            a window < 1, a soft-cap that is not finite and > 0, sinks not ``(H,)``, and (when validating) lengths
            outside ``[0, S_max]``, indices out of range or duplicated.
    """
    if indices is None:
        return slot_decode_attention(q, k_cache, v_cache, cache_seqlens, k_new, v_new, softmax_scale=softmax_scale,
                                     validate=validate, window=window, softcap=softcap, sinks=sinks)
    q, indices, lengths, k_new, v_new = _check_decode_inputs(q, k_cache, v_cache, indices, cache_seqlens, k_new,
                                                             v_new)
    if indices.shape[2] < 1:
        raise ValueError("indices must select B >= 1 tokens per KV head (use -1 entries for padding)")
    if k_cache.shape[2] < 1:
        raise ValueError("the cache has no positions (S_max = 0): allocate at least one (a row without tokens yet "
                         "has cache_seqlens 0)")
    window, softcap, sinks = check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    if _want_validate(validate, q, k_cache, indices, lengths):
        _check_length_values(lengths, k_cache.shape[2], "S_max")
        check_indices(indices, lengths)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale)
    return torch.ops.kvt.sparse_decode_attention(q, k_cache, v_cache, indices, lengths, k_new, v_new, scale,
                                                 window=window, softcap=softcap, sinks=sinks)


@renamed_kwargs(lengths="cache_seqlens", scale="softmax_scale")
def slot_decode_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                          cache_seqlens: torch.Tensor, k_new: Optional[torch.Tensor] = None,
                          v_new: Optional[torch.Tensor] = None, *, softmax_scale: Optional[float] = None,
                          validate: Optional[bool] = None, window: Optional[int] = None,
                          softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention over a dense budget-sized slot buffer (no gather), SpeContext §4.3 for layers whose full
    KV lives on CPU and whose selected tokens were copied into GPU slots.

    Args:
        q: ``(batch, H, D)``.
        k_slots, v_slots: ``(batch, H_kv, B, D)``, last dim contiguous; slots ``[0, lengths[b])`` are valid.
        cache_seqlens: ``(batch,)`` int32, valid slots per row, ``<= B`` (``min(len_b, B)`` for a row of ``len_b``
            tokens when the slots were filled from :func:`retrieval_topk`'s indices, whose valid entries come first).
        k_new, v_new, softmax_scale, validate, softcap, sinks: as :func:`sparse_decode_attention`.
        window: as :func:`sparse_decode_attention`, slot ``j`` taken as cache position ``j`` (the slot-mode program
            over a whole cache); not for buffers filled from a selection, whose slots are not positions.

    Returns:
        ``(batch, H, D)`` in ``q.dtype``.
    """
    q, _, lengths, k_new, v_new = _check_decode_inputs(q, k_slots, v_slots, None, cache_seqlens, k_new, v_new)
    if k_slots.shape[2] < 1:
        raise ValueError("the slot buffer must have B >= 1 slots")
    window, softcap, sinks = check_attention_variants(window, softcap, sinks, q.shape[1], q.device)
    if _want_validate(validate, q, k_slots, lengths):
        _check_length_values(lengths, k_slots.shape[2], "the slot count B")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else as_scale(softmax_scale)
    return torch.ops.kvt.sparse_decode_attention(q, k_slots, v_slots, None, lengths, k_new, v_new, scale,
                                                 window=window, softcap=softcap, sinks=sinks)
