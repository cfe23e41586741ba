"""Per-kernel breakdown of one decode step of the SpeContext runtime (CUDA graph replays included) on a GPU.

A decode step is the difference of two ``generate`` calls on the same rows, ``--steps + 4`` and 4 new tokens, both
warmed up first: per CUDA kernel name, (time in the long call - time in the short call) / ``--steps``. The prefill,
the graph capture and the fused-weight refresh are in both calls and cancel. Kernels launched from a CUDA graph
appear under their own names (CUPTI traces graph nodes). The decode suite's model shapes (``--model``, random bf16
weights, ``kvtransform.bench.decode_model``):

    python3 -P tools/decode_step_profile.py --rows 32 --context 9216 --heads-to-profile dense,self
    python3 -P tools/decode_step_profile.py --layers 8 --top 15           # a quicker look
    python3 -P tools/decode_step_profile.py --rows 32 --context 9216 --heads-to-profile dense,self --compile
    python3 -P tools/decode_step_profile.py --gemms --rows 26,32,48       # the step's weight GEMMs alone

Prints, per retrieval head: the step time by CUDA events, its HBM floor (the weights plus the KV and retrieval bytes
the step reads, ``decode_model.step_bytes``, at ``--hbm-tbps``), the sum of kernel times per step, and the ``--top``
kernels with their share (the rest summed into one line), and the step by part (:data:`CATEGORIES`: attention,
retrieval, sampling, GEMMs, small element-wise kernels, other). ``--csv`` writes every kernel row with its part.
``--gemms`` instead times each weight GEMM of a step alone (:func:`gemm_rates`), with cuBLAS and cuBLASLt, against
a device copy in the same process.
"""
from __future__ import annotations

import argparse
import collections
import re
import time

import torch


def kernel_times(fn) -> tuple[dict, float]:
    """``({kernel name: CUDA µs}, wall s)`` of one call of ``fn`` under the profiler (without CUDA: CPU ops' self
    µs, for a smoke run of the tool)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t
    out = collections.Counter()
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for e in prof.events():
        if e.device_type == kind:
            out[e.name] += e.device_time if cuda else e.self_cpu_time_total
    return dict(out), wall


#: kernel-name patterns of the step's parts, first match wins (CUDA names: Triton kernels by their function name,
#: cuBLAS ``nvjet_*`` / CUTLASS / ``splitKreduce``, ATen ``elementwise_kernel`` / ``reduce_kernel`` / copies)
CATEGORIES = (
    ("attention", re.compile(r"sparse_decode|dualkv|prefix_tree|flash|attn|attention|_fwd_kernel|_plan_", re.I)),
    ("retrieval", re.compile(r"retrieval|topk|top_k|sort|radix|select|group_max", re.I)),
    ("sampling", re.compile(r"softmax|multinomial|exponential|argmax|cumsum", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|cublas|splitk|matmul|(^|_)mm(_|$)|bmm|addmm|linear", re.I)),
    ("element-wise", re.compile(r"elementwise|reduce_kernel|copy|cat|index|fill|gather|triton_|aten::|memcpy|memset",
                                re.I)),
)


def category(name: str) -> str:
    """The part of a decode step a kernel belongs to (:data:`CATEGORIES`, else ``other``)."""
    return next((c for c, rx in CATEGORIES if rx.search(name)), "other")


def profile_head(model, a, head: str):
    import kvtransform as kvt

    sp = kvt.transform(model, kvt.SpeContextConfig(budget=a.budget, head=head, compile=a.compile), progress=False)
    ctx = torch.randint(3, model.config.vocab_size, (a.rows, a.context), device=a.device)
    kw = dict(do_sample=True, temperature=1.0, eos_token_id=None, pad_token_id=0, seed=0, progress=False,
              output_logprobs=a.logprobs, return_dict_in_generate=True)
    for n in (4, a.steps + 4):
        sp.generate(ctx, max_new_tokens=n, **kw)
    short = sp.generate(ctx, max_new_tokens=4, **kw).stats
    long_ = sp.generate(ctx, max_new_tokens=a.steps + 4, **kw).stats
    step_ms = (long_.decode_s - short.decode_s) / a.steps * 1e3
    k_short, _ = kernel_times(lambda: sp.generate(ctx, max_new_tokens=4, **kw))
    k_long, _ = kernel_times(lambda: sp.generate(ctx, max_new_tokens=a.steps + 4, **kw))
    per_step = {n: (k_long.get(n, 0.0) - k_short.get(n, 0.0)) / a.steps for n in set(k_long) | set(k_short)}
    per_step = {n: us for n, us in per_step.items() if us > 0.05}
    del sp
    torch.cuda.empty_cache()
    return step_ms, per_step


def _graph_ms(fn, reps: int) -> float:
    """ms of one call of ``fn`` replayed from a CUDA graph (``reps`` replays after a warm-up, CUDA events)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@torch.no_grad()
def gemm_rates(model, rows: int, reps: int = 20, rotate_bytes: float = 6e8) -> list:
    """``[(projection, N, K, µs, TB/s)]`` of a decode step's weight GEMMs at ``rows`` rows (M), each alone through
    ``torch.mm`` under a CUDA graph: q/k/v and gate/up as the runtime fuses them, o, down and the LM head, every
    weight copied until the copies pass ``rotate_bytes`` and the GEMMs cycled through them, so that L2 holds none.
    TB/s counts the weight bytes."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    weights = [("q/k/v", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
               ("o", attn.o_proj.weight), ("gate/up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
               ("down", mlp.down_proj.weight), ("LM head", model.lm_head.weight)]
    out = []
    for name, w in weights:
        n, k = w.shape
        wb = w.numel() * w.element_size()
        copies = [w.clone() for _ in range(max(2, -(-int(rotate_bytes) // wb)))]
        x = torch.randn(rows, k, dtype=w.dtype, device=w.device)
        o = torch.empty(rows, n, dtype=w.dtype, device=w.device)

        def run():
            for c in copies:
                torch.mm(x, c.t(), out=o)

        us = _graph_ms(run, reps) / len(copies) * 1e3
        out.append((name, n, k, us, wb / (us * 1e-6) / 1e12))
    return out


def copy_tbps(nbytes: int = int(1e9)) -> float:
    """TB/s of a copy of ``nbytes`` on the GPU's multiprocessors under a CUDA graph (an element-wise kernel:
    ``copy_`` of a contiguous tensor is a memcpy node the copy engines run, slower), bytes read + written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (_graph_ms(lambda: torch.neg(src, out=dst), 20) * 1e-3) / 1e12


def print_gemms(model, rows_list) -> None:
    """:func:`gemm_rates` with cuBLAS (default) and cuBLASLt for each row count, and a device copy's TB/s (bytes
    read + written) in the same process."""
    print(f"device copy: {copy_tbps():.2f} TB/s (read + write)")
    for rows in rows_list:
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            rates = gemm_rates(model, rows)
            line = ", ".join(f"{n} {us:.1f} µs {tbps:.2f} TB/s" for n, _, _, us, tbps in rates)
            print(f"M={rows} {lib}: {line}; sum {sum(r[3] for r in rates):.1f} µs")
    torch.backends.cuda.preferred_blas_library("cublas")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads-to-profile", default="dense,self", help="comma-separated SpeContextConfig heads")
    p.add_argument("--rows", default="32", help="rows (requests) of the step; --gemms: a comma-separated list")
    p.add_argument("--context", type=int, default=9216)
    p.add_argument("--steps", type=int, default=64, help="decode steps of the long call beyond the short one")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--logprobs", action="store_true", help="return per-token sampling log-probs (as TRL rollouts)")
    p.add_argument("--compile", action="store_true", help="the decode programs through torch.compile "
                   "(SpeContextConfig.compile; both calls share one cache-length bucket, compiled in the warm-up)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--model", default="llama-8b", help="a decode-suite shape (kvtransform.bench.decode_model)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's, for a quick look")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth of the floor (H200: 4.8 TB/s)")
    p.add_argument("--csv", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the tool (--model tiny; CPU ops)")
    p.add_argument("--gemms", action="store_true", help="time the step's weight GEMMs alone (cuBLAS, cuBLASLt)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: the breakdown is of CUDA kernels (--device cpu --model tiny: a smoke run)")
    if a.gemms and a.device != "cuda":
        p.error("--gemms times CUDA graphs of cuBLAS calls: it needs --device cuda")
    try:
        rows_list = [int(r) for r in a.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be an integer (a comma-separated list with --gemms); got {a.rows!r}")
    if len(rows_list) > 1 and not a.gemms:
        p.error("several --rows values are for --gemms; profile one row count at a time")
    a.rows = rows_list[0]
    from kvtransform.bench.decode_model import build_model, model_shape, step_bytes, weight_bytes

    model = build_model(a.model, torch.bfloat16 if a.device == "cuda" else torch.float32, a.device,
                        **({"layers": a.layers} if a.layers else {}))
    if a.gemms:
        return print_gemms(model, rows_list)
    shape = model_shape(model)
    rows = []
    for head in a.heads_to_profile.split(","):
        step_ms, per_step = profile_head(model, a, head)
        total = sum(per_step.values()) / 1e3
        method = {"dense": "dense", "quest": "quest"}.get(head, "specontext")
        floor_ms = (weight_bytes(model) + step_bytes(method, shape, a.rows, a.context, a.context + a.steps + 4,
                                                     a.budget)) / (a.hbm_tbps * 1e12) * 1e3
        print(f"\n[{head}] {a.rows} rows, context {a.context}, budget {a.budget}, {shape['layers']} layers: step "
              f"{step_ms:.2f} ms (CUDA events; HBM floor {floor_ms:.2f} ms at {a.hbm_tbps} TB/s), kernels "
              f"{total:.2f} ms per step")
        parts = collections.Counter()
        for name, us in per_step.items():
            parts[category(name)] += us / 1e3
        print("  by part: " + ", ".join(f"{c} {ms:.2f} ms ({100 * ms / max(total, 1e-9):.0f} %)"
                                         for c, ms in parts.most_common()))
        ranked = sorted(per_step.items(), key=lambda kv: -kv[1])
        for name, us in ranked[:a.top]:
            print(f"  {us / 1e3:7.3f} ms {100 * us / 1e3 / total:5.1f} %  {name[:110]}")
        rest = sum(us for _, us in ranked[a.top:]) / 1e3
        print(f"  {rest:7.3f} ms {100 * rest / max(total, 1e-9):5.1f} %  ({len(ranked) - a.top} more kernels)")
        rows += [(head, name, us) for name, us in ranked]
    if a.csv:
        import csv

        with open(a.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["head", "kernel", "part", "us_per_step"])
            w.writerows((h, n, category(n), us) for h, n, us in rows)


if __name__ == "__main__":
    main()
