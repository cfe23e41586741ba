"""Benchmark output of every suite: one long-format CSV (one row per method, op, mode/pass and shape: ``method``,
``op``, ``mode``, ``pass``, ``params``, ``ms_p20``/``ms_p50``/``ms_p80``, memory, ``device``, ``commit``, ``cmd``, plus
the suite's own columns), markdown tables (DualKV: ours next to the paper's and the H200 calibration, with ratios
and the FLOP floor; decode-ops: GB/s against the copy bandwidth and the HBM floor), a PNG plot, and the reproduce
command of each row.

``python -m kvtransform.bench.report results.csv [--md] [--plot out.png] [--repro]`` re-renders a committed CSV.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Iterable, List, Optional

from . import seed

COLUMNS = ["suite", "mode", "method", "op", "impl", "pass", "params", "P", "mb", "T", "T_packed", "T_replicated", "S",
           "batch", "budget", "ms_p20", "ms_p50", "ms_p80", "ms_mean", "iters", "gb", "bytes_gb", "gbps", "pct_copy",
           "pct_read", "tflops", "floor_ms", "check_rel_err", "check_vs", "status", "device", "commit", "torch",
           "dtype", "timestamp", "cmd"]
KEY = ["suite", "mode", "method", "pass", "params"]
_TEXT = ["suite", "mode", "method", "op", "impl", "pass", "params", "status", "device", "commit", "torch", "dtype",
         "timestamp", "cmd", "check_vs"]
LAYER_METHODS = ["dualkv", "flex", "flex_rebuild", "fa2", "pg", "reference", "dualkv_kernel", "dualkv_compiled",
                 "flex_compiled"]
THROUGHPUT_DENSE = ("hf_sdpa", "hf_static", "dense", "flashinfer")  # "best dense" of the decode suite
TARGETS = {"floor": 1.25, "flex": 1.2, "fa2": 3.5}  # issue 5: dualkv <= 1.25x floor, >= 1.2x flex, >= 3.5x fa2
COMPILED_TARGETS = {"floor": 1.35, "flex": 1.15}  # issue 14: dualkv_compiled <= 1.35x floor, >= 1.15x flex_compiled


def _num(x) -> Optional[float]:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _fmt(x, nd=1) -> str:
    f = _num(x)
    return "–" if f is None else f"{f:.{nd}f}"


def _ratio(a, b, nd=2) -> str:
    a, b = _num(a), _num(b)
    return "–" if a is None or b is None or b == 0 else f"{a / b:.{nd}f}×"


def row_line(r: dict) -> str:
    """One console line for a row: method, pass, shape, times, memory, status, and the reproduce command."""
    if r.get("suite") == "decode":
        what = {"run": lambda: (f"{r.get('requests')} requests  prefill {_fmt(r.get('prefill_s'), 2)} s  decode "
                                f"{_fmt(r.get('decode_s'), 1)} s  {_fmt(r.get('tokens_per_s'), 1)} tokens/s"),
                "step": lambda: (f"{r.get('requests')} requests  ctx {r.get('context')}  {_fmt(r.get('ms_p50'), 2)} "
                                 f"ms/step  floor {_fmt(r.get('floor_ms'), 2)} ms ({_fmt(r.get('x_floor'), 2)}×)"),
                "validate": lambda: (f"measured {_fmt(r.get('decode_s'), 2)} s  estimate {_fmt(r.get('estimate_s'), 2)}"
                                     f" s ({_fmt(100 * (_num(r.get('rel_err')) or 0), 1)} %)")}
        # a validation outside its tolerance still shows its numbers (the status says what failed)
        shown = r.get("status") == "ok" or (r.get("pass") == "validate" and r.get("rel_err") is not None)
        body = what[r["pass"]]() if shown and r.get("pass") in what else ""
        return f"{r['method']:<11} {r.get('pass', ''):<8} {r.get('params', '')}  {body}  {r.get('status')}"
    if r.get("P") is None or r.get("pass") in ("check", "check_tuned", "tune"):
        times = (f"p50 {r['ms_p50']:.4f} ms [{r['ms_p20']:.4f}, {r['ms_p80']:.4f}]" if _num(r.get("ms_p50")) is not None
                 else f"{_fmt(r.get('check_rel_err'), 2)} of bound" if r.get("pass", "").startswith("check") else "")
        return (f"{r['method']:<22} {r.get('op', '')} {r.get('mode', '')} {r.get('params', '')}  {times}  "
                f"{_fmt(r.get('gbps'), 0)} GB/s  {r.get('status', 'ok')}   # {r.get('cmd', '')}")
    if r.get("status", "ok") != "ok":
        return f"{r['method']:<13} {r.get('pass', ''):<6} P={r['P']} mb={r['mb']}  {r['status']}   # {r.get('cmd', '')}"
    return (f"{r['method']:<13} {r.get('pass', ''):<6} P={r['P']} mb={r['mb']} T={r['T']}  "
            f"p50 {r['ms_p50']:.2f} ms [{r['ms_p20']:.2f}, {r['ms_p80']:.2f}]  {_fmt(r.get('gb'), 2)} GB  "
            f"{_fmt(r.get('tflops'), 0)} TFLOP/s  floor {r['floor_ms']:.2f} ms  err {_num(r.get('check_rel_err')) or 0:.1e}"
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    df.to_csv(path, index=False)
    return df


def write_all(rows: List[dict], out_dir: str, append: bool = False, plot: bool = True) -> List[str]:
    """``results.csv``, ``results.md`` and (``plot``) ``results.png`` in ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "results.csv")
    df = write_csv(rows, csv_path, append=append)
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w") as f:
        f.write(markdown(df) + "\n")
    paths = [csv_path, md_path]
    if plot:
        png = os.path.join(out_dir, "results.png")
        if plot_png(df, png):
            paths.append(png)
    return paths


# ----------------------------------------------------------------------------------------------------------- markdown


def _shapes(df) -> list:
    seen = []
    for P, mb in zip(df["P"], df["mb"]):
        if (int(P), int(mb)) not in seen:
            seen.append((int(P), int(mb)))
    return sorted(seen)


def _get(df, method, P, mb, pass_="fwdbwd"):
    sel = df[(df["method"] == method) & (df["P"] == P) & (df["mb"] == mb) & (df["pass"] == pass_)]
    return None if sel.empty else sel.iloc[-1]


def _ms(row) -> Optional[float]:
    if row is None or str(row.get("status", "ok")) != "ok":
        return None
    return _num(row["ms_p50"])


def _cell_ms(row) -> str:
    if row is None:
        return "–"
    st = str(row.get("status", "ok"))
    if st != "ok":
        return "OOM" if st == "OOM" else st.split(":")[0].split(" ")[0]
    return f"{float(row['ms_p50']):.1f}"


def _cell_gb(row) -> str:
    if row is None or str(row.get("status", "ok")) != "ok":
        return "–" if row is None else _cell_ms(row)
    return _fmt(row.get("gb"), 1)


def _commits(df) -> str:
    """``commit X`` for rows of one commit, else ``commits X, Y (per row: the commit column)``."""
    commits = list(dict.fromkeys(str(c) for c in df["commit"].dropna())) if "commit" in df else []
    if len(commits) <= 1:
        return f"commit {commits[0] if commits else '–'}"
    return f"commits {', '.join(commits)} (per row: the commit column)"


def _tick(ok: Optional[bool]) -> str:
    return "–" if ok is None else ("✓" if ok else "✗")


def markdown_layer(df) -> str:
    df = df[df["mode"] == "layer"]
    if df.empty:
        return ""
    paper, calib = seed.table("paper_layer"), seed.table("h200_layer")
    first = df.iloc[0]
    out = [f"Device: {first['device']} · {_commits(df)} · torch {first['torch']} · {first['dtype']} · "
           f"median (p50) ms of fwd+bwd of one Qwen3-8B-shaped layer; paper = DualKV App. F.4 on an H100; "
           f"floor = useful FLOPs at {790} TFLOP/s.", ""]
    out += ["| P | mb | T packed | floor ms | dualkv ms | dualkv/floor | flex ms | flex/dualkv | flex rebuild ms | "
            "fa2 ms | fa2/dualkv | pg ms | pg/dualkv | paper dualkv | paper fa2 | paper pg | paper dualkv/ours |",
            "|" + "---|" * 17]
    mem = ["| P | mb | dualkv GB | paper dualkv GB | flex GB | flex rebuild GB | fa2 GB | pg GB | paper pg GB |",
           "|" + "---|" * 9]
    tgt = ["| P | mb | dualkv ≤ 1.25× floor | ≥ 1.2× faster than flex | ≥ 3.5× faster than fa2 | GB ≤ paper DualKV |",
           "|" + "---|" * 6]
    cal = ["| P | mb | fa2 ms (ours / calib) | flex ms (ours / calib) | fa2 GB (ours / calib) | flex GB (ours / calib) |",
           "|" + "---|" * 6]
    comp = ["| P | mb | floor ms | dualkv_compiled ms | /floor (≤ 1.35×) | flex_compiled ms | flex_compiled/dualkv_compiled "
            "(≥ 1.15×) | dualkv eager/compiled | flex eager/compiled | GB dualkv_compiled / flex_compiled |",
            "|" + "---|" * 10]
    for P, mb in _shapes(df):
        r = {m: _get(df, m, P, mb) for m in LAYER_METHODS}
        any_row = next(x for x in r.values() if x is not None)
        floor = _num(any_row["floor_ms"])
        d, fl, fa, pg = (_ms(r[m]) for m in ("dualkv", "flex", "fa2", "pg"))
        pp = paper.get((P, mb), {})
        out.append(f"| {P} | {mb} | {int(any_row['T_packed'])} | {_fmt(floor)} | {_cell_ms(r['dualkv'])} | "
                   f"{_ratio(d, floor)} | {_cell_ms(r['flex'])} | {_ratio(fl, d)} | {_cell_ms(r['flex_rebuild'])} | "
                   f"{_cell_ms(r['fa2'])} | {_ratio(fa, d)} | {_cell_ms(r['pg'])} | {_ratio(pg, d)} | "
                   f"{_fmt(pp.get('dualkv_ms'))} | {_fmt(pp.get('fa2_ms')) if pp else '–'} | "
                   f"{_fmt(pp.get('pg_ms')) if pp else '–'} | {_ratio(pp.get('dualkv_ms'), d)} |")
        dg = _num(r["dualkv"]["gb"]) if r["dualkv"] is not None and _ms(r["dualkv"]) is not None else None
        mem.append(f"| {P} | {mb} | {_cell_gb(r['dualkv'])} | {_fmt(pp.get('dualkv_gb'))} | {_cell_gb(r['flex'])} | "
                   f"{_cell_gb(r['flex_rebuild'])} | {_cell_gb(r['fa2'])} | {_cell_gb(r['pg'])} | {_fmt(pp.get('pg_gb'))} |")
        t_floor = None if d is None or floor is None else d <= TARGETS["floor"] * floor
        t_flex = None if d is None or fl is None else fl >= TARGETS["flex"] * d
        t_fa2 = None if d is None or fa is None else fa >= TARGETS["fa2"] * d
        t_mem = None if dg is None or pp.get("dualkv_gb") is None else dg <= pp["dualkv_gb"]
        tgt.append(f"| {P} | {mb} | {_tick(t_floor)} {_ratio(d, floor)} | {_tick(t_flex)} {_ratio(fl, d)} | "
                   f"{_tick(t_fa2)} {_ratio(fa, d)} | {_tick(t_mem)} {_fmt(dg)} / {_fmt(pp.get('dualkv_gb'))} |")
        dc, fc = _ms(r["dualkv_compiled"]), _ms(r["flex_compiled"])
        if r["dualkv_compiled"] is not None or r["flex_compiled"] is not None:
            tf = None if dc is None or floor is None else dc <= COMPILED_TARGETS["floor"] * floor
            tx = None if dc is None or fc is None else fc >= COMPILED_TARGETS["flex"] * dc
            comp.append(f"| {P} | {mb} | {_fmt(floor)} | {_cell_ms(r['dualkv_compiled'])} | {_tick(tf)} "
                        f"{_ratio(dc, floor)} | {_cell_ms(r['flex_compiled'])} | {_tick(tx)} {_ratio(fc, dc)} | "
                        f"{_ratio(d, dc)} | {_ratio(fl, fc)} | {_cell_gb(r['dualkv_compiled'])} / "
                        f"{_cell_gb(r['flex_compiled'])} |")
        c = calib.get((P, mb))
        if c:
            cal.append(f"| {P} | {mb} | {_cell_ms(r['fa2'])} / {_fmt(c['fa2_ms'])} | {_cell_ms(r['flex'])} / "
                       f"{_fmt(c['flex_ms'])} | {_cell_gb(r['fa2'])} / {_fmt(c['fa2_gb'])} | {_cell_gb(r['flex'])} / "
                       f"{_fmt(c['flex_gb'])} |")
    out += ["", "Peak memory (GiB, torch.cuda.max_memory_allocated):", ""] + mem
    out += ["", "Targets of issue 5 (✓ met, ✗ missed, – not measured):", ""] + tgt
    if len(comp) > 2:
        out += ["", "Whole layer under torch.compile (issue 14 targets; ✓ met, ✗ missed, – not measured):", ""] + comp
    if len(cal) > 2:
        out += ["", "Harness check against ../shared/seed_tables/h200_calibration.csv (same H200 setup):", ""] + cal
    bad = df[df["status"] != "ok"]
    if not bad.empty:
        groups = {}
        for m, P, mb, st in zip(bad["method"], bad["P"], bad["mb"], bad["status"]):
            groups.setdefault((m, st), []).append(f"{P}/{mb}")
        out += ["", "Not measured (method, status: P/mb):"]
        out += [f"- {m}, {st}: {', '.join(v)}" for (m, st), v in groups.items()]
    return "\n".join(out)


def markdown_attn(df) -> str:
    df = df[df["mode"] == "attn"]
    if df.empty:
        return ""
    calib = seed.table("h200_attn")
    first = df.iloc[0]
    out = [f"Device: {first['device']} · {_commits(df)} · torch {first['torch']} · {first['dtype']} · "
           "attention op alone, H=32, H_kv=8, D=128 unless overridden; useful TFLOP/s = 4·D·H·visible pairs "
           "(×2.5 backward) over p50.", "",
           "| P | N | T | method | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | vs flex (fwd+bwd) | GB | "
           "calib flex fwd / bwd TFLOP/s |", "|" + "---|" * 12]
    for P, mb in _shapes(df):
        flex = _ms(_get(df, "flex", P, mb, "fwdbwd"))
        c = calib.get((P, mb))
        for m in [m for m in LAYER_METHODS if _get(df, m, P, mb, "fwdbwd") is not None]:
            f, b, t = (_get(df, m, P, mb, p) for p in ("fwd", "bwd", "fwdbwd"))
            ok = _ms(t) is not None
            out.append(f"| {P} | {mb} | {int(t['T'])} | {m} | {_cell_ms(f)} | {_fmt(f['tflops'], 0) if ok else '–'} | "
                       f"{_cell_ms(b)} | {_fmt(b['tflops'], 0) if ok else '–'} | {_cell_ms(t)} | "
                       f"{_ratio(flex, _ms(t))} | {_cell_gb(t)} | "
                       f"{(str(c['flex_fwd_tflops']) + ' / ' + str(c['flex_bwd_tflops'])) if c else '–'} |")
    return "\n".join(out)


def markdown_decode(df) -> str:
    """The ``decode-ops`` table: per S, every op's p50, GB/s, % of the copy / read bandwidth and the HBM floor."""
    df = df[df["suite"] == "decode-ops"]
    if df.empty:
        return ""
    first = df.iloc[0]
    bw = df[df["op"] == "memcpy"]
    bws = ", ".join(f"{m} {_fmt(g, 0)} GB/s (S={s})" for m, g, s in zip(bw["method"], bw["gbps"], bw["S"]))
    out = [f"Device: {first['device']} · {_commits(df)} · torch {first['torch']} · {first['dtype']} · "
           f"p50 (CUDA-graph replays on CUDA); bandwidth measured in the same run: {bws or '–'}; floor = bytes / copy "
           "bandwidth.", "",
           "| S | method | op | mode | p50 ms | p20–p80 ms | GB/s | % copy | % read | floor ms | p50/floor | status |",
           "|" + "---|" * 12]
    rows = df[~df["pass"].isin(["tune", "check", "check_tuned"]) & (df["op"] != "memcpy")]
    for _, r in rows.sort_values("S", kind="stable").iterrows():
        ok = str(r["status"]) == "ok"
        out.append(f"| {int(r['S'])} | {r['method']} | {r['op']} | {r['mode']} | {_fmt(r['ms_p50'], 4) if ok else '–'} | "
                   f"{_fmt(r['ms_p20'], 4)}–{_fmt(r['ms_p80'], 4)} | {_fmt(r.get('gbps'), 0)} | "
                   f"{_fmt(r.get('pct_copy'), 1)} | {_fmt(r.get('pct_read'), 1)} | {_fmt(r.get('floor_ms'), 4)} | "
                   f"{_ratio(r['ms_p50'], r.get('floor_ms'))} | {r['status']} |")
    checks = df[df["pass"].isin(["check", "check_tuned"])]
    if not checks.empty:
        out += ["", "Kernel checks: " + "; ".join(f"{m} {i}: {st} (worst {_fmt(e, 2)} of bound)" for m, i, st, e in
                                                   zip(checks["method"], checks["impl"], checks["status"],
                                                       checks["check_rel_err"]))]
    return "\n".join(out)


def _config_key(r) -> tuple:
    return (str(r["model"]), int(r["input"]), int(r["output"]))


def _in_config(df, key: tuple):
    """Boolean mask of ``df``'s rows of the ``(model, input, output)`` configuration ``key``."""
    import pandas as pd

    return pd.Series([_config_key(r) == key for _, r in df.iterrows()], index=df.index, dtype=bool)


def markdown_throughput(df) -> str:
    """The ``decode`` tables: per model and ``[input, output]`` every method's end-to-end tokens/s (requests,
    prefill and decode seconds) beside the paper's A800 number, the ratio to the best dense method
    (:data:`THROUGHPUT_DENSE`) measured in the same CSV, and the worst sampled step against its HBM floor; then
    every sampled step; then the validation rows."""
    df = df[df["suite"] == "decode"].copy()
    if df.empty:
        return ""
    for col in ("requests", "tokens_per_s", "prefill_s", "decode_s", "ms_per_step_mean", "paper_tokens_per_s",
                "paper_requests", "context", "ms_p50", "floor_ms", "x_floor", "bytes_gb", "gbps", "copy_gbps",
                "estimate_s", "rel_err"):
        if col not in df.columns:  # a job whose every method was skipped or failed has none of these
            df[col] = None
    first = df.iloc[0]
    runs, steps, val = (df[df["pass"] == p] for p in ("run", "step", "validate"))
    bws = sorted({round(float(g)) for g in steps["copy_gbps"].dropna()}) if "copy_gbps" in steps else []
    out = [f"Device: {first['device']} · {_commits(df)} · torch {first['torch']} · {first['dtype']} · "
           f"budget {first['budget']} · decode time = sum over all steps of the step time interpolated between the "
           f"sampled contexts; floor = (weights + KV/retrieval bytes the step must read) / copy bandwidth "
           f"({'–' if not bws else bws[0] if len(bws) == 1 else f'{bws[0]}–{bws[-1]}'} GB/s, measured in each row's "
           f"run); paper = SpeContext Table 5 on one A800.", "",
           "| model | input | output | method | requests | prefill s | decode s | tokens/s | vs best dense | "
           "paper tokens/s (requests) | vs paper | mean ms/step | worst step / floor | status | commit |",
           "|" + "---|" * 15]
    for key in dict.fromkeys(_config_key(r) for _, r in runs.iterrows()):
        sel = runs[_in_config(runs, key)]
        dense = sel[sel["method"].isin(THROUGHPUT_DENSE) & (sel["status"] == "ok")]["tokens_per_s"]
        best = dense.astype(float).max() if not dense.empty else None
        for _, r in sel.iterrows():
            r["vs_best_dense"] = float(r["tokens_per_s"]) / best if best and str(r["status"]) == "ok" else None
            st = steps[(steps["method"] == r["method"]) & _in_config(steps, key)]
            if "commit" in st.columns:  # a CSV gathering several runs: this row's own steps
                st = st[st["commit"].astype(str) == str(r.get("commit"))]
            if "params" in st.columns and isinstance(r.get("params"), str):
                st = st[st["params"].astype(str).str.startswith(r["params"] + " context=")]
            worst = st["x_floor"].max() if not st.empty else None
            ok = str(r["status"]) == "ok"
            paper = (f"{_fmt(r.get('paper_tokens_per_s'), 1)} ({int(r['paper_requests'])})"
                     if _num(r.get("paper_tokens_per_s")) is not None else "–")
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | {r['method']} | "
                       f"{int(r['requests']) if _num(r.get('requests')) is not None else '–'} | "
                       f"{_fmt(r.get('prefill_s'), 2)} | {_fmt(r.get('decode_s'), 1)} | "
                       f"{_fmt(r.get('tokens_per_s'), 1) if ok else '–'} | "
                       f"{_fmt(r.get('vs_best_dense'), 2) + '×' if ok and _num(r.get('vs_best_dense')) else '–'} | "
                       f"{paper} | {_ratio(r.get('tokens_per_s'), r.get('paper_tokens_per_s')) if ok else '–'} | "
                       f"{_fmt(r.get('ms_per_step_mean'), 2)} | {_fmt(worst, 2) + '×' if _num(worst) else '–'} | "
                       f"{r['status']} | {r.get('commit', '–')} |")
    if not steps.empty:
        out += ["", "| model | input | output | method | requests | context | ms/step | floor ms | × floor | GB read | "
                    "GB/s |", "|" + "---|" * 11]
        for _, r in steps.iterrows():
            out.append(f"| {r['model']} | {int(r['input'])} | {int(r['output'])} | {r['method']} | {int(r['requests'])} "
                       f"| {int(r['context'])} | {_fmt(r['ms_p50'], 2)} | {_fmt(r['floor_ms'], 2)} | "
                       f"{_fmt(r['x_floor'], 2)} | {_fmt(r['bytes_gb'], 1)} | {_fmt(r.get('gbps'), 0)} |")
    if not val.empty:
        out += ["", "Validation (a whole generation against the sampled estimate): " + "; ".join(
            f"{r['model']} [{int(r['input'])}, {int(r['output'])}] {r['method']}: measured {_fmt(r['decode_s'], 2)} s, "
            f"estimate {_fmt(r['estimate_s'], 2)} s ({100 * float(r['rel_err']):+.1f} %"
            f"{'' if str(r['status']) == 'ok' else ', ' + str(r['status']).split(':')[0]})" for _, r in val.iterrows())]
    return "\n".join(out)


def markdown(df) -> str:
    """All tables for the suites and modes present in ``df`` (a DataFrame of the long CSV)."""
    dk = df[~df["suite"].isin(["decode-ops", "decode"])] if "suite" in df.columns else df
    dk = dk[~dk["pass"].isin(["tune", "check", "check_tuned"])]
    parts = [p for p in (markdown_layer(dk), markdown_attn(dk), markdown_decode(df), markdown_throughput(df)) if p]
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------------------------- plot


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
            t = _num(sel.iloc[-1].get(tick))
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
    keys = list(dict.fromkeys(_config_key(r) for _, r in runs.iterrows()))
    methods = list(dict.fromkeys(runs["method"]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(min(20, 6 + 1.2 * len(keys) * max(1, len(methods)) / 3), 5))
    _grouped_bars(ax, runs, methods, keys, _in_config, "tokens_per_s",
                  "paper_tokens_per_s")
    ax.set_xticklabels([f"{k[0]}\n[{k[1]}, {k[2]}]" for k in keys], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s end to end (log); black = paper (A800)")
    ax.legend(fontsize=7)
    for j, m in enumerate(methods):
        labelled = False  # one legend entry per method, on its first configuration with steps
        for key in keys:
            sel = steps[(steps["method"] == m) & _in_config(steps, key)]
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
    shapes = _shapes(df)
    methods = [m for m in LAYER_METHODS if (df["method"] == m).any()]
    fig, ax = plt.subplots(figsize=(min(18, max(6, 0.25 * len(shapes) * max(1, len(methods)) + 2)), 5))
    w = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        xs, ys = [], []
        for i, (P, mb) in enumerate(shapes):
            y = _ms(_get(df, m, P, mb))
            if y is not None:
                xs.append(i - 0.4 + w * (j + 0.5))
                ys.append(y)
        ax.bar(xs, ys, w, label=m)
    for i, (P, mb) in enumerate(shapes):
        sel = df[(df["P"] == P) & (df["mb"] == mb)]
        floor = _num(sel.iloc[0]["floor_ms"])
        if floor:
            ax.hlines(floor, i - 0.45, i + 0.45, colors="black", linewidth=2, label="FLOP floor" if i == 0 else None)
        pd_ms = paper.get((P, mb), {}).get("dualkv_ms")
        if pd_ms and (sel["mode"] == "layer").any():
            ax.hlines(pd_ms, i - 0.45, i + 0.45, colors="red", linestyles="dashed", linewidth=1.5,
                      label="paper DualKV (H100)" if not any(l.get_label() == "paper DualKV (H100)" for l in ax.collections) else None)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"P={P}\nmb={mb}" for P, mb in shapes], fontsize=8)
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
        plot_png(df, a.plot)
    if a.md or not (a.repro or a.plot):
        print(markdown(df))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
