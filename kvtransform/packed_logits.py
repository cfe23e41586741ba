"""The logits of one packed batch (DualKV's :class:`~kvtransform.packing.PackedBatch`, a prefix tree's
:class:`~kvtransform.tree_packing.TreeBatch`), checked against the batch before log-probs are gathered from them."""
from __future__ import annotations

import torch

__all__ = ["packed_logits"]


def packed_logits(logits, num_tokens: int, input_ids: torch.Tensor) -> torch.Tensor:
    """``logits`` as ``(T, vocab)``, after checking that they can belong to a packed batch of ``num_tokens`` tokens
    holding ``input_ids``.

    Args:
        logits: ``(1, T, vocab)`` or ``(T, vocab)`` floating-point tensor, the model's output for the batch.
        num_tokens: ``T``, the batch's packed length.
        input_ids: the batch's ids (any shape, int), for the vocabulary check.

    Returns:
        a ``(T, vocab)`` view of ``logits``.

    Raises:
        ValueError: not a floating-point tensor, a wrong rank or leading size, a length other than ``T``, or a
            vocabulary smaller than the largest token id of the batch.
    """
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a tensor (1, T, vocab); got {type(logits).__name__}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a floating-point tensor (the model's output, e.g. float32/bfloat16); "
                         f"got dtype {logits.dtype}: pass the logits, not token ids or argmax indices")
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"logits must be (1, T, vocab) for a packed batch; got {tuple(logits.shape)}")
        logits = logits[0]
    elif logits.dim() != 2:
        raise ValueError(f"logits must be (1, T, vocab) or (T, vocab); got shape {tuple(logits.shape)}")
    if logits.shape[0] != num_tokens:
        raise ValueError(f"logits have {logits.shape[0]} positions but the packed batch has T = {num_tokens} "
                         f"tokens: these logits do not belong to this batch")
    vmax = int(input_ids.max())
    if logits.shape[1] <= vmax:
        raise ValueError(f"logits have a vocabulary of {logits.shape[1]} but the batch holds token id {vmax}")
    return logits
