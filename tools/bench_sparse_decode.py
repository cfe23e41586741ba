#!/usr/bin/env python3
"""Benchmark + bf16 checks for the SpeContext sparse decode ops (issue 6; arXiv 2512.00722 §4.3).

On a CUDA device, in one process:
  1. device-to-device copy bandwidth (bytes read + written), the ceiling;
  2. bf16 correctness of the Triton kernels against fp64 references (odd shapes, GQA 1/4/7, head_dim 64/80/128);
  3. a launch-config sweep of the gather kernel at the largest S;
  4. per S: sparse gather decode (B tokens/KV head), slot-buffer decode, naive torch.gather + SDPA, dense SDPA
     (flash) over the full cache, our kernel in dense mode over the full cache, and retrieval top-k.
Times are CUDA-graph replays (decode runs under graphs) via triton.testing.do_bench_cudagraph, p20/p50/p80 ms.
Bytes counted: the K/V bytes the op must read (gathered rows or the whole cache) + q, k_new, v_new, out.

Usage (repo root, device):  source tools/device_env.sh && python3 tools/bench_sparse_decode.py --out $OUT
Writes sparse_decode.csv (long format) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch
import torch.nn.functional as F

from kvtransform.kernels.retrieval import retrieval_scores_reference, retrieval_scores_triton, select_topk
from kvtransform.kernels.sparse_decode import sparse_decode_reference, sparse_decode_triton
from kvtransform.ops.sparse_decode import retrieval_topk, sparse_decode_attention
from kvtransform.bench import git_commit

QUANT = [0.2, 0.5, 0.8]


def bench(fn, graph=True, rep=40):
    """p20/p50/p80 in ms; CUDA-graph replay when possible."""
    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return list(__import__("triton").testing.do_bench_cudagraph(fn, rep=rep, quantiles=QUANT))
        except Exception as e:  # pragma: no cover
            print(f"  (graph capture failed: {type(e).__name__}: {e}; eager timing)")
    return list(__import__("triton").testing.do_bench(fn, warmup=10, rep=rep, quantiles=QUANT))


def read_bandwidth(dev) -> float:
    """Read-only streaming ceiling: a sum over 1 GiB of bf16 (bytes read / time)."""
    x = torch.randn(2 ** 30 // 2, device=dev, dtype=torch.bfloat16)
    t = bench(lambda: torch.sum(x, dtype=torch.float32), graph=False, rep=100)[1]
    return x.numel() * 2 / (t * 1e-3) / 1e9


def copy_bandwidth(dev) -> float:
    x = torch.randn(2 ** 30 // 2, device=dev, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x), graph=False, rep=100)[1]
    return 2 * x.numel() * 2 / (t * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------------------------
def _rand_lengths(bsz, s_max, dev):
    lens = torch.randint(1, s_max + 1, (bsz,), device=dev)
    lens[0] = s_max
    return lens.to(torch.int32)


def check_bf16(dev) -> bool:
    ok = True
    print("## bf16 correctness (Triton vs fp64 reference; err = max |out-ref|, bound = 2 x torch-bf16 err + 2e-3)")
    cases = [  # bsz, h_kv, g, s_max, d, budget, new
        (3, 2, 1, 1, 64, 1, True), (3, 2, 4, 17, 80, 8, True), (2, 1, 7, 1025, 128, 300, False),
        (2, 2, 4, 1025, 128, 1100, True), (4, 8, 4, 4096, 128, 2048, True), (2, 3, 7, 513, 64, 64, True),
    ]
    for bsz, h_kv, g, s_max, d, budget, new in cases:
        dt = torch.bfloat16
        q = torch.randn(bsz, h_kv * g, d, device=dev, dtype=dt)
        k = torch.randn(bsz, h_kv, s_max, d, device=dev, dtype=dt)
        v = torch.randn(bsz, h_kv, s_max, d, device=dev, dtype=dt)
        kn = torch.randn(bsz, h_kv, d, device=dev, dtype=dt) if new else None
        vn = torch.randn(bsz, h_kv, d, device=dev, dtype=dt) if new else None
        lens = _rand_lengths(bsz, s_max, dev)
        # retrieval on the same keys: scores vs fp64, selection valid
        sc = retrieval_scores_triton(q, k, lens, d ** -0.5)
        rs = retrieval_scores_reference(q, k, lens, d ** -0.5)
        fin = torch.isfinite(rs)
        r_err = (sc.double() - rs)[fin].abs().max().item()
        r_ok = torch.equal(torch.isfinite(sc), fin) and r_err < 5e-2
        idx = retrieval_topk(q, k, lens, budget)
        n_valid = (idx >= 0).sum(-1)
        r_ok &= bool((n_valid == lens.clamp(max=budget)[:, None]).all())
        for mode in ("gather", "slots"):
            ii = idx if mode == "gather" else None
            if mode == "slots":
                safe = idx.clamp(min=0).long()[..., None].expand(-1, -1, -1, d)
                kk, vv, ll = torch.gather(k, 2, safe), torch.gather(v, 2, safe), lens.clamp(max=budget)
            else:
                kk, vv, ll = k, v, lens
            out = sparse_decode_attention(q, kk, vv, ii, ll, kn, vn, validate=True)
            d64 = lambda t: None if t is None else t.double()  # noqa: E731
            ref = sparse_decode_reference(q.double(), kk.double(), vv.double(), ii, ll, d64(kn), d64(vn))
            tref = sparse_decode_reference(q, kk, vv, ii, ll, kn, vn, dtype=torch.bfloat16)
            err = (out.double() - ref).abs().max().item()
            terr = (tref.double() - ref).abs().max().item()
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            good = bool(torch.isfinite(out).all()) and err <= 2 * terr + 2e-3
            ok &= good and r_ok
            print(f"  b={bsz} H_kv={h_kv} G={g} S={s_max} D={d} B={budget} new={new} {mode:6s}: err {err:.2e} "
                  f"(torch bf16 {terr:.2e}) rel {rel:.1e}; retrieval score err {r_err:.1e} "
                  f"{'ok' if good and r_ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--seqlens", default="4096,16384,32768")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--sweep", choices=["full", "small", "none"], default="full",
                    help="launch-config sweep of the gather kernel at the largest S")
    ap.add_argument("--retrieval-sweep", action="store_true", help="sweep the retrieval scoring launch config")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device(os.environ.get("KVT_BENCH_DEVICE", "cuda"))  # cpu: dry run of the script's logic only
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(0)
    commit = git_commit()
    cmd = "python3 tools/bench_sparse_decode.py " + " ".join(sys.argv[1:])
    print(f"device {name}, torch {torch.__version__}, triton {__import__('triton').__version__}, commit {commit}")
    t0 = time.time()
    bw = copy_bandwidth(dev)
    rbw = read_bandwidth(dev) if dev.type == "cuda" else float("nan")
    print(f"copy bandwidth (read+write): {bw:.0f} GB/s; read-only (torch.sum): {rbw:.0f} GB/s")
    rows = []
    ok = True if args.no_check else check_bf16(dev)
    print(f"bf16 checks: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s)")

    bsz, h, h_kv, d, budget = args.batch, args.heads, args.kv_heads, args.head_dim, args.budget
    dt = torch.bfloat16
    seqlens = [int(s) for s in args.seqlens.split(",")]
    item = 2
    io_bytes = (2 * bsz * h * d + 2 * bsz * h_kv * d) * item  # q, out, k_new, v_new

    def add(method, op, mode, params, ms, nbytes):
        gbps = nbytes / (ms[1] * 1e-3) / 1e9 if nbytes else float("nan")
        rows.append(dict(method=method, op=op, mode=mode, params=params, p20_ms=f"{ms[0]:.4f}",
                         p50_ms=f"{ms[1]:.4f}", p80_ms=f"{ms[2]:.4f}", gbps=f"{gbps:.0f}",
                         pct_copy=f"{100 * gbps / bw:.1f}", pct_read=f"{100 * gbps / rbw:.1f}",
                         memory_gb=f"{nbytes / 1e9:.3f}", device=name,
                         commit=commit, command=cmd))
        print(f"  {method:28s} {mode:10s} {params:34s} p50 {ms[1]:.4f} ms  {gbps:7.0f} GB/s  "
              f"{100 * gbps / bw:5.1f}% of copy  {100 * gbps / rbw:5.1f}% of read")

    best, best_r = {}, {}
    for s_max in sorted(seqlens, reverse=True):
        torch.cuda.empty_cache()
        q = torch.randn(bsz, h, d, device=dev, dtype=dt)
        k = torch.randn(bsz, h_kv, s_max, d, device=dev, dtype=dt)
        v = torch.randn(bsz, h_kv, s_max, d, device=dev, dtype=dt)
        kn = torch.randn(bsz, h_kv, d, device=dev, dtype=dt)
        vn = torch.randn(bsz, h_kv, d, device=dev, dtype=dt)
        lens = torch.full((bsz,), s_max, device=dev, dtype=torch.int32)
        # retrieval head of the model's attention shape (worst case for its cost)
        qr = torch.randn(bsz, h, d, device=dev, dtype=dt)
        kr = torch.randn(bsz, h_kv, s_max, d, device=dev, dtype=dt)
        idx = retrieval_topk(qr, kr, lens, budget)
        sel_bytes = 2 * bsz * h_kv * budget * d * item + bsz * h_kv * budget * 4 + io_bytes
        p = f"b={bsz} H={h} Hkv={h_kv} D={d} S={s_max} B={budget}"
        print(f"## S = {s_max}")

        if args.sweep != "none" and not best:
            print("  sweep (gather, S max):")
            if args.sweep == "full":
                grid = [dict(block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp)
                        for bn in (32, 64, 128) for nw in (4, 8) for ns in (2, 3, 4) for sp in (2, 4, 8)
                        if not (bn == 128 and ns == 4)]
            else:
                grid = [dict(block_n=64, num_warps=4, num_stages=ns, num_splits=sp)
                        for ns in (2, 3) for sp in (1, 2, 3, 4)]
            res = []
            for cfg in grid:
                try:
                    ms = bench(lambda: sparse_decode_triton(q, k, v, idx, lens, kn, vn, **cfg), rep=15)
                except Exception as e:
                    print(f"    {cfg}: {type(e).__name__}")
                    continue
                res.append((ms[1], cfg))
            res.sort(key=lambda r: r[0])
            for t, cfg in res[:6]:
                print(f"    {t:.4f} ms  {sel_bytes / (t * 1e-3) / 1e9:.0f} GB/s  {cfg}")
            best = res[0][1]
            print(f"  best {best}")
        if args.retrieval_sweep and not best_r:
            print("  sweep (retrieval scoring, S max):")
            grid = [dict(block_s=bs, num_warps=nw, blocks_per_prog=bpp, num_stages=ns)
                    for bs in (64, 128) for nw in (4, 8) for bpp, ns in ((1, 2), (4, 2), (4, 3), (8, 3))]
            grid += [dict(block_s=256, num_warps=8, blocks_per_prog=bpp, num_stages=2) for bpp in (1, 4)]
            res = []
            for cfg in grid:
                try:
                    ms = bench(lambda: retrieval_scores_triton(qr, kr, lens, d ** -0.5, **cfg), rep=15)
                except Exception as e:
                    print(f"    {cfg}: {type(e).__name__}")
                    continue
                res.append((ms[1], cfg))
            res.sort(key=lambda r: r[0])
            r_bytes = bsz * h_kv * s_max * d * item
            for t, cfg in res[:6]:
                print(f"    {t:.4f} ms  {r_bytes / (t * 1e-3) / 1e9:.0f} GB/s  {cfg}")
            best_r = res[0][1]
            print(f"  best retrieval {best_r}")

        # sparse gather decode (ours): default config, tuned config, sorted indices
        add("kvt.sparse_decode(default)", "sparse_decode", "gather", p,
            bench(lambda: sparse_decode_triton(q, k, v, idx, lens, kn, vn)), sel_bytes)
        if best:
            add("kvt.sparse_decode(tuned)", "sparse_decode", "gather", p + f" {best}",
                bench(lambda: sparse_decode_triton(q, k, v, idx, lens, kn, vn, **best)), sel_bytes)
        idx_sorted = torch.sort(idx, dim=-1).values
        add("kvt.sparse_decode(sorted idx)", "sparse_decode", "gather", p,
            bench(lambda: sparse_decode_triton(q, k, v, idx_sorted, lens, kn, vn, **best)), sel_bytes)
        # slot mode: dense (batch, H_kv, B, D) buffers
        safe = idx.clamp(min=0).long()[..., None].expand(-1, -1, -1, d)
        ks, vs = torch.gather(k, 2, safe), torch.gather(v, 2, safe)
        slot_len = lens.clamp(max=budget)
        add("kvt.sparse_decode(slots)", "sparse_decode", "slots", p,
            bench(lambda: sparse_decode_triton(q, ks, vs, None, slot_len, kn, vn, **best)),
            2 * bsz * h_kv * budget * d * item + io_bytes)
        del ks, vs
        # naive: torch.gather of the selected rows then SDPA
        q4 = q[:, :, None]

        def naive():
            kg, vg = torch.gather(k, 2, safe), torch.gather(v, 2, safe)
            return F.scaled_dot_product_attention(q4, kg, vg, enable_gqa=True)
        add("torch.gather+sdpa", "sparse_decode", "gather", p, bench(naive), sel_bytes)
        # dense baselines over the whole cache
        dense_bytes = 2 * bsz * h_kv * s_max * d * item + io_bytes
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for backend, label in ((SDPBackend.FLASH_ATTENTION, "sdpa(flash)"), (None, "sdpa(auto)")):
            def dense():
                if backend is None:
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            try:
                add(label, "dense_decode", "full", p.replace(f" B={budget}", ""), bench(dense), dense_bytes)
            except Exception as e:
                print(f"  {label}: {type(e).__name__}: {str(e)[:120]}")
        add("kvt.sparse_decode(slots=S)", "dense_decode", "full", p.replace(f" B={budget}", ""),
            bench(lambda: sparse_decode_triton(q, k, v, None, lens, kn, vn, **best)), dense_bytes)
        # retrieval top-k (H_r = H, H_r_kv = H_kv, D_r = D)
        r_bytes = bsz * h_kv * s_max * d * item
        add("kvt.retrieval_topk", "retrieval_topk", "total", p, bench(lambda: retrieval_topk(qr, kr, lens, budget)),
            r_bytes)
        scores = retrieval_scores_triton(qr, kr, lens, d ** -0.5)
        add("kvt.retrieval(scoring)", "retrieval_topk", "scoring", p,
            bench(lambda: retrieval_scores_triton(qr, kr, lens, d ** -0.5)), r_bytes)
        if best_r:
            add("kvt.retrieval(scoring,tuned)", "retrieval_topk", "scoring", p + f" {best_r}",
                bench(lambda: retrieval_scores_triton(qr, kr, lens, d ** -0.5, **best_r)), r_bytes)
            add("kvt.retrieval_topk(tuned)", "retrieval_topk", "total", p + f" {best_r}",
                bench(lambda: select_topk(retrieval_scores_triton(qr, kr, lens, d ** -0.5, **best_r), budget)),
                r_bytes)
        add("torch.topk(sorted)", "retrieval_topk", "select", p, bench(lambda: select_topk(scores, budget)), 0)
        add("torch.topk(unsorted)", "retrieval_topk", "select", p,
            bench(lambda: torch.topk(scores, budget, dim=-1, sorted=False)), 0)
        del q, k, v, kr, scores

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sparse_decode.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {path}; total {time.time() - t0:.0f} s")
    print(f"\ncopy bandwidth {bw:.0f} GB/s, read-only {rbw:.0f} GB/s; bf16 checks {'PASS' if ok else 'FAIL'}; "
          f"commit {commit}; {name}")
    print("| method | op | mode | S | p50 ms | GB/s | % copy | % read |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = [t for t in r["params"].split() if t.startswith("S=")][0][2:]
        print(f"| {r['method']} | {r['op']} | {r['mode']} | {s} | {r['p50_ms']} | {r['gbps']} | {r['pct_copy']} | {r['pct_read']} |")


if __name__ == "__main__":
    main()
