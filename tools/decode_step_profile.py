"""Where the time of one SpeContext decode step goes on the GPU (the evidence behind the decode-throughput section
of BENCHMARKS.md). Run on the device from the repository root:

    source tools/device_env.sh && python3 -P tools/decode_step_profile.py [--model llama-8b] [--requests 16]
        [--context 16384]

For ``dense`` and ``specontext`` (random distilled head) on a random-weight model of the shape: the CUDA-graph step
time (eager program and ``torch.compile``d program), its HBM floor, and a ``torch.profiler`` table of one eager step
(kernel count and the kernels that take the time).
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
    ap.add_argument("--methods", default="dense,specontext")
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(a.model, torch.bfloat16, dev)
    shape = _shape(model)
    bw = copy_bandwidth(dev)
    wb = weight_bytes(model)
    t0 = time.perf_counter()
    ours = _Ours(model, SimpleNamespace(budget=a.budget, cuda_graphs=True, compile=False))
    print(f"transform {time.perf_counter() - t0:.1f} s; copy bandwidth {bw / 1e12:.2f} TB/s; weights {wb / 1e9:.2f} GB",
          flush=True)
    max_len = a.context + 64
    cache = _random_cache(shape, a.requests, max_len, torch.bfloat16, dev, 0)
    for method in a.methods.split(","):
        rt = ours.runtime(method)
        read = wb + step_bytes(method, shape, a.requests, a.context, max_len, a.budget)
        floor = 1000 * read / bw
        for comp in ((False,) if a.no_compile else (False, True)):
            rt.compile, rt._compiled = comp, {}
            t0 = time.perf_counter()
            _time_ours(rt, cache, [a.context], 4, 4, dev)  # warm-up (compile)
            warm = time.perf_counter() - t0
            ms = _time_ours(rt, cache, [a.context], 4, 32, dev)[0]
            print(f"{method:10s} compile={comp!s:5s} {ms:7.2f} ms/step  floor {floor:6.2f} ms ({ms / floor:.2f}x)  "
                  f"warm-up {warm:.1f} s", flush=True)
        rt.compile, rt._compiled = False, {}
        # one eager step under the profiler: kernels and their time
        from torch.profiler import ProfilerActivity, profile

        cache.cache_seqlens.fill_(a.context)
        rt.head.prefill(cache)
        tok = torch.randint(3, shape["vocab"], (a.requests,), device=dev)
        with torch.no_grad():
            sel = rt.head.step(cache, None)
            rt.decode(cache, tok, sel)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                cache.set_current(tok)
                sel = rt.head.step(cache, None)
                rt.decode(cache, tok, sel)
                torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time for e in ev) / 1000
        print(f"{method}: eager step {len(ev)} kernels, {total:.2f} ms of kernel time", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
