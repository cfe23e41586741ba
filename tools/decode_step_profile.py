"""Where the time of one SpeContext decode step goes on the GPU (the evidence behind the decode-throughput section
of BENCHMARKS.md). Run on the device from the repository root:

    source tools/device_env.sh && python3 -P tools/decode_step_profile.py [--model llama-8b] [--requests 16]
        [--context 16384] [--max-length 34816]

For ``dense`` and ``specontext`` (random distilled head) on a random-weight model of the shape: the CUDA-graph step
time (eager program and ``torch.compile``d program), its HBM floor, and ``torch.profiler`` tables of one step of each
(kernel count and time of the retrieval head's step and of the decode program, and the kernels that take it).
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from kvtransform.bench.decode import (_Ours, _random_cache, _shape, _time_ours, build_model, copy_bandwidth,
                                      step_bytes, weight_bytes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-length", type=int, default=0, help="the cache's length S_max (default context + 64; the "
                    "decode suite's is input + output)")
    ap.add_argument("--methods", default="dense,specontext")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--rows", type=int, default=22, help="kernel rows of each profiler table")
    ap.add_argument("--no-timing", action="store_true", help="profile only, without the CUDA-graph timing first "
                    "(note: at the decode suite's largest request counts, e.g. 26 at [2k, 32k] on Llama-8B, the "
                    "head's prefill temporaries do not fit beside this tool's cache either way: use fewer requests)")
    ap.add_argument("--fuse", default="all", help="fuse_projections values to time, comma-separated (qkv, all, none); "
                    "the profile uses the first")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(a.model, torch.bfloat16, dev)
    shape = _shape(model)
    bw = copy_bandwidth(dev)
    wb = weight_bytes(model)
    t0 = time.perf_counter()
    ours = _Ours(model, SimpleNamespace(budget=a.budget, cuda_graphs=True, compile=False,
                                                 fuse_projections=a.fuse.split(",")[0]))
    print(f"transform {time.perf_counter() - t0:.1f} s; copy bandwidth {bw / 1e12:.2f} TB/s; weights {wb / 1e9:.2f} GB",
          flush=True)
    max_len = a.max_length or a.context + 64
    cache = _random_cache(shape, a.requests, max_len, torch.bfloat16, dev, 0)
    for method in a.methods.split(","):
        rt = ours.runtime(method)
        read = wb + step_bytes(method, shape, a.requests, a.context, max_len, a.budget)
        floor = 1000 * read / bw
        for fuse in reversed(a.fuse.split(",")):  # the first (profiled) setting last
            for comp in (() if a.no_timing else (False,) if a.no_compile else (False, True)):
                rt.compile, rt._compiled, rt.fuse_projections = comp, {}, fuse  # the setter drops the slot variant
                t0 = time.perf_counter()
                _time_ours(rt, cache, [a.context], 4, 4, dev)  # warm-up (compile)
                warm = time.perf_counter() - t0
                ms = _time_ours(rt, cache, [a.context], 4, 32, dev)[0]
                print(f"{method:10s} fuse={fuse:4s} compile={comp!s:5s} {ms:7.2f} ms/step  floor {floor:6.2f} ms "
                      f"({ms / floor:.2f}x)  warm-up {warm:.1f} s", flush=True)
        # one step under the profiler (eager program, then the compiled one, both outside CUDA graphs): the kernel
        # time of the retrieval head's step and of the decode program, and the kernels that take it
        import gc

        from torch.profiler import ProfilerActivity, profile

        gc.collect()  # the timing runs' graphs and their pools: the head's prefill below needs ~2 GiB of temporaries
        torch.cuda.empty_cache()
        cache.cache_seqlens.fill_(a.context)
        rt.head.prefill(cache)
        tok = torch.randint(3, shape["vocab"], (a.requests,), device=dev)
        for comp in ((False,) if a.no_compile else (False, True)):
            rt.compile = comp  # the compiled program of the timing above is kept in rt._compiled
            with torch.no_grad():
                sel = rt.head_step(cache, None)
                rt.decode(cache, tok, sel)
                torch.cuda.synchronize()
                parts = {}
                for part in ("head", "decode", "step"):
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        cache.set_current(tok)
                        if part != "decode":
                            sel = rt.head_step(cache, None)
                        if part != "head":
                            rt.decode(cache, tok, sel)
                        torch.cuda.synchronize()
                    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                    parts[part] = (len(ev), sum(e.device_time for e in ev) / 1000, prof)
            print(f"{method} compile={comp}: kernels/ms of kernel time: " + ", ".join(
                f"{k} {n} / {ms:.2f}" for k, (n, ms, _) in parts.items()), flush=True)
            for part in (("head", "step") if method != "dense" else ("step",)):
                print(f"-- {method} compile={comp}: {part}", flush=True)
                print(parts[part][2].key_averages().table(sort_by="cuda_time_total", row_limit=a.rows,
                                                          max_name_column_width=110), flush=True)
        rt.compile, rt._compiled = False, {}


if __name__ == "__main__":
    main()
