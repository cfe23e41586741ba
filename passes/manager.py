"""Pass infrastructure: torch.fx's own ``PassBase``/``PassManager``, plus the context and report every pass shares.

A kvtransform pass is a :class:`KVPass` (a ``torch.fx.passes.infra.pass_base.PassBase``) built with the
transform's :class:`PassContext`; :func:`run_passes` runs a list of them under torch.fx's ``PassManager``, which
recompiles the graph after each pass and lints it (the one place where that happens). Each pass records what it did
(matched, rewritten, skipped with reasons, nodes removed) in ``ctx.report`` and its wall time in
``report.timings["pass:<name>"]``. Dead-code removal is the cleanup pass's job (``passes/cleanup.py``). How a new
pass fits in: ``docs/ARCHITECTURE.md``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager

from kvtransform.report import PassRecord, Report


@dataclass
class PassContext:
    """State shared by the passes of one transform.

    Attributes:
        report: the :class:`~kvtransform.report.Report` every pass appends to.
        config: the model's ``transformers`` config (heads, sliding window, ...), or None.
        max_seq_len: upper bound of the captured dynamic sequence length.
        extra: pass-specific data (e.g. the graph inputs a pass added).
    """

    report: Report
    config: Any = None
    max_seq_len: int = 4096
    extra: dict = field(default_factory=dict)


class KVPass(PassBase):
    """Base of kvtransform's passes: ``call(gm)`` opens the pass's report record, runs :meth:`run` and times it.

    Subclasses set ``name`` (the report record's name) and implement ``run(gm, record) -> bool`` (whether the graph
    changed). They mutate ``gm.graph`` in place and leave recompiling and linting to :func:`run_passes`.
    """

    name = "pass"

    def __init__(self, ctx: PassContext):
        self.ctx = ctx

    def run(self, gm: torch.fx.GraphModule, record: PassRecord) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        record = self.ctx.report.new_pass(self.name)
        t0 = time.perf_counter()
        modified = bool(self.run(gm, record))
        self.ctx.report.timings[f"pass:{self.name}"] = round(time.perf_counter() - t0, 4)
        return PassResult(gm, modified)


def run_passes(gm: torch.fx.GraphModule, passes: Sequence[KVPass],
               progress: Optional[Callable[[str], None]] = None) -> torch.fx.GraphModule:
    """Run ``passes`` in order under ``torch.fx.passes.infra.pass_manager.PassManager`` (recompile + lint after
    each). ``progress(name)`` is called before each pass.

    Raises:
        whatever a pass raises (``ValueError`` for a refusal), unwrapped from the manager's generic exception.
    """
    def announce(p: KVPass):
        def step(m):
            if progress:
                progress(p.name)
            return p(m)
        step.__name__ = p.name
        return step

    manager = PassManager([announce(p) for p in passes], run_checks_after_each_pass=True)
    manager.check = lambda module: module.graph.lint()  # the invariant checked after every pass
    try:
        return manager(gm).graph_module
    except Exception as e:  # PassManager wraps the pass's own exception; give the caller that one
        if e.__cause__ is not None and type(e) is Exception:
            raise e.__cause__ from None
        raise


def derived_program(gm: torch.fx.GraphModule, graph: torch.fx.Graph, root=None) -> torch.fx.GraphModule:
    """A ``GraphModule`` running ``graph`` (derived from ``gm``'s) over ``root``'s attributes (default ``gm``'s; a
    dict of target -> tensor/module also works), with ``gm``'s calling convention: an unlifted torch.export module
    flattens its inputs and outputs with ``_in_spec``/``_out_spec``, which the new module keeps."""
    new = torch.fx.GraphModule(gm if root is None else root, graph)
    if hasattr(gm, "_in_spec"):
        new._in_spec, new._out_spec = gm._in_spec, gm._out_spec
        new.graph._codegen = gm.graph._codegen
        new.recompile()
    return new


def keyword_optional_args(node: torch.fx.Node) -> bool:
    """Pass the optional arguments of a ``kvt`` op node (``window``, ``softcap``, ``sinks``: those with a default in
    its schema) by keyword, as a capture writes them; ``torch.export``'s serialised form (a reloaded artifact)
    writes them by position, and the passes read them by name. Returns whether the node changed."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace != "kvt":
        return False
    schema = op._schema.arguments
    first = next((i for i, a in enumerate(schema) if a.has_default_value() or a.kwarg_only), len(schema))
    if len(node.args) <= first:
        return False
    moved = {schema[i].name: a for i, a in enumerate(node.args) if i >= first and a is not None}  # (default None)
    node.kwargs = {**moved, **node.kwargs}
    node.args = node.args[:first]
    return True


def keyword_optional_args_all(gm: torch.fx.GraphModule) -> int:
    """:func:`keyword_optional_args` on every node of ``gm`` (a program loaded with ``torch.export.load``); the
    module is recompiled when a node changed. Returns how many did."""
    changed = sum(keyword_optional_args(n) for n in gm.graph.nodes)
    if changed:
        gm.recompile()
    return changed
