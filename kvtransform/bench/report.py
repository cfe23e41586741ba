"""Benchmark output of every suite (the CSV and console lines here; tables in :mod:`.report_markdown`, the plot in
:mod:`.report_plot`): one long-format CSV (one row per method, op, mode/pass and shape: ``method``,
``op``, ``mode``, ``pass``, ``params``, ``ms_p20``/``ms_p50``/``ms_p80``, memory, ``device``, ``commit``, ``cmd``, plus
the suite's own columns), markdown tables (DualKV: ours next to the paper's and the H200 calibration, with ratios
and the FLOP floor; decode-ops: GB/s against the copy bandwidth and the HBM floor), a PNG plot, and the reproduce
command of each row.

``python -m kvtransform.bench.report results.csv [--md] [--plot out.png] [--repro]`` re-renders a committed CSV.
"""
from __future__ import annotations

import argparse
import os
from typing import Iterable, List

from .report_markdown import markdown
from .report_plot import plot_png
from .report_rows import fmt, num
from .report_tree import TREE_SUITES, plot_tree
from ..utils import atomic_write

COLUMNS = ["suite", "mode", "method", "op", "impl", "pass", "params", "P", "mb", "T", "T_packed", "T_replicated", "S",
           "batch", "budget", "ms_p20", "ms_p50", "ms_p80", "ms_mean", "iters", "gb", "bytes_gb", "gbps", "pct_copy",
           "pct_read", "tflops", "floor_ms", "check_rel_err", "check_vs", "status", "device", "commit", "torch",
           "dtype", "timestamp", "cmd"]
KEY = ["suite", "mode", "method", "pass", "params"]
#: counts that a column of mixed rows (NaN where a row has none) would otherwise write as floats ("12.0")
_COUNTS = ["P", "mb", "T", "T_packed", "T_replicated", "S", "batch", "budget", "iters", "requests", "context", "input",
           "output", "prefill_group", "paper_requests", "offloaded_layers"]
_TEXT = ["suite", "mode", "method", "op", "impl", "pass", "params", "status", "device", "commit", "torch", "dtype",
         "timestamp", "cmd", "check_vs"]


def plot_any(df, path: str) -> bool:
    """The PNG of the long CSV: :func:`.report_tree.plot_tree` for the prefix-tree suites, else
    :func:`.report_plot.plot_png`. False when nothing was measured."""
    if "suite" in df.columns and df["suite"].isin(TREE_SUITES).any():
        return plot_tree(df, path)
    return plot_png(df, path)


def _tree_line(r: dict) -> str:
    head = f"{r['method']:<18} {r.get('pass', ''):<6} {r.get('params', '')} T={r.get('T')}"
    if r.get("status", "ok") != "ok" or num(r.get("ms_p50")) is None:
        detail = f"{fmt(r.get('check_rel_err'), 2)} of bound  " if str(r.get("pass", "")).startswith("check") else ""
        return f"{head}  {detail}{r.get('status')}   # {r.get('cmd', '')}"
    return (f"{head}  p50 {r['ms_p50']:.2f} ms [{r['ms_p20']:.2f}, {r['ms_p80']:.2f}]  {fmt(r.get('gb'), 2)} GB  "
            f"{fmt(r.get('tflops'), 0)} TFLOP/s  floor {fmt(r.get('floor_ms'), 2)} ms  "
            f"err {num(r.get('check_rel_err')) or 0:.1e}  {r.get('impl', '')}   # {r.get('cmd', '')}")


def row_line(r: dict) -> str:
    """One console line for a row: method, pass, shape, times, memory, status, and the reproduce command."""
    if r.get("suite") in TREE_SUITES:
        return _tree_line(r)
    if r.get("suite") == "decode":
        what = {"run": lambda: (f"{r.get('requests')} requests  prefill {fmt(r.get('prefill_s'), 2)} s  decode "
                                f"{fmt(r.get('decode_s'), 1)} s  {fmt(r.get('tokens_per_s'), 1)} tokens/s"),
                "step": lambda: (f"{r.get('requests')} requests  ctx {r.get('context')}  {fmt(r.get('ms_p50'), 2)} "
                                 f"ms/step  floor {fmt(r.get('floor_ms'), 2)} ms ({fmt(r.get('x_floor'), 2)}×)"),
                "validate": lambda: (f"measured {fmt(r.get('decode_s'), 2)} s  estimate {fmt(r.get('estimate_s'), 2)}"
                                     f" s ({fmt(100 * (num(r.get('rel_err')) or 0), 1)} %)")}
        # a validation outside its tolerance still shows its numbers (the status says what failed)
        shown = r.get("status") == "ok" or (r.get("pass") == "validate" and r.get("rel_err") is not None)
        body = what[r["pass"]]() if shown and r.get("pass") in what else ""
        return f"{r['method']:<11} {r.get('pass', ''):<8} {r.get('params', '')}  {body}  {r.get('status')}"
    if r.get("P") is None or r.get("pass") in ("check", "check_tuned", "tune"):
        times = (f"p50 {r['ms_p50']:.4f} ms [{r['ms_p20']:.4f}, {r['ms_p80']:.4f}]" if num(r.get("ms_p50")) is not None
                 else f"{fmt(r.get('check_rel_err'), 2)} of bound" if r.get("pass", "").startswith("check") else "")
        return (f"{r['method']:<22} {r.get('op', '')} {r.get('mode', '')} {r.get('params', '')}  {times}  "
                f"{fmt(r.get('gbps'), 0)} GB/s  {r.get('status', 'ok')}   # {r.get('cmd', '')}")
    if r.get("status", "ok") != "ok":
        return f"{r['method']:<13} {r.get('pass', ''):<6} P={r['P']} mb={r['mb']}  {r['status']}   # {r.get('cmd', '')}"
    return (f"{r['method']:<13} {r.get('pass', ''):<6} P={r['P']} mb={r['mb']} T={r['T']}  "
            f"p50 {r['ms_p50']:.2f} ms [{r['ms_p20']:.2f}, {r['ms_p80']:.2f}]  {fmt(r.get('gb'), 2)} GB  "
            f"{fmt(r.get('tflops'), 0)} TFLOP/s  floor {fmt(r.get('floor_ms'), 2)} ms  err {num(r.get('check_rel_err')) or 0:.1e}"
            f"   # {r.get('cmd', '')}")


def save_rows(rows: List[dict], filename: str, fmt=str) -> tuple:
    """For check scripts (``tools/*_check.py``): ``rows`` (dicts; the union of their keys, in first-seen order, are the
    columns) as a markdown table (cells through ``fmt``; a missing cell is empty) and as ``filename`` (CSV) in
    ``$OUT`` when set, else the current directory. Returns ``(markdown, csv_path)``."""
    import csv
    import os

    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) if c in r else "" for c in cols) + " |" for r in rows]
    path = os.path.join(os.environ.get("OUT", "."), filename)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return "\n".join(lines), path


# ---------------------------------------------------------------------------------------------------------------- CSV


def read_csv(path: str):
    """The long CSV as a DataFrame (text columns as str). Rows of an older DualKV CSV without ``op``/``params`` get
    them (``params = "P=.. mb=.."``), so a rerun row replaces its old twin."""
    import pandas as pd

    df = pd.read_csv(path, dtype={c: str for c in _TEXT}, keep_default_na=False, na_values=[""])
    if "P" in df.columns:
        for col, fill in (("params", lambda r: f"P={int(r['P'])} mb={int(r['mb'])}"),
                          ("op", lambda r: {"layer": "decoder_layer", "attn": "dualkv_attention"}.get(r["mode"]))):
            if col not in df.columns:
                df[col] = None
            old = df[col].isna() & df["P"].notna()
            if old.any():
                df.loc[old, col] = df[old].apply(fill, axis=1)
    return df


def write_csv(rows: List[dict], path: str, append: bool = False):
    """Write (or merge into, with ``append``: a rerun row replaces the old one with the same key) the long CSV."""
    import pandas as pd

    df = pd.DataFrame(rows)
    if not df.empty:  # a rerun row replaces the earlier one with the same key
        df = df.drop_duplicates(subset=[k for k in KEY if k in df.columns], keep="last").reset_index(drop=True)
    for c in COLUMNS:
        if c not in df.columns:
            df[c] = None
    df = df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]
    if append and os.path.exists(path):
        old = read_csv(path)
        df = pd.concat([old, df], ignore_index=True)
        df = df.drop_duplicates(subset=KEY, keep="last").reset_index(drop=True)
    for c in _COUNTS:  # whole numbers stay whole in the file (pandas' nullable integers keep the gaps empty)
        if c not in df.columns or pd.api.types.is_integer_dtype(df[c]):
            continue
        try:
            col = pd.to_numeric(df[c])
        except (TypeError, ValueError):  # not all numbers: written as they are
            continue
        v = col.dropna()
        if len(v) and (v == v.round()).all() and v.abs().max() < 2 ** 53:
            df[c] = col.astype("Int64")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path) as tmp:  # a run killed while writing leaves the earlier file whole
        df.to_csv(tmp, index=False)
    return df


def write_all(rows: List[dict], out_dir: str, append: bool = False, plot: bool = True) -> List[str]:
    """``results.csv``, ``results.md`` and (``plot``) ``results.png`` in ``out_dir``; returns their paths. Each file
    is written atomically (:func:`kvtransform.utils.atomic_write`): a run killed meanwhile leaves the earlier one;
    a run without a plot (``plot`` false, or nothing measured) removes an earlier ``results.png`` (it showed rows the
    CSV no longer holds)."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "results.csv")
    df = write_csv(rows, csv_path, append=append)
    md_path = os.path.join(out_dir, "results.md")
    with atomic_write(md_path) as tmp:
        tmp.write_text(markdown(df) + "\n")
    paths = [csv_path, md_path]
    png = os.path.join(out_dir, "results.png")
    drawn = False
    if plot:
        with atomic_write(png) as tmp:
            drawn = plot_any(df, str(tmp))
    if drawn:
        paths.append(png)
    elif os.path.exists(png):
        os.remove(png)
    return paths


def repro_lines(df) -> Iterable[str]:
    for _, r in df.iterrows():
        yield f"{r['method']:<13} {r['params']} {r['pass']}: {r['cmd']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtransform.bench.report", description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--md", action="store_true", help="print the markdown tables")
    ap.add_argument("--plot", metavar="PNG", help="write the plot")
    ap.add_argument("--repro", action="store_true", help="print each row's reproduce command")
    a = ap.parse_args(argv)
    df = read_csv(a.csv)
    if a.repro:
        print("\n".join(repro_lines(df)))
    if a.plot:
        plot_any(df, a.plot)
    if a.md or not (a.repro or a.plot):
        print(markdown(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
