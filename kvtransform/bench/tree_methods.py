"""Attention methods of the prefix-tree suites (``tree-attn``, ``tree-layer``), one adapter each, on a
:class:`~kvtransform.tree_layout.PrefixTreeLayout` (Tree Training, arXiv 2511.00413), with the interface of
:mod:`.methods` (``setup`` untimed, ``per_step``, ``__call__(q, k, v)``, ``attn_step``, ``layer_forward``):

* packed tree tokens (``T``): ``reference`` (dense mask), ``kvt_tree`` (ours), ``flex_tree`` (FlexAttention, tree
  block mask), ``dualkv`` (one-level trees only: DualKV, arXiv 2605.15422);
* flattened trajectories (``T_flat``, ``replicated = True``): ``flat`` (varlen_attn, else SDPA per trajectory);
* layer mode only: ``kvt_tree_compiled`` / ``flex_tree_compiled`` (the whole layer under torch.compile).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import masks
from .methods import FA2, AttnMethod, DualKV, Flex, Unavailable, _compiled_setup, _flex_layer
from .tree_config import TreeMethod
from .tree_shapes import flat_cu_seqlens, leaves

__all__ = ["TreeReference", "KvtTree", "FlexTree", "Flat", "DualKVOneLevel", "KvtTreeCompiled", "FlexTreeCompiled",
           "TREE_METHODS", "TREE_ORDER", "tree_methods_for"]


class TreeReference(AttnMethod):
    """Packed tree tokens, dense ``(T, T)`` bool mask, SDPA (math on CPU). Tiny shapes and checks only."""

    name = "reference"

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        self.mask = masks.tree_dense_mask(layout)
        self.impl = "sdpa+dense-mask"

    def __call__(self, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=self.mask, enable_gqa=True)
        return o[0].transpose(0, 1)


class KvtTree(AttnMethod):
    """Ours: ``kvt.prefix_tree_attention`` (the registered op, autograd) on the packed tree; the layout is built once
    (untimed). CUDA: the Triton kernels; CPU: the op's PyTorch reference."""

    name = "kvt_tree"

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        from kvtransform.ops.prefix_tree import prefix_tree_attention

        self.op = prefix_tree_attention
        self.impl = "kvt.prefix_tree_attention" + ("" if device.type == "cuda" else " (CPU reference)")

    def __call__(self, q, k, v):
        return self.op(q, k, v, self.layout)


class FlexTree(Flex):
    """FlexAttention on the packed tree with the tree block mask (:func:`.masks.tree_block_mask`, built once per
    shape; ``flex_mask`` picks how), compiled per shape (``flex_static``), GQA by ``enable_gqa``. The row's impl
    records the mask build time."""

    name = "flex_tree"
    mask_mod_of = staticmethod(masks.tree_mask_mod)
    block_mask_of = staticmethod(masks.tree_block_mask)

    def setup(self, layout, cfg, device):
        t0 = time.perf_counter()
        super().setup(layout, cfg, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.impl += f" (mask {time.perf_counter() - t0:.2f} s)"


class Flat(FA2):
    """The tree flattened into its trajectories (root→leaf), each its own causal sequence, the shared tokens copied
    (what training without tree packing runs): ``torch.nn.attention.varlen.varlen_attn`` (one launch) when this torch
    has it with GQA and a causal window on CUDA, else ``F.scaled_dot_product_attention(is_causal=True)`` per
    trajectory (flash backend on CUDA); ``flat_impl`` forces one."""

    name = "flat"

    def setup(self, layout, cfg, device):
        AttnMethod.setup(self, layout, cfg, device)
        self.init_sequences(flat_cu_seqlens(layout), str(cfg.flat_impl))
        n = len(leaves(layout))
        self.impl = f"varlen_attn ({n} seqs)" if self.kind == "varlen" else f"sdpa per trajectory ({n} seqs)"


def _one_level(layout, device):
    """The DualKVLayout of a tree whose every node is a root or a root's child, packed ``[P][R_1..R_n]`` per root;
    :class:`Unavailable` otherwise."""
    from kvtransform.layout import DualKVLayout

    groups, root = [], -1
    for n, p in enumerate(layout.parents):
        if p < 0:
            groups.append((layout.lengths[n], []))
            root = n
        elif p == root:  # a child of the latest root: DualKV packs a group's responses right after its prompt
            groups[-1][1].append(layout.lengths[n])
        else:
            raise Unavailable(f"dualkv takes one-level trees only (this one has depth {layout.depth})")
    return DualKVLayout.from_lengths(groups, device=device)


class DualKVOneLevel(DualKV):
    """``kvt.dualkv_attention`` on a one-level tree (its packing is DualKV's), the layout built once as
    ``kvt_tree``'s."""

    name = "dualkv"

    def setup(self, layout, cfg, device):
        AttnMethod.setup(self, _one_level(layout, device), cfg, device)
        from kvtransform.ops.dualkv import dualkv_attention

        self.op, self.per_step_layout = dualkv_attention, False
        self.impl = "kvt.dualkv_attention"


def _tree_layer(layer, x, cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges):
    """The layer with ``kvt::prefix_tree_attention`` (an opaque custom op for torch.compile) as its attention."""
    def attn(q, k, v):
        return torch.ops.kvt.prefix_tree_attention(q, k, v, cu_seqlens, parent, key_range_ptr, key_ranges,
                                                   query_range_ptr, query_ranges, q.shape[-1] ** -0.5)[0]

    return layer(x, attn, return_attn=True)


class KvtTreeCompiled(KvtTree):
    """The whole decoder layer under ``torch.compile`` (static shapes per T) with ``kvt::prefix_tree_attention``
    opaque inside; the layout tensors are graph inputs."""

    name = "kvt_tree_compiled"

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        _compiled_setup(self, "tree_layer", _tree_layer)

    def layer_forward(self, layer, x):
        return self.layer_fn(layer, x, *self.layout.kernel_tensors())


class FlexTreeCompiled(FlexTree):
    """The whole decoder layer under ``torch.compile`` around flex_attention with the tree block mask."""

    name = "flex_tree_compiled"
    takes_variants = False  # the compiled layer calls flex_attention without a score_mod

    def setup(self, layout, cfg, device):
        super().setup(layout, cfg, device)
        _compiled_setup(self, "flex_tree_layer", _flex_layer)

    def layer_forward(self, layer, x):
        return self.layer_fn(layer, x, self.block_mask)


TREE_METHODS = {m.name: m for m in (TreeReference, KvtTree, FlexTree, Flat, DualKVOneLevel, KvtTreeCompiled,
                                     FlexTreeCompiled)}
TREE_ORDER = ["reference", "kvt_tree", "flex_tree", "flat", "dualkv", "kvt_tree_compiled", "flex_tree_compiled"]
_GPU_ONLY = ("flex_tree", "flex_tree_compiled")
_COMPILED = ("kvt_tree_compiled", "flex_tree_compiled")


def tree_methods_for(cfg, device, shape) -> list:
    """Method names a job runs: the one asked for, or with ``all`` every one that applies: ``reference`` on CPU or
    at ``T <= 4096``; ``dualkv`` on one-level trees; the compiled whole-layer methods in the layer mode on CUDA.
    FlexAttention (no backward on CPU) is listed on CPU too and refused there in one line (status
    ``unavailable``)."""
    m = cfg.method.value if isinstance(cfg.method, TreeMethod) else str(cfg.method)
    if m != "all":
        return [m]
    mode = cfg.mode.value if hasattr(cfg.mode, "value") else str(cfg.mode)
    cpu = device.type == "cpu"
    return [n for n in TREE_ORDER if (n != "reference" or cpu or shape.T <= 4096)
            and (n != "dualkv" or shape.one_level)
            and (n not in _COMPILED or (mode == "layer" and not cpu))]
