"""What the passes did: per-pass records, per-attention-site records, and the verification result.

``Report.to_dict()`` is the JSON written as ``report.json`` next to a saved artifact::

    {"model": ..., "transform": ...,
     "passes": [{"name", "matched", "rewritten", "skipped": [{"site", "reason"}], "nodes_removed", "notes"}],
     "sites": [{"index", "layer", "kind", "q_heads", "kv_heads", "head_dim", "mask_kind", "status", "node",
                "window", "softcap", "sinks"}],
     "verification": {"max_abs_error", "max_rel_error", "tolerance", "passed", "cases"}}
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class PassRecord:
    name: str
    matched: int = 0
    rewritten: int = 0
    skipped: list = field(default_factory=list)  # [{"site": int, "reason": str}]
    nodes_removed: int = 0
    notes: list = field(default_factory=list)

    def skip(self, site: int, reason: str) -> None:
        self.skipped.append({"site": site, "reason": reason})


@dataclass
class Site:
    """One attention found in the graph.

    ``kind``: ``"sdpa"`` (aten.scaled_dot_product_attention) or ``"eager"`` (matmul-softmax-matmul chain).
    ``mask_kind``: ``"none"``, ``"causal"``, ``"causal+padding"``, ``"sliding_window"`` or ``"custom"``.
    ``status``: ``"found"``, ``"canonical"``, ``"dualkv"``, ``"sparse_decode"`` or ``"skipped: <reason>"``.
    Attention variants (``docs/ARCHITECTURE.md``), None when off: ``window`` (int, the proven sliding window in
    tokens, HF ``sliding_window`` semantics), ``softcap`` (float, Gemma 2's logit soft-cap), ``sinks`` (str, the
    name of the ``(H,)`` learned sink-logit parameter, gpt-oss).
    """

    index: int
    layer: Optional[int]
    kind: str
    q_heads: Optional[int]
    kv_heads: Optional[int]
    head_dim: Optional[int]
    mask_kind: str
    status: str
    node: str = ""
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[str] = None


@dataclass
class Verification:
    max_abs_error: Optional[float] = None
    max_rel_error: Optional[float] = None
    tolerance: Optional[float] = None
    passed: Optional[bool] = None
    cases: list = field(default_factory=list)  # [{"name", "shape", "max_abs_error", "max_rel_error"}]


@dataclass
class Report:
    model: str = ""
    transform: str = ""
    passes: list = field(default_factory=list)
    sites: list = field(default_factory=list)
    verification: Verification = field(default_factory=Verification)
    timings: dict = field(default_factory=dict)  # seconds per stage

    def new_pass(self, name: str) -> PassRecord:
        rec = PassRecord(name)
        self.passes.append(rec)
        return rec

    def pass_record(self, name: str) -> Optional[PassRecord]:
        return next((p for p in self.passes if p.name == name), None)

    def count(self, status: str) -> int:
        return sum(1 for s in self.sites if s.status == status)

    # ---- serialisation -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "transform": self.transform,
            "passes": [asdict(p) for p in self.passes],
            "sites": [asdict(s) for s in self.sites],
            "verification": asdict(self.verification),
            "timings": dict(self.timings),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        return cls(
            model=d.get("model", ""),
            transform=d.get("transform", ""),
            passes=[PassRecord(**p) for p in d.get("passes", [])],
            sites=[Site(**s) for s in d.get("sites", [])],
            verification=Verification(**d.get("verification", {})),
            timings=dict(d.get("timings", {})),
        )

    # ---- display -------------------------------------------------------------------------------------------------
    def print(self, console=None, sites: bool = True) -> None:
        """Render the report as rich tables (sites, passes, verification); an inspect report (``transform ==
        "inspect"``: sites found, nothing rewritten or verified) shows the sites only."""
        from rich.table import Table

        from kvtransform.utils import console as make_console

        console = console or make_console()
        if sites and self.sites:
            t = Table(title=f"attention sites ({len(self.sites)})", title_justify="left")
            variants = any(s.window is not None or s.softcap is not None or s.sinks is not None for s in self.sites)
            cols = ("#", "layer", "kind", "H", "H_kv", "head_dim", "mask") + (
                ("window", "softcap", "sinks") if variants else ()) + ("status",)
            for col in cols:
                t.add_column(col, no_wrap=col in ("head_dim", "mask", "status"))
            for s in self.sites:
                extra = ((str(s.window) if s.window is not None else "-", f"{s.softcap:g}" if s.softcap is not None
                          else "-", "yes" if s.sinks is not None else "-") if variants else ())
                t.add_row(str(s.index), str(s.layer), s.kind, str(s.q_heads), str(s.kv_heads), str(s.head_dim),
                          s.mask_kind, *extra, s.status)
            console.print(t)
        inspecting = self.transform == "inspect"
        if self.passes and not inspecting:
            t = Table(title="passes", title_justify="left")
            for col in ("pass", "matched", "rewritten", "skipped", "nodes removed"):
                t.add_column(col)
            t.add_column("notes", max_width=72, overflow="fold")  # wrapped in its cell: a log keeps ~140 columns
            for p in self.passes:
                reasons = "; ".join(sorted({s["reason"] for s in p.skipped}))
                t.add_row(p.name, str(p.matched), str(p.rewritten),
                          f"{len(p.skipped)}" + (f" ({reasons})" if reasons else ""), str(p.nodes_removed),
                          "; ".join(p.notes))
            console.print(t)
        v = self.verification
        if v.passed is not None:
            status = "[green]passed[/green]" if v.passed else "[red]FAILED[/red]"
            rel = "≤" if v.passed else ">"
            console.print(f"verification: {status}  max_rel_error={v.max_rel_error:.3g} {rel} tolerance "
                          f"{v.tolerance:.3g}  (relative: max|a-b| / max|b| over real tokens; "
                          f"max_abs_error={v.max_abs_error:.3g}; {len(v.cases)} cases)")
        elif self.passes and not inspecting:
            console.print("verification: [yellow]not run[/yellow]")
