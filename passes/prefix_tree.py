"""Prefix-tree pass: the packed DualKV program becomes the prefix-tree program (any depth of shared prefix).

Input: the dualkv transform's rewritten program (after :class:`~.dualkv.DualKVPass` and cleanup; a freshly captured
graph or one reloaded from ``model.pt2``): inputs ``(input_ids (1, T), position_ids (1, T), cu_seqlens (S+1,),
segment_prefix (S,))``, every attention a ``kvt.dualkv_attention(q3, k3, v3, cu_seqlens, segment_prefix, scale)``.
The packed capture itself is layout-agnostic (the layout only enters through the attention), so no second
``torch.export`` is needed: this pass rewires the same graph. Output program::

    (input_ids (1, T), position_ids (1, T), cu_seqlens (N+1,), parent (N,), key_range_ptr (N+1,), key_ranges (RK, 2),
     query_range_ptr (N+1,), query_ranges (RQ, 2)) -> logits (1, T, vocab)

with every ``kvt.dualkv_attention`` replaced in place by ``kvt.prefix_tree_attention(q3, k3, v3, *layout, scale)``
(its ``window``/``softcap``/``sinks`` keywords kept)
(same ``(out, lse)`` result; the layout tensors are
:meth:`kvtransform.tree_layout.PrefixTreeLayout.kernel_tensors`). A root→leaf path of nodes then computes what that
path computes as one causal sequence (Tree Training, arXiv 2511.00413; DualKV, arXiv 2605.15422, is its one-level
case). The capture's input guard call (``_guards_fn``, bounds of the one-level layout axes) is removed: the op checks
the layout, :class:`~kvtransform.transforms.dualkv.DualKVModule` the token axis.

What the dualkv pass refused (custom masks, padding) never reaches this pass: the transform raised.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from .dualkv import unsupported_variants
from .manager import KVPass, PassContext, derived_program, keyword_optional_args, run_passes

KVT_DUALKV = torch.ops.kvt.dualkv_attention.default
KVT_TREE = torch.ops.kvt.prefix_tree_attention.default
#: the tree program's layout inputs after ``cu_seqlens``, in :meth:`PrefixTreeLayout.kernel_tensors` order
TREE_INPUTS = ("parent", "key_range_ptr", "key_ranges", "query_range_ptr", "query_ranges")

__all__ = ["PrefixTreePass", "prefix_tree_program", "prefix_tree_layers", "TREE_INPUTS"]


class PrefixTreePass(KVPass):
    """Rewrite every ``kvt.dualkv_attention`` into ``kvt.prefix_tree_attention`` and the program's layout inputs
    ``(cu_seqlens, segment_prefix)`` into the tree's six (module docstring). Mutates ``gm`` in place: run it on a
    copy (:func:`prefix_tree_program`). Records a pass named ``prefix_tree`` (matched = DualKV attention nodes,
    rewritten); site statuses stay ``"dualkv"`` (the one-level program's).

    Raises:
        ValueError: no ``kvt.dualkv_attention`` in the graph (run the dualkv pass first), its layout arguments are
            not the same two graph inputs everywhere, or a ``window``/``softcap``/``sinks`` keyword the installed
            ``kvt.prefix_tree_attention`` does not take.
    """

    name = "prefix_tree"

    def run(self, gm: torch.fx.GraphModule, rec) -> bool:
        graph = gm.graph
        calls = [n for n in graph.nodes if n.op == "call_function" and n.target is KVT_DUALKV]
        rec.matched = len(calls)
        if not calls:
            raise ValueError("the prefix_tree pass needs a program with kvt.dualkv_attention nodes: run the dualkv "
                             "pass (kvt.transform(model, 'dualkv')) first")
        layouts = {(c.args[3], c.args[4]) for c in calls}
        cu, sp = next(iter(layouts))
        if len(layouts) != 1 or cu.op != "placeholder" or sp.op != "placeholder":
            raise ValueError("the prefix_tree pass needs every kvt.dualkv_attention to read the same two graph inputs "
                             "(cu_seqlens, segment_prefix), as the dualkv pass wires them")
        for c in calls:
            keyword_optional_args(c)  # (a reloaded program passes window/softcap/sinks by position)
            why = unsupported_variants(KVT_TREE, dict(c.kwargs))
            if why is not None:
                raise ValueError(f"the prefix_tree pass cannot rewrite {c.name}: {why}")
        if _drop_input_guards(graph):
            rec.notes.append("input guard call of the packed capture removed (the op checks the layout)")
        new = _tree_inputs_after(graph, sp)
        for c in calls:
            c.target = KVT_TREE
            c.args = (*c.args[:3], cu, *new, c.args[5])
            rec.rewritten += 1
        graph.erase_node(sp)
        _reset_input_spec(gm)
        rec.notes.append(f"{rec.rewritten} kvt.dualkv_attention -> kvt.prefix_tree_attention; inputs "
                         f"{[n.target for n in graph.nodes if n.op == 'placeholder']}")
        return True


def _drop_input_guards(graph: torch.fx.Graph) -> int:
    """Erase the capture's input guard calls (``_guards_fn``: bounds of the one-level layout axes, e.g. S >= 2; the
    tree axes have other bounds and the op checks the layout). Returns how many."""
    guards = [n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    for n in guards:
        graph.erase_node(n)
    return len(guards)


def _tree_inputs_after(graph: torch.fx.Graph, sp: torch.fx.Node) -> list:
    """The tree's five layout placeholders (:data:`TREE_INPUTS`), inserted right after ``segment_prefix``'s (which
    the caller erases once nothing reads it)."""
    new = []
    with graph.inserting_after(sp):
        for name in reversed(TREE_INPUTS):
            new.insert(0, graph.placeholder(name))
    return new


def _reset_input_spec(gm: torch.fx.GraphModule) -> None:
    """An unlifted torch.export module flattens its positional inputs with ``_in_spec``: give it one for the graph's
    placeholders now (a new codegen object: the source program's is shared, never mutated)."""
    cg = gm.graph._codegen
    if not isinstance(cg, torch.fx.graph._PyTreeCodeGen):
        return
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    spec = pytree.tree_flatten((tuple(range(len(names))), {}))[1]
    gm.graph._codegen = torch.fx.graph._PyTreeCodeGen(cg.pytree_info._replace(orig_args=names, in_spec=spec))
    gm._in_spec = spec


def prefix_tree_program(program: torch.nn.Module, ctx: PassContext) -> torch.fx.GraphModule:
    """The prefix-tree program derived from a packed DualKV ``program`` (a ``GraphModule``, or a module holding one
    as ``.gm``); shares its parameters and buffers, leaves it unchanged, records the pass in ``ctx.report``.

    Returns:
        ``GraphModule``: ``(input_ids, position_ids, *PrefixTreeLayout.kernel_tensors()) -> logits (1, T, vocab)``.

    Raises:
        ValueError: as :class:`PrefixTreePass`.
    """
    gm = getattr(program, "gm", program)
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node metadata comes along; the calling convention below
    return run_passes(derived_program(gm, graph), [PrefixTreePass(ctx)])


def _layout_dispatch(self, *args):
    """A split stage's forward: its own program for the one-level inputs, its prefix-tree variant (same
    parameters) for the tree's (more inputs: one ``segment_prefix`` became the tree's five tensors)."""
    if len(args) == self._one_level_arity:
        return type(self).forward(self, *args)
    return self._tree_variant(*args)


def _guard_free_variant(stage: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A stage without attention (the embedding and rotary tables): the same graph with the one-level input guards
    dropped and ``segment_prefix`` replaced by the tree's five inputs (unused)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(stage.graph, {}))
    _drop_input_guards(graph)
    sp = [n for n in graph.nodes if n.op == "placeholder" and n.name == "segment_prefix"]
    if len(sp) != 1 or sp[0].users:
        raise ValueError("prefix_tree_layers: a stage without attention reads segment_prefix beyond its input "
                         "guards")
    _tree_inputs_after(graph, sp[0])
    graph.erase_node(sp[0])
    return derived_program(stage, graph)


def prefix_tree_layers(split: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """The prefix-tree program of a DualKV program split per decoder layer
    (:func:`kvtransform.distributed.split_decoder_layers`; its layers may be checkpoint-wrapped and FSDP2-sharded,
    as :func:`kvtransform.distributed.shard_dualkv` leaves them).

    Each stage that reads the layout (the decoder layers; ``pre`` for its input guards) gets its prefix-tree variant
    (:func:`prefix_tree_program`; for ``pre`` its guards dropped) reading its parameters through the stage's own
    submodules, so FSDP2's all-gather, which swaps the unsharded parameters into those submodules around the
    stage's call, reaches both; the stage's ``forward`` then dispatches on the number of inputs. The returned
    top-level program calls the very same ``pre``, ``layers`` and ``post`` modules (FSDP2's hooks and activation
    checkpointing included) with the tree's layout inputs. Idempotent per stage.

    Returns:
        ``GraphModule``: ``(input_ids, position_ids, *PrefixTreeLayout.kernel_tensors()) -> logits``.

    Raises:
        ValueError: as :class:`PrefixTreePass` for a layer, or a stage without attention that reads
            ``segment_prefix`` beyond its input guards.
    """
    import types

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(split.graph, {}))
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    if len(phs) != 4:
        raise ValueError(f"prefix_tree_layers needs the split DualKV program (input_ids, position_ids, cu_seqlens, "
                         f"segment_prefix); got {len(phs)} inputs")
    sp = phs[3]
    new = _tree_inputs_after(graph, sp)
    for node in [n for n in graph.nodes if sp in n.args]:
        if node.op != "call_module":
            raise ValueError(f"prefix_tree_layers: {node.name} reads segment_prefix outside a stage")
        stage = split.get_submodule(str(node.target))
        inner = getattr(stage, "_checkpoint_wrapped_module", stage)
        if "_tree_variant" not in inner.__dict__:
            has_attention = any(n.op == "call_function" and n.target is KVT_DUALKV for n in inner.graph.nodes)
            tree = prefix_tree_program(inner, ctx) if has_attention else _guard_free_variant(inner)
            tree._modules = inner._modules  # the same submodules: FSDP2's parameter swaps reach the variant too
            inner.__dict__["_tree_variant"] = tree  # not registered: its parameters are the stage's
            inner.__dict__["_one_level_arity"] = sum(n.op == "placeholder" for n in inner.graph.nodes)
            inner.__dict__["forward"] = types.MethodType(_layout_dispatch, inner)
        node.args = tuple(x for a in node.args for x in (new if a is sp else [a]))
    graph.erase_node(sp)
    top = derived_program(split, graph)
    _reset_input_spec(top)
    top.recompile()
    top.layers = split.layers  # the same ModuleList (GraphModule copied the call targets into a plain Module)
    return top
