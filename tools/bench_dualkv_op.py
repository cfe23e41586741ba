#!/usr/bin/env python3
"""bf16 checks + attention-only benchmark of the DualKV op (issue 3; DualKV arXiv 2605.15422 §2–3).

On a CUDA device, in one process:
  1. ``--check``: bf16 correctness of the Triton forward/backward against an fp64 reference computed on the
     *replicated* layout (each response its own sequence prefix+response, prefix gradients summed over copies),
     prefixes up to 8K, head_dim 64/80/128/256, GQA 1/4/7; numerics rule: kernel max error <= 2 x PyTorch's bf16
     error (``dualkv_attention_reference(upcast=False)``) + 2e-3; the backward run twice must be bitwise equal.
  2. ``--tune``: a small launch-config sweep (block sizes, warps, stages) of the three kernels at one shape; the best
     configs are then used for the benchmark.
  3. the benchmark at the paper's kernel shapes (H=32, H_kv=8, D=128; R_i = randint(131, 2049, (N,)) with seed 42):
     ours (Triton) vs FlexAttention on the same packed layout (block mask built once, build time reported apart)
     vs FA2 (``torch.nn.attention.varlen.varlen_attn``) on the replicated layout, same process. Forward and backward
     timed separately (backward = gradient of q, k, v given dO), p20/p50/p80 ms via ``triton.testing.do_bench``.
     Useful TFLOP/s = visible (q, k) pairs x 4·D·H / time (x 2.5 for the backward), same count for every method.

Usage (repo root, device):  source tools/device_env.sh && python3 tools/bench_dualkv_op.py --check --tune --out $OUT
Writes dualkv_op.csv (long format: method, op, mode, params, p20/p50/p80 ms, tflops, peak memory, device, commit)
and prints markdown tables.
"""
from __future__ import annotations

import argparse
import csv
import inspect
import os
import sys
import time

import torch
import triton

from kvtransform.kernels import dualkv as K
from kvtransform.layout import DualKVLayout
from kvtransform.bench import git_commit

QUANT = [0.2, 0.5, 0.8]
SHAPES = [(4096, 16), (8192, 16), (16384, 8), (32768, 16)]  # the calibration table's (P, N)
ALL_SHAPES = [(p, n) for p in (4096, 8192, 16384, 32768) for n in (8, 16)]


def bench(fn, rep=200):
    fn()
    torch.cuda.synchronize()
    return list(triton.testing.do_bench(fn, warmup=25, rep=rep, quantiles=QUANT))


def paper_layout(p: int, n: int, device) -> DualKVLayout:
    r = torch.randint(131, 2049, (n,), generator=torch.Generator().manual_seed(42)).tolist()
    return DualKVLayout.from_lengths([(p, r)], device=device)


# ------------------------------------------------------------------------------------------------ reference (fp64)
def replicated_reference_fp64(q, k, v, do, layout: DualKVLayout, scale):
    """fp64 out, lse, dq, dk, dv of DualKV attention via the replicated layout, one sequence (prefix + response) at a
    time, explicit formulas (no autograd graph kept). Prefix rows of out/lse/dq from the first copy; prefix dk/dv
    summed over the copies."""
    t, h, d = q.shape
    grp = h // k.shape[1]
    f = torch.float64
    out = torch.zeros(t, h, d, dtype=f, device=q.device)
    lse = torch.zeros(h, t, dtype=f, device=q.device)
    dq = torch.zeros(t, h, d, dtype=f, device=q.device)
    dk = torch.zeros(k.shape, dtype=f, device=q.device)
    dv = torch.zeros(v.shape, dtype=f, device=q.device)
    seqs, off = [], 0  # (packed indices of the sequence, rows to skip = prefix rows of a non-first copy)
    for p, rs in zip(layout.prefix_lens, layout.response_lens):
        pre = torch.arange(off, off + p, device=q.device)
        if not rs:
            seqs.append((pre, 0))
        roff = off + p
        for i, r in enumerate(rs):
            seqs.append((torch.cat([pre, torch.arange(roff, roff + r, device=q.device)]), 0 if i == 0 else p))
            roff += r
        off = roff
    for ix, skip in seqs:
        qs = q[ix].to(f).transpose(0, 1)
        ks = k[ix].to(f).transpose(0, 1).repeat_interleave(grp, 0)
        vs = v[ix].to(f).transpose(0, 1).repeat_interleave(grp, 0)
        dos = do[ix].to(f).transpose(0, 1).clone()
        dos[:, :skip] = 0  # a prefix row's output exists once: only its first copy carries dO
        n = ix.numel()
        s = (qs @ ks.transpose(-1, -2)) * scale
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        l = torch.logsumexp(s, -1)
        pm = torch.exp(s - l[..., None])
        del s
        o = pm @ vs
        delta = (o * dos).sum(-1)
        ds = pm * ((dos @ vs.transpose(-1, -2)) - delta[..., None])
        dqs = (ds @ ks) * scale
        dks = ((ds.transpose(-1, -2) @ qs) * scale).view(-1, grp, n, d).sum(1).transpose(0, 1)
        dvs = (pm.transpose(-1, -2) @ dos).view(-1, grp, n, d).sum(1).transpose(0, 1)
        del ds, pm
        keep = torch.ones(n, dtype=torch.bool, device=q.device)
        keep[:skip] = False
        out[ix[keep]] = o.transpose(0, 1)[keep]
        lse[:, ix[keep]] = l[:, keep]
        dq[ix[keep]] = dqs.transpose(0, 1)[keep]
        dk.index_add_(0, ix, dks)
        dv.index_add_(0, ix, dvs)
    return out, lse, dq, dk, dv


def check_bf16(dev, only=None) -> bool:
    print(f"## bf16 correctness (launch configs: {K.CONFIG_OVERRIDES or 'defaults'})")
    print("## bf16 correctness (Triton vs fp64 replicated reference; bound = 2 x torch-bf16 error + 2e-3)")
    ok = True
    cases = [  # groups, H, H_kv, D
        ([(8192, [1500, 17, 300]), (1025, [97, 1])], 4, 1, 128),
        ([(4096, [2048, 131]), (97, [16, 15, 1])], 8, 2, 128),
        ([(2049, [1025, 17]), (15, [1])], 7, 1, 64),
        ([(1025, [97, 300])], 4, 4, 80),
        ([(1025, [513, 1]), (16, [17])], 4, 1, 256),
    ]
    dt = torch.bfloat16
    print("| layout | H/H_kv | D | tensor | kernel err | torch-bf16 err | bound | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for ci, (groups, h, h_kv, d) in enumerate(cases):
        if only is not None and ci not in only:
            continue
        lay = DualKVLayout.from_lengths(groups, device=dev)
        t = lay.total_tokens
        q = torch.randn(t, h, d, device=dev, dtype=dt)
        k = torch.randn(t, h_kv, d, device=dev, dtype=dt)
        v = torch.randn(t, h_kv, d, device=dev, dtype=dt)
        do = torch.randn(t, h, d, device=dev, dtype=dt)
        scale = d ** -0.5
        cu, sp = lay.cu_seqlens, lay.segment_prefix
        ref = replicated_reference_fp64(q, k, v, do, lay, scale)
        qp, kp, vp = (x.clone().requires_grad_(True) for x in (q, k, v))
        po, pl = K.dualkv_attention_reference(qp, kp, vp, cu, sp, scale, upcast=False)
        pg = torch.autograd.grad(po, (qp, kp, vp), do)
        pt = (po.detach(), pl.detach(), *pg)
        del po, pl, pg, qp, kp, vp
        out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale)
        dq, dk, dv = K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale)
        dq2, dk2, dv2 = K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale)
        det = torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)
        # the op through the dispatcher (CUDA path) gives the same bits
        oo, ll = torch.ops.kvt.dualkv_attention(q, k, v, cu, sp, scale)
        same = torch.equal(oo, out) and torch.equal(ll, lse)
        got = (out, lse, dq, dk, dv)
        name = "+".join(f"{p}x{len(r)}" for p, r in groups)
        for tn, g, p_, r in zip(("out", "lse", "dq", "dk", "dv"), got, pt, ref):
            eg = (g.double() - r).abs().max().item()
            ep = (p_.double() - r).abs().max().item()
            bound = 2 * ep + 2e-3
            good = eg <= bound and bool(torch.isfinite(g).all())
            ok &= good
            print(f"| {name} | {h}/{h_kv} | {d} | {tn} | {eg:.3e} | {ep:.3e} | {bound:.3e} | {'ok' if good else 'FAIL'} |")
        print(f"| {name} | {h}/{h_kv} | {d} | deterministic bwd x2 | {det} | | | {'ok' if det else 'FAIL'} |")
        print(f"| {name} | {h}/{h_kv} | {d} | op == kernel | {same} | | | {'ok' if same else 'FAIL'} |")
        ok &= det and same
        del ref, pt, got
        torch.cuda.empty_cache()
    print("bf16 checks:", "PASS" if ok else "FAIL")
    return ok


# ------------------------------------------------------------------------------------------------ methods
def make_inputs(lay, h, h_kv, d, dev, dt=torch.bfloat16):
    t = lay.total_tokens
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, h, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(t, h_kv, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(t, h_kv, d, device=dev, dtype=dt, generator=g)
    do = torch.randn(t, h, d, device=dev, dtype=dt, generator=g)
    return q, k, v, do


def time_ours(q, k, v, do, lay, scale):
    cu, sp = lay.cu_seqlens, lay.segment_prefix
    fwd = bench(lambda: K.dualkv_fwd(q, k, v, cu, sp, scale))
    out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale)
    bwd = bench(lambda: K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o, l_ = K.dualkv_fwd(q, k, v, cu, sp, scale)
    g = K.dualkv_bwd(do, q, k, v, o, l_, cu, sp, scale)
    torch.cuda.synchronize()
    mem = torch.cuda.max_memory_allocated() - base
    del o, l_, g
    return fwd, bwd, mem, {}


def time_flex(q, k, v, do, lay, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.reset()  # a fresh compile per shape (grad-mode changes count as recompiles; the limit is 8)
    flex = torch.compile(flex_attention, dynamic=False)
    dev = q.device
    t = q.shape[0]
    cu = lay.cu_seqlens.long()
    seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), cu[1:] - cu[:-1])
    sp = lay.segment_prefix.long()
    pre_of_tok = sp[seg]  # -1 for prefix tokens

    def mask_mod(b, h, qi, ki):
        own = (seg[qi] == seg[ki]) & (ki <= qi)
        ctx = pre_of_tok[qi] == seg[ki]
        return own | ctx

    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, 1, None, t, t, device=dev)
    torch.cuda.synchronize()
    build_cold = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, 1, None, t, t, device=dev)
    torch.cuda.synchronize()
    build_warm = (time.perf_counter() - t0) * 1e3
    qq, kk, vv = (x.transpose(0, 1).unsqueeze(0).detach().requires_grad_(True) for x in (q, k, v))
    dd = do.transpose(0, 1).unsqueeze(0)

    def f():
        return flex(qq, kk, vv, block_mask=bm, scale=scale, enable_gqa=True)

    with torch.no_grad():
        fwd = bench(f)
    out = f()
    bwd = bench(lambda: torch.autograd.grad(out, (qq, kk, vv), dd, retain_graph=True))
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = f()
    g = torch.autograd.grad(o, (qq, kk, vv), dd)
    torch.cuda.synchronize()
    mem = torch.cuda.max_memory_allocated() - base
    del o, g
    return fwd, bwd, mem, {"mask_build_cold_ms": round(build_cold, 1), "mask_build_warm_ms": round(build_warm, 1)}


def time_fa2_replicated(q, k, v, do, lay, scale):
    from torch.nn.attention import varlen as vl
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # the replicated copies of q/k/v/dO count toward FA2's memory
    torch.cuda.reset_peak_memory_stats()
    idx = lay.replicated_index()
    rcu = lay.replicated_cu_seqlens()
    mx = max(p + r for p, rs in zip(lay.prefix_lens, lay.response_lens) for r in rs)
    qr, kr, vr = (x[idx].detach().requires_grad_(True) for x in (q, k, v))
    dr = do[idx]
    params = inspect.signature(vl.varlen_attn).parameters
    kw = {"scale": scale}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    kr_, vr_ = kr, vr
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:  # no GQA in this torch's varlen: expand K/V (counted in memory)
        g = q.shape[1] // k.shape[1]
        kr_ = kr.repeat_interleave(g, 1)
        vr_ = vr.repeat_interleave(g, 1)

    def f():
        return vl.varlen_attn(qr, kr_, vr_, rcu, rcu, mx, mx, **kw)

    with torch.no_grad():
        fwd = bench(f)
    out = f()
    bwd = bench(lambda: torch.autograd.grad(out, (qr, kr, vr), dr, retain_graph=True))
    del out
    torch.cuda.synchronize()
    o = f()
    g = torch.autograd.grad(o, (qr, kr, vr), dr)
    torch.cuda.synchronize()
    mem = torch.cuda.max_memory_allocated() - base
    del o, g
    return fwd, bwd, mem, {"replicated_tokens": int(idx.numel()), "gqa": "enable_gqa" in params}


# ------------------------------------------------------------------------------------------------ tuning
# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first of each list is the default. Round 1 (commit
# d9bea5b, BENCHMARKS.md) swept 6 fwd / 5 dq / 8 dkdv configs; these are round 2, around round 1's best.
FWD_CANDS = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3), (128, 64, 4, 3)]
DQ_CANDS = [(128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 3)]
DKDV_CANDS = [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2)]


def split_backward(dev, p=8192, n=16):
    """Time the backward's kernels apart (delta+dQ, delta+dK/dV) with the current configs."""
    lay = paper_layout(p, n, dev)
    q, k, v, do = make_inputs(lay, 32, 8, 128, dev)
    scale = 128 ** -0.5
    cu, sp = lay.cu_seqlens, lay.segment_prefix
    out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale)
    res = {}
    for name, ks in (("delta", ()), ("delta+dq", ("dq",)), ("delta+dkdv", ("dkdv",)), ("all", ("dq", "dkdv"))):
        res[name] = bench(lambda: K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale, _kernels=ks), rep=100)[1]
    pairs = lay.visible_pairs()
    f = K.dualkv_flops(pairs, 32, 128)  # one matmul pair-count x 4DH: dq = 3 of the 5 bwd matmuls... report ms
    print(f"## backward split at P={p}, N={n}: " + ", ".join(f"{a} {b:.2f} ms" for a, b in res.items())
          + f"; dq kernel ~{res['delta+dq'] - res['delta']:.2f} ms ({1.5 * f / (res['delta+dq'] - res['delta']) / 1e9:.0f}"
          f" TFLOP/s on its 3 matmuls), dkdv ~{res['delta+dkdv'] - res['delta']:.2f} ms "
          f"({2.0 * f / (res['delta+dkdv'] - res['delta']) / 1e9:.0f} TFLOP/s on its 4 matmuls)")


def tune(dev, p=8192, n=16):
    print(f"## launch-config sweep at P={p}, N={n}, H=32/8, D=128, bf16 (median ms)")
    lay = paper_layout(p, n, dev)
    q, k, v, do = make_inputs(lay, 32, 8, 128, dev)
    scale = 128 ** -0.5
    cu, sp = lay.cu_seqlens, lay.segment_prefix
    best = {}
    pairs = lay.visible_pairs()
    for kind, cands in (("fwd", FWD_CANDS), ("dq", DQ_CANDS), ("dkdv", DKDV_CANDS)):
        res = []
        for cand in cands:
            bm, bn, nw, ns = cand[:4]
            K.CONFIG_OVERRIDES[kind] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns)
            try:
                if kind == "fwd":
                    ms = bench(lambda: K.dualkv_fwd(q, k, v, cu, sp, scale), rep=100)[1]
                    tf = K.dualkv_flops(pairs, 32, 128) / ms / 1e9
                else:
                    out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale)
                    ms = bench(lambda: K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale), rep=100)[1]
                    tf = K.dualkv_flops(pairs, 32, 128, backward=True) / ms / 1e9
                res.append((ms, cand))
                print(f"  {kind} {K.CONFIG_OVERRIDES[kind]}: {ms:.3f} ms ({tf:.0f} TFLOP/s{' whole bwd' if kind != 'fwd' else ''})")
            except Exception as e:  # out of shared memory, etc.
                print(f"  {kind} {K.CONFIG_OVERRIDES[kind]}: failed {type(e).__name__}: {str(e)[:120]}")
            torch.cuda.synchronize()
        if res:
            cand = min(res)[1]
            best[kind] = dict(BLOCK_M=cand[0], BLOCK_N=cand[1], num_warps=cand[2], num_stages=cand[3])
            K.CONFIG_OVERRIDES[kind] = best[kind]
        else:
            K.CONFIG_OVERRIDES.pop(kind, None)
    print("best:", best)
    return best


# ------------------------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="bf16 correctness checks first")
    ap.add_argument("--tune", action="store_true", help="launch-config sweep before the benchmark")
    ap.add_argument("--split", action="store_true", help="time the backward kernels apart")
    ap.add_argument("--all", action="store_true", help="all 8 (P, N) shapes instead of the calibration's 4")
    ap.add_argument("--shapes", default="", help="P:N,P:N,... overrides the shape list")
    ap.add_argument("--methods", default="ours,flex,fa2")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name(0)
    commit = git_commit()
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}, commit {commit}")
    os.makedirs(args.out, exist_ok=True)
    ok = True
    if args.check:
        ok = check_bf16(dev)
    if args.tune:
        tune(dev)
        if args.check:  # the tuned configs must pass too (D=128 cases)
            ok &= check_bf16(dev, only=(0, 1))
    if args.split:
        split_backward(dev)
    shapes = ALL_SHAPES if args.all else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    methods = args.methods.split(",")
    fns = {"ours": time_ours, "flex": time_flex, "fa2": time_fa2_replicated}
    h, h_kv, d = 32, 8, 128
    rows = []
    csv_path = os.path.join(args.out, "dualkv_op.csv")
    summary = []
    for p, n in shapes:
        lay = paper_layout(p, n, dev)
        q, k, v, do = make_inputs(lay, h, h_kv, d, dev)
        scale = d ** -0.5
        pairs = lay.visible_pairs()
        ff, fb = K.dualkv_flops(pairs, h, d), K.dualkv_flops(pairs, h, d, backward=True)
        res = {}
        for m in methods:
            try:
                fwd, bwd, mem, extra = fns[m](q, k, v, do, lay, scale)
            except Exception as e:
                print(f"P={p} N={n} {m}: failed {type(e).__name__}: {str(e)[:300]}")
                continue
            res[m] = (fwd, bwd, mem, extra)
            params = f"P={p};N={n};T={lay.total_tokens};H={h};H_kv={h_kv};D={d};dtype=bf16"
            cmd = f"python3 tools/bench_dualkv_op.py --shapes {p}:{n} --methods {m}"
            for mode, t_, fl in (("fwd", fwd, ff), ("bwd", bwd, fb)):
                rows.append(dict(method=m, op="dualkv_attention", mode=mode, params=params, p20_ms=round(t_[0], 4),
                                 p50_ms=round(t_[1], 4), p80_ms=round(t_[2], 4), tflops=round(fl / t_[1] / 1e9, 1),
                                 peak_mem_mib=round(mem / 2 ** 20, 1), extra=";".join(f"{a}={b}" for a, b in extra.items()),
                                 device=name, commit=commit, command=cmd))
            print(f"P={p} N={n} T={lay.total_tokens} {m}: fwd {fwd[1]:.3f} ms ({ff / fwd[1] / 1e9:.0f} TFLOP/s), "
                  f"bwd {bwd[1]:.3f} ms ({fb / bwd[1] / 1e9:.0f} TFLOP/s), peak {mem / 2 ** 20:.0f} MiB {extra}")
            torch.cuda.empty_cache()
        summary.append((p, n, lay.total_tokens, ff, fb, res))
        with open(csv_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        del q, k, v, do
        torch.cuda.empty_cache()
    print()
    print("| P | N | T | method | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | vs flex | peak MiB | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p, n, t, ff, fb, res in summary:
        flex_tot = sum(res["flex"][i][1] for i in (0, 1)) if "flex" in res else None
        for m, (fwd, bwd, mem, extra) in res.items():
            tot = fwd[1] + bwd[1]
            sp_ = f"{flex_tot / tot:.2f}x" if flex_tot else ""
            notes = ", ".join(f"{a}={b}" for a, b in extra.items())
            print(f"| {p} | {n} | {t} | {m} | {fwd[1]:.2f} | {ff / fwd[1] / 1e9:.0f} | {bwd[1]:.2f} | "
                  f"{fb / bwd[1] / 1e9:.0f} | {tot:.2f} | {sp_} | {mem / 2 ** 20:.0f} | {notes} |")
    print("overrides:", K.CONFIG_OVERRIDES)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
