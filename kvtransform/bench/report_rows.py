"""Reading rows of the long benchmark CSV for the tables and plots: numbers that may be missing or NaN, table cells,
the row of a method at a shape, and the configurations of the ``decode`` suite (:mod:`.report_markdown`,
:mod:`.report_plot`, :mod:`.report`)."""
from __future__ import annotations

import math
from typing import Optional

__all__ = ["LAYER_METHODS", "THROUGHPUT_DENSE", "num", "fmt", "ratio", "shapes", "get_row", "ms", "cell_ms",
           "cell_gb", "commits", "tick", "config_key", "config_label", "in_config"]

LAYER_METHODS = ["dualkv", "flex", "flex_rebuild", "fa2", "pg", "reference", "dualkv_kernel", "dualkv_compiled",
                 "flex_compiled"]
THROUGHPUT_DENSE = ("hf_sdpa", "hf_static", "dense", "flashinfer")  # "best dense" of the decode suite


def num(x) -> Optional[float]:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def fmt(x, nd=1) -> str:
    f = num(x)
    return "–" if f is None else f"{f:.{nd}f}"


def ratio(a, b, nd=2) -> str:
    a, b = num(a), num(b)
    return "–" if a is None or b is None or b == 0 else f"{a / b:.{nd}f}×"


def shapes(df) -> list:
    seen = []
    for P, mb in zip(df["P"], df["mb"]):
        if (int(P), int(mb)) not in seen:
            seen.append((int(P), int(mb)))
    return sorted(seen)


def get_row(df, method, P, mb, pass_="fwdbwd"):
    sel = df[(df["method"] == method) & (df["P"] == P) & (df["mb"] == mb) & (df["pass"] == pass_)]
    return None if sel.empty else sel.iloc[-1]


def ms(row) -> Optional[float]:
    if row is None or str(row.get("status", "ok")) != "ok":
        return None
    return num(row["ms_p50"])


def cell_ms(row) -> str:
    if row is None:
        return "–"
    st = str(row.get("status", "ok"))
    if st != "ok":
        return "OOM" if st == "OOM" else st.split(":")[0].split(" ")[0]
    return f"{float(row['ms_p50']):.1f}"


def cell_gb(row) -> str:
    if row is None or str(row.get("status", "ok")) != "ok":
        return "–" if row is None else cell_ms(row)
    return fmt(row.get("gb"), 1)


def commits(df) -> str:
    """``commit X`` for rows of one commit, else ``commits X, Y (per row: the commit column)``."""
    found = list(dict.fromkeys(str(c) for c in df["commit"].dropna())) if "commit" in df else []
    if len(found) <= 1:
        return f"commit {found[0] if found else '–'}"
    return f"commits {', '.join(found)} (per row: the commit column)"


def tick(ok: Optional[bool]) -> str:
    return "–" if ok is None else ("✓" if ok else "✗")


def config_key(r) -> tuple:
    """``(model, input, output, gpu_gb)`` of a ``decode`` row (``gpu_gb``: its memory cap in GiB, 0 = the whole
    device, also for rows written before the cap existed): rows under different caps are different configurations."""
    return (str(r["model"]), int(r["input"]), int(r["output"]), num(r.get("gpu_gb")) or 0.0)


def config_label(key: tuple) -> str:
    """The model cell of a configuration: ``llama-8b``, or ``llama-8b @79.1 GiB`` under a memory cap."""
    return f"{key[0]} @{key[3]:g} GiB" if key[3] else key[0]


def in_config(df, key: tuple):
    """Boolean mask of ``df``'s rows of the ``(model, input, output, gpu_gb)`` configuration ``key``."""
    import pandas as pd

    return pd.Series([config_key(r) == key for _, r in df.iterrows()], index=df.index, dtype=bool)
