"""Markdown tables of the long benchmark CSV, one per suite: DualKV layer (ours next to the paper's and the H200
calibration, with ratios, the FLOP floor and the targets), DualKV attention op, ``decode-ops`` (GB/s against the copy
bandwidth and the HBM floor) and ``decode`` (end-to-end tokens/s beside SpeContext Table 5); the prefix-tree suites'
table is in :mod:`.report_tree`."""
from __future__ import annotations

from . import seed
from .report_rows import (LAYER_METHODS, THROUGHPUT_DENSE, cell_gb, cell_ms, commits, config_key, config_label, fmt,
                          get_row, in_config, ms, num, ratio, shapes, tick)
from .report_tree import TREE_SUITES, markdown_tree

__all__ = ["TARGETS", "COMPILED_TARGETS", "markdown", "markdown_layer", "markdown_attn", "markdown_decode",
           "markdown_throughput"]

# Targets of the DualKV layer suite (BENCHMARKS.md, "DualKV layer"; DualKV arXiv 2605.15422 App. F.4 setup): dualkv
# <= 1.25x the FLOP floor, >= 1.2x faster than flex, >= 3.5x faster than fa2; under torch.compile dualkv_compiled
# <= 1.35x the floor and >= 1.15x faster than flex_compiled.
TARGETS = {"floor": 1.25, "flex": 1.2, "fa2": 3.5}
COMPILED_TARGETS = {"floor": 1.35, "flex": 1.15}


def markdown_layer(df) -> str:
    df = df[df["mode"] == "layer"]
    if df.empty:
        return ""
    paper, calib = seed.table("paper_layer"), seed.table("h200_layer")
    first = df.iloc[0]
    out = [f"Device: {first['device']} · {commits(df)} · torch {first['torch']} · {first['dtype']} · "
           f"median (p50) ms of fwd+bwd of one decoder layer (Qwen3-8B-shaped unless the row's command sets hidden, "
           f"heads, ...); paper = DualKV App. F.4 on an H100; floor = useful FLOPs at {790} TFLOP/s (GPU rows only).",
           ""]
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
    for P, mb in shapes(df):
        r = {m: get_row(df, m, P, mb) for m in LAYER_METHODS}
        any_row = next(x for x in r.values() if x is not None)
        floor = num(any_row["floor_ms"])
        d, fl, fa, pg = (ms(r[m]) for m in ("dualkv", "flex", "fa2", "pg"))
        pp = paper.get((P, mb), {})
        out.append(f"| {P} | {mb} | {int(any_row['T_packed'])} | {fmt(floor)} | {cell_ms(r['dualkv'])} | "
                   f"{ratio(d, floor)} | {cell_ms(r['flex'])} | {ratio(fl, d)} | {cell_ms(r['flex_rebuild'])} | "
                   f"{cell_ms(r['fa2'])} | {ratio(fa, d)} | {cell_ms(r['pg'])} | {ratio(pg, d)} | "
                   f"{fmt(pp.get('dualkv_ms'))} | {fmt(pp.get('fa2_ms')) if pp else '–'} | "
                   f"{fmt(pp.get('pg_ms')) if pp else '–'} | {ratio(pp.get('dualkv_ms'), d)} |")
        dg = num(r["dualkv"]["gb"]) if r["dualkv"] is not None and ms(r["dualkv"]) is not None else None
        mem.append(f"| {P} | {mb} | {cell_gb(r['dualkv'])} | {fmt(pp.get('dualkv_gb'))} | {cell_gb(r['flex'])} | "
                   f"{cell_gb(r['flex_rebuild'])} | {cell_gb(r['fa2'])} | {cell_gb(r['pg'])} | {fmt(pp.get('pg_gb'))} |")
        t_floor = None if d is None or floor is None else d <= TARGETS["floor"] * floor
        t_flex = None if d is None or fl is None else fl >= TARGETS["flex"] * d
        t_fa2 = None if d is None or fa is None else fa >= TARGETS["fa2"] * d
        t_mem = None if dg is None or pp.get("dualkv_gb") is None else dg <= pp["dualkv_gb"]
        tgt.append(f"| {P} | {mb} | {tick(t_floor)} {ratio(d, floor)} | {tick(t_flex)} {ratio(fl, d)} | "
                   f"{tick(t_fa2)} {ratio(fa, d)} | {tick(t_mem)} {fmt(dg)} / {fmt(pp.get('dualkv_gb'))} |")
        dc, fc = ms(r["dualkv_compiled"]), ms(r["flex_compiled"])
        if r["dualkv_compiled"] is not None or r["flex_compiled"] is not None:
            tf = None if dc is None or floor is None else dc <= COMPILED_TARGETS["floor"] * floor
            tx = None if dc is None or fc is None else fc >= COMPILED_TARGETS["flex"] * dc
            comp.append(f"| {P} | {mb} | {fmt(floor)} | {cell_ms(r['dualkv_compiled'])} | {tick(tf)} "
                        f"{ratio(dc, floor)} | {cell_ms(r['flex_compiled'])} | {tick(tx)} {ratio(fc, dc)} | "
                        f"{ratio(d, dc)} | {ratio(fl, fc)} | {cell_gb(r['dualkv_compiled'])} / "
                        f"{cell_gb(r['flex_compiled'])} |")
        c = calib.get((P, mb))
        if c:
            cal.append(f"| {P} | {mb} | {cell_ms(r['fa2'])} / {fmt(c['fa2_ms'])} | {cell_ms(r['flex'])} / "
                       f"{fmt(c['flex_ms'])} | {cell_gb(r['fa2'])} / {fmt(c['fa2_gb'])} | {cell_gb(r['flex'])} / "
                       f"{fmt(c['flex_gb'])} |")
    out += ["", "Peak memory (GiB, torch.cuda.max_memory_allocated):", ""] + mem
    out += ["", f"Targets (dualkv ≤ {TARGETS['floor']}× floor, ≥ {TARGETS['flex']}× faster than flex, ≥ "
                f"{TARGETS['fa2']}× faster than fa2; ✓ met, ✗ missed, – not measured):", ""] + tgt
    if len(comp) > 2:
        out += ["", f"Whole layer under torch.compile (targets ≤ {COMPILED_TARGETS['floor']}× floor, ≥ "
                    f"{COMPILED_TARGETS['flex']}× faster than flex_compiled; ✓ met, ✗ missed, – not measured):",
                ""] + comp
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
    out = [f"Device: {first['device']} · {commits(df)} · torch {first['torch']} · {first['dtype']} · "
           "attention op alone, H=32, H_kv=8, D=128 unless overridden; useful TFLOP/s = 4·D·H·visible pairs "
           "(×2.5 backward) over p50.", "",
           "| P | N | T | method | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | vs flex (fwd+bwd) | GB | "
           "calib flex fwd / bwd TFLOP/s |", "|" + "---|" * 12]
    for P, mb in shapes(df):
        flex = ms(get_row(df, "flex", P, mb, "fwdbwd"))
        c = calib.get((P, mb))
        for m in [m for m in LAYER_METHODS if get_row(df, m, P, mb, "fwdbwd") is not None]:
            f, b, t = (get_row(df, m, P, mb, p) for p in ("fwd", "bwd", "fwdbwd"))
            ok = ms(t) is not None
            out.append(f"| {P} | {mb} | {int(t['T'])} | {m} | {cell_ms(f)} | {fmt(f['tflops'], 0) if ok else '–'} | "
                       f"{cell_ms(b)} | {fmt(b['tflops'], 0) if ok else '–'} | {cell_ms(t)} | "
                       f"{ratio(flex, ms(t))} | {cell_gb(t)} | "
                       f"{(str(c['flex_fwd_tflops']) + ' / ' + str(c['flex_bwd_tflops'])) if c else '–'} |")
    return "\n".join(out)


def markdown_decode(df) -> str:
    """The ``decode-ops`` table: per S, every op's p50, GB/s, % of the copy / read bandwidth and the HBM floor."""
    df = df[df["suite"] == "decode-ops"]
    if df.empty:
        return ""
    first = df.iloc[0]
    bw = df[df["op"] == "memcpy"]
    bws = ", ".join(f"{m} {fmt(g, 0)} GB/s (S={s})" for m, g, s in zip(bw["method"], bw["gbps"], bw["S"]))
    out = [f"Device: {first['device']} · {commits(df)} · torch {first['torch']} · {first['dtype']} · "
           f"p50 (CUDA-graph replays on CUDA); bandwidth measured in the same run: {bws or '–'}; floor = bytes / copy "
           "bandwidth.", "",
           "| S | method | op | mode | p50 ms | p20–p80 ms | GB/s | % copy | % read | floor ms | p50/floor | status |",
           "|" + "---|" * 12]
    rows = df[~df["pass"].isin(["tune", "check", "check_tuned"]) & (df["op"] != "memcpy")]
    for _, r in rows.sort_values("S", kind="stable").iterrows():
        ok = str(r["status"]) == "ok"
        out.append(f"| {int(r['S'])} | {r['method']} | {r['op']} | {r['mode']} | {fmt(r['ms_p50'], 4) if ok else '–'} | "
                   f"{fmt(r['ms_p20'], 4)}–{fmt(r['ms_p80'], 4)} | {fmt(r.get('gbps'), 0)} | "
                   f"{fmt(r.get('pct_copy'), 1)} | {fmt(r.get('pct_read'), 1)} | {fmt(r.get('floor_ms'), 4)} | "
                   f"{ratio(r['ms_p50'], r.get('floor_ms'))} | {r['status']} |")
    checks = df[df["pass"].isin(["check", "check_tuned"])]
    if not checks.empty:
        out += ["", "Kernel checks: " + "; ".join(f"{m} {i}: {st} (worst {fmt(e, 2)} of bound)" for m, i, st, e in
                                                   zip(checks["method"], checks["impl"], checks["status"],
                                                       checks["check_rel_err"]))]
    return "\n".join(out)


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
    out = [f"Device: {first['device']} · {commits(df)} · torch {first['torch']} · {first['dtype']} · "
           f"budget {first['budget']} · decode time = sum over all steps of the step time interpolated between the "
           f"sampled contexts; floor = (weights + KV/retrieval bytes the step must read) / copy bandwidth "
           f"({'–' if not bws else bws[0] if len(bws) == 1 else f'{bws[0]}–{bws[-1]}'} GB/s, measured in each row's "
           f"run); paper = SpeContext Table 5 on one A800.", "",
           "| model | input | output | method | requests | prefill s | decode s | tokens/s | vs best dense | "
           "paper tokens/s (requests) | vs paper | mean ms/step | worst step / floor | status | commit |",
           "|" + "---|" * 15]
    for key in dict.fromkeys(config_key(r) for _, r in runs.iterrows()):
        sel = runs[in_config(runs, key)]
        dense = sel[sel["method"].isin(THROUGHPUT_DENSE) & (sel["status"] == "ok")]["tokens_per_s"]
        best = dense.astype(float).max() if not dense.empty else None
        for _, r in sel.iterrows():
            r["vs_best_dense"] = float(r["tokens_per_s"]) / best if best and str(r["status"]) == "ok" else None
            st = steps[(steps["method"] == r["method"]) & in_config(steps, key)]
            if "commit" in st.columns:  # a CSV gathering several runs: this row's own steps
                st = st[st["commit"].astype(str) == str(r.get("commit"))]
            if "params" in st.columns and isinstance(r.get("params"), str):
                st = st[st["params"].astype(str).str.startswith(r["params"] + " context=")]
            worst = st["x_floor"].max() if not st.empty else None
            ok = str(r["status"]) == "ok"
            paper = (f"{fmt(r.get('paper_tokens_per_s'), 1)} ({int(r['paper_requests'])})"
                     if num(r.get("paper_tokens_per_s")) is not None else "–")
            out.append(f"| {config_label(key)} | {key[1]} | {key[2]} | {r['method']} | "
                       f"{int(r['requests']) if num(r.get('requests')) is not None else '–'} | "
                       f"{fmt(r.get('prefill_s'), 2)} | {fmt(r.get('decode_s'), 1)} | "
                       f"{fmt(r.get('tokens_per_s'), 1) if ok else '–'} | "
                       f"{fmt(r.get('vs_best_dense'), 2) + '×' if ok and num(r.get('vs_best_dense')) else '–'} | "
                       f"{paper} | {ratio(r.get('tokens_per_s'), r.get('paper_tokens_per_s')) if ok else '–'} | "
                       f"{fmt(r.get('ms_per_step_mean'), 2)} | {fmt(worst, 2) + '×' if num(worst) else '–'} | "
                       f"{r['status']} | {r.get('commit', '–')} |")
    if not steps.empty:
        out += ["", "| model | input | output | method | requests | context | ms/step | floor ms | × floor | GB read | "
                    "GB/s |", "|" + "---|" * 11]
        for _, r in steps.iterrows():
            out.append(f"| {config_label(config_key(r))} | {int(r['input'])} | {int(r['output'])} | {r['method']} | "
                       f"{int(r['requests'])} "
                       f"| {int(r['context'])} | {fmt(r['ms_p50'], 2)} | {fmt(r['floor_ms'], 2)} | "
                       f"{fmt(r['x_floor'], 2)} | {fmt(r['bytes_gb'], 1)} | {fmt(r.get('gbps'), 0)} |")
    if not val.empty:
        out += ["", "Validation (a whole generation against the sampled estimate): " + "; ".join(
            f"{r['model']} [{int(r['input'])}, {int(r['output'])}] {r['method']}: measured {fmt(r['decode_s'], 2)} s, "
            f"estimate {fmt(r['estimate_s'], 2)} s ({100 * float(r['rel_err']):+.1f} %"
            f"{'' if str(r['status']) == 'ok' else ', ' + str(r['status']).split(':')[0]})" for _, r in val.iterrows())]
    return "\n".join(out)




def markdown(df) -> str:
    """All tables for the suites and modes present in ``df`` (a DataFrame of the long CSV)."""
    dk = df[~df["suite"].isin(["decode-ops", "decode", *TREE_SUITES])] if "suite" in df.columns else df
    dk = dk[~dk["pass"].isin(["tune", "check", "check_tuned"])]
    tree = markdown_tree(df) if "suite" in df.columns else ""
    parts = []
    # the DualKV tables are per (P, mb): rows of other settings (a window, a dtype, a shape key swept with -m: the
    # rest of their params) get tables of their own, or one setting's cell would stand in another's row
    setting = (dk["params"].astype(str).str.replace(r"^P=\d+ mb=\d+ ?", "", regex=True) if "params" in dk.columns
               else None)
    for value in ([None] if setting is None else list(dict.fromkeys(setting))):
        sub = dk if value is None else dk[setting == value]
        tables = [t for t in (markdown_layer(sub), markdown_attn(sub)) if t]
        if tables and value:
            tables[0] = f"Setting: {value}\n\n" + tables[0]
        parts += tables
    parts += [p for p in (markdown_decode(df), markdown_throughput(df), tree) if p]
    return "\n\n".join(parts)
