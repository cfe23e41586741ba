"""Pass manager: runs ``GraphModule -> GraphModule`` passes in order and records what each did in the report."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from kvtransform.report import Report


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


Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]


class PassManager:
    """Run named passes in order; each gets the graph and the shared :class:`PassContext`.

    Example::

        pm = PassManager([("attention", canonicalize_attention), ("cleanup", cleanup)])
        gm = pm.run(gm, ctx)
    """

    def __init__(self, passes: list[tuple[str, Pass]]):
        self.passes = list(passes)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext, progress: Optional[Callable[[str], None]] = None):
        for name, fn in self.passes:
            if progress:
                progress(name)
            t0 = time.perf_counter()
            gm = fn(gm, ctx)
            gm.graph.lint()
            gm.recompile()
            ctx.report.timings[f"pass:{name}"] = round(time.perf_counter() - t0, 4)
        return gm
