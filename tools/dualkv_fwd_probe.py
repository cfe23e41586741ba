"""Profile and sweep the DualKV forward on the device (issue 14): where the time of one benchmark step goes
(torch.profiler: kernels, GPU busy vs step time), the op step with and without the host syncs, the forward kernel
alone (work tables prebuilt), and launch-config variants (incl. the GQA-packed program) with bf16 checks.

    source tools/device_env.sh && python3 tools/dualkv_fwd_probe.py --shapes 5059:4,8192:16 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kvtransform.bench import flops
from kvtransform.bench.timing import quantiles, time_steps
from kvtransform.kernels import dualkv as K
from kvtransform.layout import DualKVLayout
from kvtransform.ops.dualkv import dualkv_attention

H, HKV, D = 32, 8, 128
# (BLOCK_M query tokens, BLOCK_N, warps, stages, PACK[, TMA]); indices 0-10 are run 1's sweep (BENCHMARKS.md)
VARIANTS = [(128, 128, 8, 3, 0), (128, 64, 8, 3, 0), (64, 128, 4, 3, 0), (32, 128, 8, 3, 1), (32, 64, 4, 3, 1),
            (32, 64, 8, 3, 1), (32, 128, 8, 2, 1), (64, 64, 8, 3, 1), (64, 64, 16, 2, 1), (64, 128, 16, 2, 1),
            (16, 128, 4, 3, 1), (128, 128, 8, 3, 0, 1), (128, 128, 8, 2, 0, 1), (128, 64, 8, 4, 0, 1),
            (32, 128, 8, 3, 1, 1)]


# backward kernel variants (same tuple form; dK/dV: BLOCK_M queries per step, BLOCK_N keys per program); 0 = default
DQ_VARIANTS = [(128, 64, 8, 3, 0), (128, 64, 8, 3, 0, 1), (32, 64, 8, 3, 1), (32, 64, 8, 3, 1, 1),
               (32, 128, 8, 3, 1, 1), (32, 64, 8, 2, 1, 1), (16, 64, 4, 3, 1, 1), (64, 64, 8, 3, 0, 1)]
# the experimental fused backward (whole backward timed against the default two-kernel one): (BLOCK_M, BLOCK_N,
# warps, stages, 0[, TMA[, fixed-point dQ sums[, dQ sums by bulk tensor reduction]]]); 7-11: DQ_SUM="fixed_point"
# (integer atomics, no ordered waits); 12-14: the same with DQ_TMA
FUSED_VARIANTS = [(64, 128, 8, 2, 0), (64, 128, 8, 3, 0), (32, 128, 8, 2, 0), (64, 64, 4, 2, 0), (32, 64, 4, 2, 0),
                  (64, 128, 8, 2, 0, 1), (32, 128, 8, 2, 0, 1), (64, 128, 8, 2, 0, 0, 1), (64, 128, 8, 2, 0, 1, 1),
                  (64, 64, 8, 2, 0, 1, 1), (32, 128, 8, 2, 0, 1, 1), (32, 64, 8, 2, 0, 1, 1),
                  (64, 128, 8, 2, 0, 1, 1, 1), (32, 128, 8, 2, 0, 1, 1, 1), (64, 64, 8, 2, 0, 1, 1, 1)]
# 5-9: 64-key programs (dK/dV accumulators half the size: spill-free in local sm_90a builds, where 64/128/8/2 spills)
DKDV_VARIANTS = [(64, 128, 8, 3, 0), (64, 128, 8, 3, 0, 1), (64, 128, 8, 2, 0, 1), (32, 128, 8, 3, 0, 1),
                 (64, 128, 8, 4, 0, 1), (64, 64, 8, 2, 0, 1), (64, 64, 8, 3, 0, 1), (32, 64, 8, 2, 0, 1),
                 (32, 64, 8, 3, 0, 1), (32, 64, 8, 4, 0, 1)]


def cfg_of(c):
    return dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3], PACK=bool(c[4]),
                TMA=bool(c[5]) if len(c) > 5 else False)


def lengths(p, mb, seed=42):
    return [int(r) for r in torch.randint(131, 2049, (mb,), generator=torch.Generator().manual_seed(seed))]


def med(step, iters=20, warmup=3):
    ts = time_steps(step, torch.device("cuda"), warmup, iters)
    return [quantiles([t[i] for t in ts])["ms_p50"] for i in range(len(ts[0]))]


def fwd_kernel_only(q, k, v, cu, sp, c, scale_pos=True):
    """A launcher of the forward kernel alone with the tables prebuilt; returns (run, compiled kernel)."""
    t, h, d = q.shape
    h_kv = k.shape[1]
    cfg = cfg_of(c)
    grp = h // h_kv
    pack = 4 if cfg["PACK"] else 1
    cu_b, sp_b = K._bounded_layout(cu, sp, t)
    klo, khi, _, _ = K._segment_tables(cu_b, sp_b)
    wseg, wblk, w = K._work_table(cu_b, cfg["BLOCK_M"], t, khi - klo, +1)
    out = torch.empty_like(q)
    lse = torch.empty((h, t), dtype=torch.float32, device=q.device)
    kd, vd = K._tma_descriptors(k, v, cfg["BLOCK_N"]) if cfg["TMA"] else (None, None)
    holder = {}

    def run(mark=None):
        holder["k"] = K._fwd_kernel[(w * (h_kv if pack > 1 else h),)](
            q, k, v, out, lse, cu_b, klo, khi, wseg, wblk, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), t, h, grp, d ** -0.5 * K.LOG2E,
            D=d, D_PAD=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], PACK=pack, EVEN_D=True, PREC="tf32",
            SCALE_POS=scale_pos, KD=kd, VD=vd, TMA=kd is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return run, holder


def bwd_rows(q, k, v, do, cu, sp, p, mb, tf, dq_variants, dkdv_variants, check):
    """The dQ and the dK/dV kernels alone (tables prebuilt): launch variants of each, their difference from the
    kind's first variant, and (``check``) the bf16 kernel checks with that config. ``matmul_tflops``: the kernel's
    own matmuls (dQ 3, dK/dV 4) per second."""
    t, h, d = q.shape
    h_kv = k.shape[1]
    scale = d ** -0.5
    out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale)
    delta = (out.float() * do.float()).sum(-1).t().contiguous()
    cub, ctx = K._plan_layout(cu, sp, t)
    rows = []
    for kind, variants, n_mm in (("dq", dq_variants, 3), ("dkdv", dkdv_variants, 4)):
        ref = None
        for c in variants:
            cfg = cfg_of(c)
            try:
                if kind == "dq":
                    outs = (torch.empty_like(q),)
                    run = lambda mark=None, cfg=cfg, o=outs: K._launch_dq(  # noqa: E731
                        q, k, v, do, o[0], lse, delta, cub, ctx[0], ctx[1], t, h, h_kv, d, d, "tf32", scale, cfg)
                else:
                    outs = (torch.empty_like(k), torch.empty_like(v))
                    run = lambda mark=None, cfg=cfg, o=outs: K._launch_dkdv(  # noqa: E731
                        q, k, v, do, o[0], o[1], lse, delta, cub, ctx[2], ctx[3], t, h, h_kv, d, d, "tf32", scale,
                        cfg)
                kc = run()
                torch.cuda.synchronize()
                ms = med(run, iters=20)[0]
                got = torch.cat([x.float().flatten() for x in outs])
                ref = got if ref is None else ref
                row = dict(what=f"{kind}_kernel_only", P=p, mb=mb, cfg=str(c), ms=ms,
                           matmul_tflops=tf(ms * 2 / n_mm), maxdiff_vs_first=(got - ref).abs().max().item(),
                           regs=getattr(kc, "n_regs", -1), spills=getattr(kc, "n_spills", -1))
                if check:
                    from kvtransform.bench.checks import check_dualkv_kernels
                    row["check_ok"], row["check_worst"] = check_dualkv_kernels(q.device, {kind: cfg}, cases=[0, 1, 2])
            except Exception as e:  # noqa: BLE001
                row = dict(what=f"{kind}_kernel_only", P=p, mb=mb, cfg=str(c), error=f"{type(e).__name__}: "
                           f"{str(e).splitlines()[0][:150] if str(e) else ''}")
            rows.append(row)
            print(row, flush=True)
    return rows


def fused_rows(q, k, v, do, cu, sp, p, mb, tf, variants, check):
    """The whole backward (``dualkv_bwd``): the default two kernels, then fused variants with their largest difference
    from the default's gradients, run-to-run bitwise equality and (``check``) the bf16 kernel checks."""
    scale = q.shape[-1] ** -0.5
    out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale)
    rows, ref = [], None
    for c in [None] + variants:
        config = None if c is None else {"fused": dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3],
                                                       TMA=bool(c[5]) if len(c) > 5 else False,
                                                       DQ_SUM="fixed_point" if len(c) > 6 and c[6] else "ordered",
                                                       DQ_TMA=len(c) > 7 and bool(c[7]))}
        try:
            run = lambda mark=None, config=config: K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale,  # noqa: E731
                                                                config=config)
            got = run()
            torch.cuda.synchronize()
            ms = med(run, iters=10)[0]
            again = run()
            row = dict(what="bwd_fused" if c else "bwd_default", P=p, mb=mb, cfg=str(c), ms=ms,
                       tflops=tf(ms / 2.5), deterministic=all(torch.equal(a, b) for a, b in zip(got, again)))
            if ref is None:
                ref = got
            else:
                row["maxdiff_vs_default"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
            if check and c is not None:
                from kvtransform.bench.checks import check_dualkv_kernels
                row["check_ok"], row["check_worst"] = check_dualkv_kernels(q.device, config, cases=[0, 1, 2])
        except Exception as e:  # noqa: BLE001
            row = dict(what="bwd_fused", P=p, mb=mb, cfg=str(c), error=f"{type(e).__name__}: "
                       f"{str(e).splitlines()[0][:150] if str(e) else ''}")
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="5059:4,8192:16")
    ap.add_argument("--out", default="out/probe")
    ap.add_argument("--variants", default="all")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--dq-variants", default="", help="comma-separated DQ_VARIANTS indices: the dQ kernel alone")
    ap.add_argument("--dkdv-variants", default="", help="comma-separated DKDV_VARIANTS indices: the dK/dV kernel")
    ap.add_argument("--fused-variants", default="", help="comma-separated FUSED_VARIANTS indices: the whole "
                    "backward, fused (experimental) against the default")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--scale-first", action="store_true", help="kernel-only rows: the softmax that scales the scores "
                    "before the row max (the forward before the FMA form)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    rows = []
    variants = VARIANTS if a.variants == "all" else [VARIANTS[int(i)] for i in a.variants.split(",")]
    if a.check:
        from kvtransform.bench.checks import check_dualkv_kernels
        for c in variants[1:]:
            ok, worst = check_dualkv_kernels(dev, {"fwd": cfg_of(c)}, cases=[0, 1, 2])
            rows.append(dict(what="check", cfg=str(c), ok=ok, worst=worst))
    for shp in a.shapes.split(","):
        p, mb = (int(x) for x in shp.split(":"))
        rs = lengths(p, mb)
        lay = DualKVLayout.from_lengths([(p, rs)], device=dev)
        t = lay.total_tokens
        g = torch.Generator(device=dev).manual_seed(0)
        q, do = (torch.randn(t, H, D, device=dev, generator=g).bfloat16() for _ in range(2))
        k, v = (torch.randn(t, HKV, D, device=dev, generator=g).bfloat16() for _ in range(2))
        fw = flops.attention_flops(lay, H, D)
        tf = lambda ms, f=fw: f / (ms * 1e-3) / 1e12  # noqa: E731
        cu, sp = lay.cu_seqlens, lay.segment_prefix
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

        def step_new(mark):  # the bench's dualkv step: layout per step, op, backward
            L = DualKVLayout.from_lengths([(p, rs)], device=dev)
            o = dualkv_attention(qg, kg, vg, L)
            mark()
            o.backward(do)

        def step_old(mark):  # as before this change: blocking H2D layout copy + host-read check (2 syncs)
            cu_o = torch.tensor(cu.tolist(), dtype=torch.int32, device=dev)
            sp_o = torch.tensor(sp.tolist(), dtype=torch.int32, device=dev)
            o = dualkv_attention(qg, kg, vg, cu_o, sp_o)
            mark()
            o.backward(do)

        def step_kernels(mark):
            o, l_ = K.dualkv_fwd(q, k, v, cu, sp, D ** -0.5)
            mark()
            K.dualkv_bwd(do, q, k, v, o, l_, cu, sp, D ** -0.5)

        for name, st in (("op_step_old_sync", step_old), ("op_step_nosync", step_new), ("kernels", step_kernels)):
            fm, bm_ = med(st)
            rows.append(dict(what=name, P=p, mb=mb, T=t, fwd_ms=fm, bwd_ms=bm_, fwd_tflops=tf(fm),
                             bwd_tflops=tf(bm_ / 2.5)))
            print(rows[-1], flush=True)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile
            for name, st in (("op_step_old_sync", step_old), ("op_step_nosync", step_new)):
                for _ in range(2):
                    st(lambda: None)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        st(lambda: None)
                    torch.cuda.synchronize()
                ka = prof.key_averages()
                kern = [(e.key, e.count, e.device_time_total / 1e3) for e in ka if e.device_time_total > 0
                        and getattr(getattr(e, "device_type", None), "name", "CUDA") == "CUDA"]
                kern.sort(key=lambda x: -x[2])
                tot = sum(x[2] for x in kern)
                nk = sum(x[1] for x in kern)
                print(f"## profile {name} P={p} mb={mb}: 3 steps, {nk} kernels, GPU kernel time {tot:.3f} ms")
                for key, n, ms in kern[:14]:
                    print(f"  {ms / 3:8.3f} ms/step  x{n // 3:4d}  {key[:90]}")
                prof.export_chrome_trace(os.path.join(a.out, f"trace_{name}_{p}_{mb}.json"))
                rows.append(dict(what="profile_" + name, P=p, mb=mb, kernels_per_step=nk / 3,
                                 gpu_kernel_ms_per_step=tot / 3, top=[(k_[:60], n // 3, ms / 3) for k_, n, ms in kern[:8]]))
        for c in variants:
            try:
                run, holder = fwd_kernel_only(q, k, v, cu, sp, c, scale_pos=not a.scale_first)
                run()
                torch.cuda.synchronize()
                ms = med(lambda mark: run(), iters=30)[0]
                kc = holder["k"]
                regs, spills = getattr(kc, "n_regs", -1), getattr(kc, "n_spills", -1)
                o_ref, l_ref = K.dualkv_fwd(q, k, v, cu, sp, D ** -0.5)
                o2, l2 = K.dualkv_fwd(q, k, v, cu, sp, D ** -0.5, config={"fwd": cfg_of(c)})
                err = (o2.float() - o_ref.float()).abs().max().item()
                lerr = (l2 - l_ref).abs().max().item()
                rows.append(dict(what="fwd_kernel_only", P=p, mb=mb, cfg=str(c), ms=ms, tflops=tf(ms), regs=regs,
                                 spills=spills, maxdiff_vs_default=err, lse_diff=lerr))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(what="fwd_kernel_only", P=p, mb=mb, cfg=str(c), error=f"{type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:150] if str(e) else ''}"))
            print(rows[-1], flush=True)
        if a.fused_variants:
            rows.extend(fused_rows(q, k, v, do, cu, sp, p, mb, tf,
                                   [FUSED_VARIANTS[int(i)] for i in a.fused_variants.split(",")], a.check))
        if a.dq_variants or a.dkdv_variants:
            pick = lambda arg, table: [table[int(i)] for i in arg.split(",")] if arg else []  # noqa: E731
            rows.extend(bwd_rows(q, k, v, do, cu, sp, p, mb, tf, pick(a.dq_variants, DQ_VARIANTS),
                                 pick(a.dkdv_variants, DKDV_VARIANTS), a.check))
        del q, k, v, do, qg, kg, vg
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| what | P/mb | cfg | fwd ms | TFLOP/s | bwd ms | regs/spills | diff |")
    for r in rows:
        if r["what"] == "fwd_kernel_only":
            print(f"| kernel-only | {r['P']}/{r['mb']} | {r['cfg']} | {r.get('ms', float('nan')):.3f} | "
                  f"{r.get('tflops', 0):.0f} | | {r.get('regs')}/{r.get('spills')} | {r.get('maxdiff_vs_default', r.get('error'))} |")
        elif "fwd_ms" in r:
            print(f"| {r['what']} | {r['P']}/{r['mb']} | | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | "
                  f"{r['bwd_ms']:.3f} | | |")
        elif r["what"] == "check":
            print(f"| check | | {r['cfg']} | | | | | ok={r['ok']} worst={r['worst']:.2f} |")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"wall {time.time() - t0:.1f} s")
