"""Markdown table and plot of the prefix-tree suites (``tree-attn``, ``tree-layer``; :mod:`.tree_runner`): per tree
shape (the ``params`` column), every method's p50 (p20–p80) per pass, useful TFLOP/s on the tree's visible pairs,
the fwd+bwd time over ``kvt_tree``'s (``kvt_tree_compiled``'s for the compiled layer methods; > 1 = slower than
ours), peak memory and the FLOP floor."""
from __future__ import annotations

from .report_rows import cell_gb, cell_ms, commits, fmt, ms, num, ratio

__all__ = ["TREE_SUITES", "markdown_tree", "plot_tree"]

TREE_SUITES = ("tree-attn", "tree-layer")
_PASSES = {"attn": ("fwd", "bwd", "fwdbwd"), "layer": ("fwdbwd",)}


def _row(df, method, params, mode, pass_):
    sel = df[(df["method"] == method) & (df["params"] == params) & (df["mode"] == mode) & (df["pass"] == pass_)]
    return None if sel.empty else sel.iloc[-1]


def _int(x) -> str:
    f = num(x)
    return "–" if f is None else str(int(f))


def _text(x) -> str:
    return x if isinstance(x, str) else ""


def markdown_tree(df) -> str:
    """The tables of the tree suites' rows of ``df`` (empty string when there are none)."""
    df = df[df["suite"].isin(TREE_SUITES)]
    checks = df[df["pass"].isin(["check", "check_tuned"])]
    df = df[~df["pass"].isin(["check", "check_tuned", "tune"])]
    if df.empty and checks.empty:
        return ""
    out = []
    for mode in ("attn", "layer"):
        sub = df[df["mode"] == mode]
        if sub.empty:
            continue
        first = sub.iloc[0]
        what = "attention op alone" if mode == "attn" else "decoder layer (Qwen3-8B-shaped), fwd+bwd of out.sum()"
        out += [f"Prefix-tree {what} · device {first['device']} · {commits(sub)} · torch {first['torch']} · "
                f"{first['dtype']} · p50 ms [p20–p80]; useful TFLOP/s = 4·D·H·visible tree pairs "
                f"(×2.5 backward, ×3.5 fwd+bwd{', plus the layer matmuls' if mode == 'layer' else ''}) over p50, "
                f"the same work for every method; T = tokens the method ran on (packed tree or flat trajectories).", ""]
        passes = _PASSES[mode]
        head = ["shape", "nodes / depth / traj.", "T packed", "T flat", "floor ms", "method", "impl", "T"]
        for p in passes:
            head += [f"{p} ms p50 [p20–p80]", f"{p} TFLOP/s"]
        head += ["fwd+bwd / ours", "GiB", "status"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for params in dict.fromkeys(sub["params"]):
            shp = sub[sub["params"] == params]
            s0 = shp.iloc[0]
            for m in dict.fromkeys(shp["method"]):
                rs = [_row(shp, m, params, mode, p) for p in passes]
                t = rs[-1]
                if t is None:
                    continue
                ours = "kvt_tree_compiled" if m.endswith("_compiled") else "kvt_tree"
                o = ms(_row(shp, ours, params, mode, "fwdbwd"))
                cells = [params, f"{_int(s0.get('nodes'))} / {_int(s0.get('depth'))} / "
                         f"{_int(s0.get('trajectories'))}", _int(s0.get("T_packed")), _int(s0.get("T_replicated")),
                         fmt(s0.get("floor_ms"), 2), m, _text(t.get("impl")), _int(t.get("T"))]
                for r in rs:
                    ok = ms(r) is not None
                    cells += [f"{fmt(r['ms_p50'], 2)} [{fmt(r['ms_p20'], 2)}–{fmt(r['ms_p80'], 2)}]" if ok
                              else cell_ms(r), fmt(r.get("tflops"), 0) if ok else "–"]
                cells += [ratio(ms(t), o), cell_gb(t), str(t.get("status", "ok"))]
                out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if not checks.empty:
        out.append("Kernel checks: " + "; ".join(f"{m} {i}: {st} (worst {fmt(e, 2)} of bound)" for m, i, st, e in
                                                 zip(checks["method"], checks["impl"], checks["status"],
                                                     checks["check_rel_err"])))
    return "\n".join(out).rstrip()


def plot_tree(df, path: str) -> bool:
    """Grouped bars of fwd+bwd p50 ms per method for each tree shape (log scale), the FLOP floor as a black tick.
    Returns False when nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report_plot import _grouped_bars

    df = df[df["suite"].isin(TREE_SUITES) & (df["pass"] == "fwdbwd") & (df["status"] == "ok")]
    if df.empty:
        return False
    groups = list(dict.fromkeys(zip(df["mode"], df["params"])))
    methods = list(dict.fromkeys(df["method"]))
    fig, ax = plt.subplots(figsize=(min(18, max(6, 0.3 * len(groups) * len(methods) + 2)), 5))
    _grouped_bars(ax, df, methods, groups, lambda d, g: (d["mode"] == g[0]) & (d["params"] == g[1]), "ms_p50",
                  "floor_ms")
    ax.set_xticklabels([f"{m}\n" + p.replace(" turns", "\nturns") for m, p in groups], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("fwd+bwd ms, p50 (log); black = FLOP floor")
    ax.set_title(f"prefix-tree attention on {df.iloc[0]['device']}")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
