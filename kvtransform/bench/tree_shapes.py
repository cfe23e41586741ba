"""Tree shapes of the prefix-tree suites (:mod:`.tree_config`): agentic trees (a shared prompt, then turns branching
at every level; Tree Training, arXiv 2511.00413) and DualKV's one-level trees (arXiv 2605.15422, Table 1), as a
:class:`~kvtransform.tree_layout.PrefixTreeLayout` packed depth-first, plus the flattened view (each trajectory
root→leaf its own causal sequence, shared tokens copied) that the ``flat`` method runs on.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from kvtransform.tree_layout import PrefixTreeLayout

from . import flops

__all__ = ["agentic_tree", "one_level_tree", "leaves", "trajectory_lengths", "flat_index", "flat_cu_seqlens",
           "packed_from_flat", "TreeShape"]


def agentic_tree(prompt: int, fanout: Sequence[int], turn: Union[tuple, list], seed: int, trees: int = 1,
                 device=None) -> PrefixTreeLayout:
    """DFS-packed layout of ``trees`` trees, each a ``prompt``-token root then ``len(fanout)`` levels of turns
    (``fanout[l]`` children per node at level ``l``); turn lengths from ``random.Random(seed)``: ``randint(*turn)``
    for a ``(lo, hi)`` tuple, ``choice(turn)`` for a list, drawn in packing order."""
    rng = random.Random(seed)
    lengths, parents = [], []

    def draw():
        return rng.randint(*turn) if isinstance(turn, tuple) else rng.choice(turn)

    def grow(parent, level):
        for _ in range(fanout[level]):
            lengths.append(draw())
            parents.append(parent)
            if level + 1 < len(fanout):
                grow(len(lengths) - 1, level + 1)

    for _ in range(trees):
        lengths.append(prompt)
        parents.append(-1)
        if fanout:
            grow(len(lengths) - 1, 0)
    return PrefixTreeLayout.from_parents(lengths, parents, device=device)


def one_level_tree(P: int, responses: Sequence[int], device=None) -> PrefixTreeLayout:
    """DualKV's ``[P][R_1]..[R_mb]`` as a one-level tree."""
    return PrefixTreeLayout.from_parents([P, *responses], [-1] + [0] * len(responses), device=device)


def leaves(layout) -> list:
    """Nodes without children (one trajectory each, root→leaf), in packing order."""
    return layout.leaves()


def trajectory_lengths(layout) -> list:
    """Tokens of each trajectory (root→leaf path), in :func:`leaves` order."""
    return layout.trajectory_lengths()


def flat_index(layout) -> torch.Tensor:
    """int64 ``(T_flat,)`` on the layout's device: the packed position of each token of the flattened batch (the
    trajectories one after another): ``flat = packed[flat_index(layout)]``."""
    return torch.cat([layout.path_index(n) for n in leaves(layout)]).to(layout.device)


def flat_cu_seqlens(layout) -> torch.Tensor:
    """int32 ``(num_trajectories + 1,)`` offsets of the trajectories on the flattened axis (layout's device)."""
    cu = [0]
    for ln in trajectory_lengths(layout):
        cu.append(cu[-1] + ln)
    return torch.tensor(cu, dtype=torch.int32, device=layout.device)


def packed_from_flat(layout) -> torch.Tensor:
    """int64 ``(T,)``: for each packed token, its first position on the flattened axis
    (``flat[packed_from_flat(layout)] == packed``)."""
    idx = flat_index(layout)
    pos = torch.arange(idx.numel(), device=idx.device)
    first = torch.full((layout.total_tokens,), idx.numel(), dtype=torch.long, device=idx.device)
    return first.scatter_reduce(0, idx, pos, reduce="amin")


def _kind(cfg) -> str:
    return cfg.shape.value if hasattr(cfg.shape, "value") else str(cfg.shape)


def _mode(cfg) -> str:
    return cfg.mode.value if hasattr(cfg.mode, "value") else str(cfg.mode)


@dataclass
class TreeShape:
    """One tree shape: the layout (CPU), token counts, the useful FLOPs and their floor, the CSV ``params``.

    The same interface as :class:`.runner.Shape` (what :func:`.runner.run_method` reads): ``T`` packed tokens,
    ``T_rep`` flattened tokens, ``key``, ``replicated_index`` / ``packed_from_replicated`` (the flat view),
    ``estimate_gb``."""

    layout: PrefixTreeLayout
    T: int
    T_rep: int
    pairs: int  # visible (q, k) pairs of the tree (the same count for every method)
    attn_fwd_flops: float
    layer_flops: float
    floor_ms: float
    params: str
    one_level: bool

    @property
    def key(self) -> tuple:
        return (tuple(self.layout.lengths), tuple(self.layout.parents))

    @property
    def trajectories(self) -> int:
        return len(leaves(self.layout))

    def replicated_index(self, layout) -> torch.Tensor:
        return flat_index(layout)

    def packed_from_replicated(self, layout) -> torch.Tensor:
        return packed_from_flat(layout)

    @staticmethod
    def of(cfg) -> "TreeShape":
        from .runner import response_lengths
        from .tree_config import parse_fanout

        if _kind(cfg) == "one_level":
            R = response_lengths(cfg.mb, cfg.r_min, cfg.r_max, cfg.r_seed)
            lay = one_level_tree(cfg.P, R)
            params = f"P={cfg.P} mb={cfg.mb}"
        else:
            fan = parse_fanout(cfg.fanout)
            lay = agentic_tree(cfg.prompt, fan, (cfg.turn_min, cfg.turn_max), cfg.seed, cfg.trees)
            params = (f"prompt={cfg.prompt} fanout={'x'.join(map(str, fan))} turns={cfg.turn_min}-{cfg.turn_max} "
                      f"seed={cfg.seed}" + (f" trees={cfg.trees}" if cfg.trees > 1 else ""))
        T, pairs = lay.total_tokens, lay.visible_pairs()
        attn = flops.attention_flops(pairs, cfg.heads, cfg.head_dim)
        layer = flops.layer_flops(T, pairs, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp)
        work = layer if _mode(cfg) == "layer" else attn * (1 + flops.BACKWARD_FACTOR)
        return TreeShape(lay, T, sum(trajectory_lengths(lay)), pairs, attn, layer,
                         work / (cfg.matmul_tflops * 1e12) * 1e3, params, lay.depth <= 2)

    def estimate_gb(self, cfg, method: str, replicated: bool, bytes_per_el: int) -> float:
        """Rough peak (GiB) used only to skip what cannot fit: q/k/v/out and their gradients on the method's token
        axis (attn mode) or the layer's weights and activations (layer mode); the dense reference's T^2 mask."""
        T = self.T_rep if replicated else self.T
        if _mode(cfg) == "layer":
            params = flops.layer_matmul_params(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp)
            gb = 2 * params * bytes_per_el + T * (10 * cfg.hidden + 4 * cfg.mlp) * bytes_per_el * 1.6
        else:
            gb = T * (cfg.heads * 4 + cfg.kv_heads * 4) * cfg.head_dim * bytes_per_el
        if method == "reference":
            gb += self.T * self.T * (1 + 4 * cfg.heads)
        return gb / 2**30
