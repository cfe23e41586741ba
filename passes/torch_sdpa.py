"""Torch-level SDPA rewrite for the graphs ``torch.compile`` hands a backend (``kvtransform/compile.py``).

Dynamo gives the backend torch-level FX graphs (before AOT autograd), so this matches torch-level
``scaled_dot_product_attention`` calls (transformers' ``sdpa`` attention; ``docs/ARCHITECTURE.md``, floor "passes")
rather than the aten-level patterns of :mod:`.attention`, and rewrites each into
``kvt.attention(q, k, v, attn_mask, None, softmax_scale, causal)``: ``is_causal`` maps to ``causal`` when the query
and key lengths are provably equal (SDPA's causal mask is top-left aligned, ``kvt.attention``'s bottom-right: equal
only then), GQA (``enable_gqa``) maps to the op's own head mapping, ``attn_mask`` is passed on unchanged, and
``scale=None`` becomes ``head_dim ** -0.5``. A call it cannot prove equivalent (attention dropout, a traced scale,
causal with possibly different lengths) is left as SDPA with the reason. Subgraphs of higher-order ops (activation
checkpointing) are rewritten too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rewrite_sdpa"]

_SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _val(node):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, torch.fx.Node) else None


def _provably_equal(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b)) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) \
        else a == b


def _rewrite_one(graph: torch.fx.Graph, node: torch.fx.Node) -> str:
    """Replace one SDPA call; returns ``""`` when rewritten, else the reason it was left alone."""
    a = dict(_SDPA_DEFAULTS)
    a.update(zip(_SDPA_ARGS, node.args))
    a.update(node.kwargs)
    q, k = _val(a["query"]), _val(a["key"])
    if q is None or k is None or q.dim() != 4 or k.dim() != 4:
        return "query/key not 4-D (B, H, S, D) with known metadata"
    if isinstance(a["dropout_p"], torch.fx.Node) or float(a["dropout_p"]) != 0.0:
        return f"attention dropout {a['dropout_p']!r} (kvt.attention has none)"
    if isinstance(a["is_causal"], torch.fx.Node) or isinstance(a["enable_gqa"], torch.fx.Node):
        return "is_causal / enable_gqa is a traced value"
    causal = bool(a["is_causal"])
    if causal and not _provably_equal(q.shape[-2], k.shape[-2]):
        return "is_causal with query and key lengths not provably equal (top-left vs bottom-right causal)"
    scale = a["scale"]
    if scale is None:
        d = q.shape[-1]
        if isinstance(d, torch.SymInt):
            return "head_dim is symbolic and no scale given"
        scale = float(d) ** -0.5
    elif isinstance(scale, torch.fx.Node):
        return "scale is a traced value"
    if q.shape[1] != k.shape[1] and not a["enable_gqa"]:
        return "query and key heads differ without enable_gqa"
    with graph.inserting_before(node):
        new = graph.call_function(torch.ops.kvt.attention.default,
                                  (a["query"], a["key"], a["value"], a["attn_mask"], None, float(scale), causal))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return ""


def rewrite_sdpa(gm: torch.fx.GraphModule) -> tuple[int, list]:
    """Rewrite every torch-level SDPA call of ``gm`` and of its nested graph modules into ``kvt.attention``.

    Returns:
        ``(number rewritten, [(graph module name, node name, reason) for each call left alone])``.
    """
    done, skipped = 0, []
    for name, mod in gm.named_modules():
        if not isinstance(mod, torch.fx.GraphModule):
            continue
        changed = False
        for node in list(mod.graph.nodes):
            if node.op == "call_function" and node.target in _SDPA_TARGETS:
                why = _rewrite_one(mod.graph, node)
                if why:
                    skipped.append((name or "<root>", node.name, why))
                else:
                    done, changed = done + 1, True
        if changed:
            mod.graph.lint()
            mod.recompile()
    return done, skipped
