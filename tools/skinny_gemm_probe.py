"""Probe: the decode step's skinny GEMMs (M = requests rows, weights streamed once) -- cuBLAS (``F.linear``) against
Inductor max-autotune and a Triton weight-streaming kernel over a small config grid. Prints GB/s of weight bytes per
shape and config. Run on the device: ``source tools/device_env.sh && python3 -P tools/skinny_gemm_probe.py``.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from kvtransform.bench.timing import percentile, time_steps


@triton.jit
def _gemv_kernel(X, W, Y, P, M, N, K, stride_xm, stride_wn, stride_ym,
                 K_PER, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k0 = pid_k * K_PER
    for kk in range(0, K_PER, BLOCK_K):
        offs_k = k0 + kk + tl.arange(0, BLOCK_K)
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
        x = tl.load(X + offs_m[None, :] * stride_xm + offs_k[:, None],
                    mask=(offs_m[None, :] < M) & (offs_k[:, None] < K), other=0.0)
        acc = tl.dot(w, x, acc)
    if SPLIT_K == 1:
        tl.store(Y + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
                 mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))
    else:
        tl.store(P + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], acc,
                 mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


def gemv(x, w, block_n, block_k, split_k, stages, warps, part=None):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = max(16, triton.next_power_of_2(m))
    k_per = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    if split_k > 1 and part is None:
        part = torch.empty(split_k, m, n, device=x.device, dtype=torch.float32)
    _gemv_kernel[(triton.cdiv(n, block_n), split_k)](x, w, y, part, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                                     k_per, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
                                                     SPLIT_K=split_k, num_stages=stages, num_warps=warps)
    if split_k > 1:
        y.copy_(part.sum(0))
    return y


def bench(fn, reps=10):
    """Median ms per call of ``fn``: CUDA-graph replays of repeated calls (the suites' timing loop)."""
    return percentile([t[0] for t in time_steps(lambda mark: fn(), "cuda", 3, reps, cuda_graph=True)], 50)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="25,48")
    ap.add_argument("--out", default=None)
    ap.add_argument("--inductor", default="", help="shapes to also time under Inductor max-autotune")
    a = ap.parse_args()
    dev = torch.device("cuda")
    shapes = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "gate": (14336, 4096),
              "down": (4096, 14336), "lm_head": (128256, 4096)}
    # copy bandwidth
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), 40)
    copy = 2 * src.numel() / ms / 1e6
    print(f"copy {copy:.0f} GB/s", flush=True)
    del src, dst
    grid = list(itertools.product((32, 64, 128), (128, 256), (1, 2, 4), (3, 4), (4,)))
    rows = []
    for m in map(int, a.rows.split(",")):
        for name, (n, k) in shapes.items():
            # rotate over several weight copies so nothing stays in L2 (50 MB)
            copies = max(2, min(8, int(2e9 // (n * k * 2))))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(copies)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            gb = n * k * 2 / 1e9
            ref = torch.nn.functional.linear(x.double(), ws[0].double())
            it = itertools.cycle(range(copies))
            t_cublas = bench(lambda: torch.nn.functional.linear(x, ws[next(it)]))
            res = {"m": m, "shape": name, "n": n, "k": k, "cublas_gbps": gb / t_cublas * 1e3}
            best = (0, None)
            for cfg in grid:
                bn, bk, sk, st, wp = cfg
                if sk > 1 and k // sk < bk:
                    continue
                try:
                    part = torch.empty(sk, m, n, device=dev, dtype=torch.float32) if sk > 1 else None
                    y = gemv(x, ws[0], bn, bk, sk, st, wp, part)
                    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
                    if err > 2e-2:
                        print("bad", name, cfg, err)
                        continue
                    t = bench(lambda: gemv(x, ws[next(it)], bn, bk, sk, st, wp, part))
                except Exception as e:  # out of resources
                    print("fail", name, cfg, type(e).__name__, str(e)[:80])
                    continue
                gbps = gb / t * 1e3
                if gbps > best[0]:
                    best = (gbps, cfg)
            res["triton_gbps"], res["triton_cfg"] = best
            if name in a.inductor.split(",") and m == int(a.rows.split(",")[0]):
                import torch._inductor.config as icfg
                icfg.max_autotune_gemm = True
                icfg.max_autotune_gemm_backends = "TRITON,ATEN"
                torch._dynamo.reset()
                f = torch.compile(torch.nn.functional.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                f(x, ws[0])
                t = bench(lambda: f(x, ws[next(it)]))
                res["inductor_gbps"] = gb / t * 1e3
            print(json.dumps(res), flush=True)
            rows.append(res)
            del ws
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"copy_gbps": copy, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
