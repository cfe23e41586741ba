"""Runner of the prefix-tree suites (``tree-attn``, ``tree-layer``; configs :mod:`.tree_config`): one job = one tree
shape (:mod:`.tree_shapes`), every method of :mod:`.tree_methods` timed in this process on the same inputs by
:func:`.runner.run_method` (the DualKV suites' loop: same timing, check against the first method, peak memory, rows).

Rows: ``attn`` mode ``fwd``, ``bwd`` and ``fwdbwd`` per method; ``layer`` mode ``fwdbwd``. Columns beyond the DualKV
suites': ``T_packed`` (tree tokens), ``T_replicated`` (the flattened trajectories' tokens), ``nodes``, ``depth``,
``trajectories``; ``T`` is the token axis the method ran on. Useful TFLOP/s count the tree's visible (q, k) pairs
(``4 * D * H`` per pair forward, 2.5x that backward) for every method, flattened included; the FLOP floor is that work
(plus the layer's matmuls in layer mode) at ``matmul_tflops``. Source: Tree Training (arXiv 2511.00413).
"""
from __future__ import annotations

from typing import Callable, Optional

from . import checks_tree
from .config_common import swept_settings
from .device import resolve_device
from .runner import run_method
from .tree_methods import TREE_METHODS, tree_methods_for
from .tree_shapes import TreeShape

__all__ = ["run_job"]

_CHECKED: set = set()  # devices whose kernel checks ran in this process (kernel_check runs once per process)


def run_job(cfg, on_row: Optional[Callable] = None) -> list:
    """All methods of one tree job in this process; returns CSV rows (without run metadata). ``kernel_check`` first
    runs :func:`.checks_tree.check_prefix_tree_kernels` (once per process and device: a ``pass=check`` row in the first
    job; :func:`kvtransform.bench.run` fails after writing the CSV if it failed)."""
    device = resolve_device(cfg)
    shape = TreeShape.of(cfg)
    mode = cfg.mode.value if hasattr(cfg.mode, "value") else str(cfg.mode)
    rows = []
    swept = swept_settings(cfg, ("r_min", "r_max", "r_seed", "seed", "hidden", "heads", "kv_heads", "head_dim", "mlp",
                                 "qk_norm", "dtype", "flat_impl", "flex_compile", "flex_mask", "flex_static"))

    def emit(r):
        r.setdefault("op", "decoder_layer" if mode == "layer" else "prefix_tree_attention")
        r.update(mode=mode, T_packed=shape.T, T_replicated=shape.T_rep,
                 floor_ms=shape.floor_ms if device.type == "cuda" else None,  # a GPU matmul rate's floor
                 nodes=shape.layout.num_nodes, depth=shape.layout.depth, trajectories=shape.trajectories)
        if shape.one_level and shape.layout.num_trees == 1:
            r.update(P=shape.layout.lengths[0], mb=shape.layout.num_nodes - 1)
        r["params"] = shape.params + swept + (f" {r['params']}" if r.get("params") else "")
        rows.append(r)
        if on_row is not None:
            on_row(r)

    if cfg.kernel_check and str(device) not in _CHECKED:
        _CHECKED.add(str(device))
        emit(checks_tree.check_row("kvt_tree", "prefix_tree kernels, bf16+fp16",
                              checks_tree.check_prefix_tree_kernels(device)))
    for name in tree_methods_for(cfg, device, shape):
        for r in run_method(cfg, shape, name, device, methods=TREE_METHODS):
            emit(r)
    return rows
