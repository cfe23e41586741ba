"""The PNG plot of the long benchmark CSV: grouped bars per shape with the floor (DualKV suites), per cache length
with the HBM floor (``decode-ops``), tokens/s and ms per step against the context (``decode``)."""
from __future__ import annotations

from . import seed
from .report_rows import LAYER_METHODS, config_key, config_label, get_row, in_config, ms, num, shapes

__all__ = ["plot_png"]


def _grouped_bars(ax, df, methods: list, groups: list, in_group, value: str, tick: str) -> None:
    """One bar of ``value`` per method in each group (``in_group(df, group)`` selects the group's rows; the last
    row counts), a black tick at the row's ``tick`` column when it has one; x ticks at the groups."""
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        labelled = False  # one legend entry per method, on its first group with a row
        for i, g in enumerate(groups):
            sel = df[(df["method"] == m) & in_group(df, g)]
            if sel.empty:
                continue
            x = i - 0.4 + w * (j + 0.5)
            ax.bar(x, float(sel.iloc[-1][value]), w, color=f"C{j % 10}", label=None if labelled else m)
            labelled = True
            t = num(sel.iloc[-1].get(tick))
            if t:
                ax.hlines(t, x - w / 2, x + w / 2, colors="black", linewidth=1.5)
    ax.set_xticks(range(len(groups)))


def _plot_decode(df, path: str) -> bool:
    """Grouped bars of p50 ms per op for each S (log scale), the HBM floor of each as a black tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = df[(df["status"] == "ok") & ~df["pass"].isin(["tune", "check", "check_tuned"]) & (df["op"] != "memcpy")]
    if df.empty:
        return False
    seqs = sorted({int(s) for s in df["S"]})
    methods = list(dict.fromkeys(df["method"]))
    fig, ax = plt.subplots(figsize=(min(18, max(6, 0.3 * len(seqs) * len(methods) + 2)), 5))
    _grouped_bars(ax, df, methods, seqs, lambda d, s_: d["S"] == s_, "ms_p50", "floor_ms")
    ax.set_xticklabels([f"S={s_}" for s_ in seqs])
    ax.set_yscale("log")
    ax.set_ylabel("ms, p50 (log); black = bytes / copy bandwidth")
    ax.set_title(f"decode-ops on {df.iloc[0]['device']}")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_throughput(df, path: str) -> bool:
    """Left: end-to-end tokens/s per method for each (model, input, output), the paper's as black ticks. Right:
    ms per decode step against the context for each method and configuration, its HBM floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = df[(df["pass"] == "run") & (df["status"] == "ok")]
    steps = df[(df["pass"] == "step") & (df["status"] == "ok")]
    if runs.empty or "tokens_per_s" not in runs.columns:
        return False
    keys = list(dict.fromkeys(config_key(r) for _, r in runs.iterrows()))
    methods = list(dict.fromkeys(runs["method"]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(min(20, 6 + 1.2 * len(keys) * max(1, len(methods)) / 3), 5))
    _grouped_bars(ax, runs, methods, keys, in_config, "tokens_per_s",
                  "paper_tokens_per_s")
    ax.set_xticklabels([f"{config_label(k)}\n[{k[1]}, {k[2]}]" for k in keys], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s end to end (log); black = paper (A800)")
    ax.legend(fontsize=7)
    for j, m in enumerate(methods):
        labelled = False  # one legend entry per method, on its first configuration with steps
        for key in keys:
            sel = steps[(steps["method"] == m) & in_config(steps, key)]
            if sel.empty:
                continue
            ax2.plot(sel["context"], sel["ms_p50"], "o-", color=f"C{j % 10}", label=None if labelled else m,
                     linewidth=1)
            labelled = True
            ax2.plot(sel["context"], sel["floor_ms"], "--", color=f"C{j % 10}", linewidth=0.8)
    ax2.set_xlabel("context (tokens)")
    ax2.set_ylabel("ms per decode step (dashed: HBM floor)")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    fig.suptitle(f"decode throughput on {runs.iloc[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_png(df, path: str) -> bool:
    """Grouped bars of p50 ms per method for each (P, mb), log scale, with the FLOP floor (black tick) and the
    paper's DualKV time (red tick); for ``decode-ops`` rows, per S with the HBM floor. Returns False when nothing
    was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if (df["suite"] == "decode-ops").any():
        return _plot_decode(df[df["suite"] == "decode-ops"], path)
    if (df["suite"] == "decode").any():
        return _plot_throughput(df[df["suite"] == "decode"], path)
    df = df[(df["pass"] == "fwdbwd") & (df["status"] == "ok")]
    if df.empty:
        return False
    paper = seed.table("paper_layer")
    shape_list = shapes(df)
    methods = [m for m in LAYER_METHODS if (df["method"] == m).any()]
    fig, ax = plt.subplots(figsize=(min(18, max(6, 0.25 * len(shape_list) * max(1, len(methods)) + 2)), 5))
    w = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs, ys = [], []
        for i, (P, mb) in enumerate(shape_list):
            y = ms(get_row(df, m, P, mb))
            if y is not None:
                xs.append(i - 0.4 + w * (j + 0.5))
                ys.append(y)
        ax.bar(xs, ys, w, label=m)
    for i, (P, mb) in enumerate(shape_list):
        sel = df[(df["P"] == P) & (df["mb"] == mb)]
        floor = num(sel.iloc[0]["floor_ms"])
        if floor:
            ax.hlines(floor, i - 0.45, i + 0.45, colors="black", linewidth=2, label="FLOP floor" if i == 0 else None)
        pd_ms = paper.get((P, mb), {}).get("dualkv_ms")
        if pd_ms and (sel["mode"] == "layer").any():
            ax.hlines(pd_ms, i - 0.45, i + 0.45, colors="red", linestyles="dashed", linewidth=1.5,
                      label="paper DualKV (H100)" if not any(l.get_label() == "paper DualKV (H100)" for l in ax.collections) else None)
    ax.set_xticks(range(len(shape_list)))
    ax.set_xticklabels([f"P={P}\nmb={mb}" for P, mb in shape_list], fontsize=8)
    ax.set_yscale("log")
    mode = df.iloc[0]["mode"]
    ax.set_ylabel("ms, p50 (log)")
    ax.set_title(f"{df.iloc[0]['suite']} ({'layer fwd+bwd' if mode == 'layer' else 'attention fwd+bwd'}) on "
                 f"{df.iloc[0]['device']}")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
