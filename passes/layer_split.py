"""Per-layer split of a rewritten decode program, the form KV offload runs (SpeContext, arXiv 2512.00722 §5–6).

The captured step reads layer ``l``'s cache as ``select(k_cache, 0, l)`` of one stacked ``(L, batch, H_kv, S_max,
D)`` tensor and passes the step's shared ``indices`` to every ``kvt::sparse_decode_attention``.
:func:`split_decode_inputs` rewrites (a copy of) that graph once into ``(input_ids, cache_seqlens, k_0, v_0, idx_0,
..., k_{L-1}, v_{L-1}, idx_{L-1})``: one (cache, indices) triple per layer, so the runtime can hand a resident layer
its GPU cache and an offloaded layer its slot buffer without recapturing the model with ``torch.export`` when a
layer moves. Each layer's K input passes through a ``ready_<l>`` submodule (built by the caller's ``ready``
factory), where the runtime makes the compute stream wait for that layer's copy (``kvtransform/runtime/offload.py``).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from .sparse_decode import KVT_SPARSE_DECODE, drop_input_guards

aten = torch.ops.aten

__all__ = ["split_decode_inputs"]


def split_decode_inputs(gm: torch.fx.GraphModule, num_layers: int,
                        ready: Callable[[], torch.nn.Module] = torch.nn.Identity) -> torch.fx.GraphModule:
    """A copy of the rewritten decode step taking one (K cache, V cache, indices) triple per layer.

    Args:
        gm: the decode program (``input_ids, cache_seqlens, indices, k_cache, v_cache``; every attention a
            ``kvt::sparse_decode_attention`` reading ``select(k_cache, 0, l)``).
        num_layers: L, the layers of the stacked cache.
        ready: builds the module placed on each layer's K input (``ready_<l>``; called with that K tensor and
            returning it); default ``torch.nn.Identity``.

    Returns:
        a ``GraphModule`` called as ``(input_ids (B, 1), cache_seqlens (B,), k_0, v_0, idx_0, ...)`` with the
        decode program's outputs; submodules ``ready_<l>``. It holds ``gm``'s very parameters and buffers (no second
        copy; in-place updates of the model reach both).

    Raises:
        ValueError: the graph uses the stacked cache or the indices in a way this split cannot map (anything but
            per-layer ``select``, the attention's indices argument and size queries of batch, heads or head_dim).
    """
    # the copy gets a flat signature below: copy it without the exported pytree codegen and share its (immutable)
    # tree specs, which torch deep-copies through a deprecated path (a FutureWarning on every split)
    source, codegen = gm, gm.graph._codegen
    memo = {id(t): t for t in (*source.parameters(), *source.buffers())}
    memo.update((id(spec), spec) for spec in (getattr(source, "_in_spec", None), getattr(source, "_out_spec", None)))
    source.graph._codegen = torch.fx.graph.CodeGen()
    try:
        gm = copy.deepcopy(source, memo=memo)
    finally:
        source.graph._codegen = codegen
    g = gm.graph
    ph = {n.target: n for n in g.nodes if n.op == "placeholder"}
    need = ("input_ids", "cache_seqlens", "indices", "k_cache", "v_cache")
    if any(k not in ph for k in need):
        raise ValueError(f"split_decode_inputs needs a decode program with inputs {need}; got {sorted(ph)}")
    drop_input_guards(g)  # shape guards of the old signature
    anchor, raw = ph["v_cache"], []
    for l in range(num_layers):
        trio = []
        for name in (f"k_{l}", f"v_{l}", f"idx_{l}"):
            with g.inserting_after(anchor):
                anchor = g.placeholder(name)
            trio.append(anchor)
        raw.append(trio)
        gm.add_submodule(f"ready_{l}", ready())
    layer_of_k = {}
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is aten.select.int and n.args[0] in (ph["k_cache"], ph["v_cache"]):
            l = int(n.args[2])
            if n.args[1] != 0 or not 0 <= l < num_layers:
                raise ValueError(f"decode program reads the stacked cache as {n.format_node()}: cannot split it")
            src = raw[l][0 if n.args[0] is ph["k_cache"] else 1]
            if n.args[0] is ph["k_cache"]:
                with g.inserting_after(raw[-1][-1]):
                    src = g.call_module(f"ready_{l}", (src,))
                layer_of_k[src] = l
            n.replace_all_uses_with(src)
            g.erase_node(n)
    for n in list(g.nodes):
        if n.op == "call_function" and n.target is KVT_SPARSE_DECODE:
            l = layer_of_k.get(n.args[1])
            if l is None or n.args[3] is not ph["indices"]:
                raise ValueError(f"attention {n.name} does not read one layer's cache with the step's indices")
            n.args = n.args[:3] + (raw[l][2],) + n.args[4:]
    for key, col, shift in (("k_cache", 0, 1), ("v_cache", 1, 1), ("indices", 2, 0)):
        for u in list(ph[key].users):
            d = u.args[1] - shift if u.target is aten.sym_size.int else None
            if d is None or (shift and d not in (0, 1, 3)):  # batch, H_kv, head_dim (never S_max or L)
                raise ValueError(f"the decode program uses {key} in {u.format_node()}: cannot split it per layer")
            u.args = (raw[0][col], d)
        g.erase_node(ph[key])
    g._codegen = torch.fx.graph.CodeGen()  # flat positional signature
    gm.recompile()
    return gm
