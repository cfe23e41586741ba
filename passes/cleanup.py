"""Cleanup pass: remove what the rewrites left dead (mask construction, repeat_kv, their metadata asserts)."""
from __future__ import annotations

import torch

from .manager import KVPass

_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}
for _name in ("_assert_scalar", "sym_constrain_range_for_size"):
    if hasattr(torch.ops.aten, _name):
        _ASSERTS.add(getattr(torch.ops.aten, _name).default)


# Tagged nondeterministic_seeded (so FX calls them impure) only because of dropout; dead means removable.
_DEAD_OK = {torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.dropout.default}


def _only_asserted(node: torch.fx.Node) -> bool:
    """True if every user of ``node`` is a metadata assert (so the value itself is never used)."""
    return bool(node.users) and all(u.op == "call_function" and u.target is torch.ops.aten._assert_tensor_metadata.default
                                    for u in node.users)


def remove_dead_code(gm: torch.fx.GraphModule) -> int:
    """Remove dead pure nodes and asserts on otherwise-dead values until nothing changes. Returns nodes removed."""
    graph = gm.graph
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node.op != "call_function":
                continue
            if node.target is torch.ops.aten._assert_tensor_metadata.default:
                src = node.args[0] if node.args else None
                if isinstance(src, torch.fx.Node) and _only_asserted(src) and src.op == "call_function":
                    graph.erase_node(node)
                    removed += 1
                    changed = True
                continue
            if not node.users and (not node.is_impure() or node.target in _DEAD_OK):
                graph.erase_node(node)
                removed += 1
                changed = True
    return removed


class CleanupPass(KVPass):
    """Dead-code elimination after the rewrites (the one place it happens); records ``nodes_removed``."""

    name = "cleanup"

    def run(self, gm: torch.fx.GraphModule, record) -> bool:
        record.nodes_removed = remove_dead_code(gm)
        return record.nodes_removed > 0
