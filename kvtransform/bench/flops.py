"""Benchmark maths of the DualKV suites: useful FLOPs and the FLOP floor (DualKV, arXiv 2605.15422, App. F.4).

Useful attention FLOPs count only the (query, key) pairs the shared-prefix mask lets through
(:meth:`kvtransform.layout.DualKVLayout.visible_pairs`): ``4 * head_dim * heads`` per pair in the forward (QK^T and
PV, 2 FLOPs per multiply-add), ``2.5x`` that in the backward (five matmuls against two). The same count is used for
every method, so TFLOP/s compare work done, not work wasted on masked or replicated tokens.
"""
from __future__ import annotations

from typing import Union

__all__ = ["attention_flops", "layer_matmul_params", "layer_flops", "BACKWARD_FACTOR"]

BACKWARD_FACTOR = 2.5  # backward matmuls / forward matmuls of attention (5 / 2)


def attention_flops(layout_or_pairs: Union[int, "object"], num_heads: int, head_dim: int,
                    backward: bool = False) -> float:
    """Useful FLOPs of one attention call: visible pairs x ``4 * head_dim * num_heads`` (x 2.5 for the backward).

    Args:
        layout_or_pairs: a :class:`~kvtransform.layout.DualKVLayout` or its number of visible (q, k) pairs.
        num_heads: query heads ``H``; head_dim: ``D``.
        backward: count the backward instead of the forward.
    """
    pairs = layout_or_pairs if isinstance(layout_or_pairs, int) else layout_or_pairs.visible_pairs()
    f = 4.0 * head_dim * num_heads * pairs
    return f * BACKWARD_FACTOR if backward else f


def layer_matmul_params(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> int:
    """Weights of a decoder layer's matmuls (q, k, v, o projections and the SwiGLU MLP)."""
    return hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * mlp


def layer_flops(tokens: int, pairs: int, hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> float:
    """Useful forward+backward FLOPs of one layer on ``tokens`` packed tokens: ``6 * matmul params * tokens``
    (2 forward + 4 backward per weight and token) plus the attention's forward and backward on ``pairs``."""
    attn = attention_flops(pairs, heads, head_dim)
    return 6.0 * layer_matmul_params(hidden, heads, kv_heads, head_dim, mlp) * tokens + (1 + BACKWARD_FACTOR) * attn
