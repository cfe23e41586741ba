"""Per-kernel GPU times of the prefix-tree op against the DualKV op (torch profiler, CUDA time per call, mean of 5
calls after a warm-up): the forward, dQ, dK/dV and planning kernels on the tree suite's shapes (a 4096-token prompt,
turns of 256-2048 tokens, 4x2x2 and 4x2x2x2; DualKV's one-level P 8192, 16 responses, with ``kvt.dualkv_attention``'s
kernels on the same tokens). bf16, H 32, H_kv 8, D 128. What docs/PREFIX_TREES.md's kernel times come from.

``--steps``: the registered op's whole fwd+bwd step instead (``kvt.prefix_tree_attention`` and, at one level,
``kvt.dualkv_attention``, through autograd as a model calls them): the median of 15 steps each synchronised alone
(CUDA events, two rounds), then 8 steps run back to back under the profiler: GPU kernels per step, the span from the
first kernel's start to the last one's end, and the time some kernel was running ("busy"); span minus busy is what
the GPU waited between kernels. Run it from two installs (``PYTHONPATH``) to compare commits in one session.

    source tools/device_env.sh && python3 -P tools/tree_kernel_profile.py [--steps]
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import kvtransform as kvt
from kvtransform.bench.runner import response_lengths
from kvtransform.bench.tree_shapes import agentic_tree, one_level_tree
from kvtransform.kernels import prefix_tree as pt
from kvtransform.kernels.dualkv import dualkv_bwd, dualkv_fwd
from kvtransform.layout import DualKVLayout

H, H_KV, D = 32, 8, 128


def kernel_ms(fn, calls: int = 5) -> dict:
    """``{kernel name: ms per call}`` of the CUDA kernels ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            out[e.name[:40]] = out.get(e.name[:40], 0.0) + e.device_time_total / calls / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def show(what: str, times: dict) -> None:
    print(f"  {what:14s} " + "  ".join(f"{k} {v:.3f}" for k, v in list(times.items())[:4]), flush=True)


def op_steps(name: str, step) -> None:
    """Print ``step``'s synchronised median (two rounds) and its back-to-back span / busy time (``--steps``)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    medians = []
    for _ in range(2):
        ts = []
        for _ in range(15):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        medians.append(statistics.median(ts))
    n = 8
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    ev = sorted((e for e in p.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    span = (ev[-1].time_range.end - ev[0].time_range.start) / 1e3 / n
    busy = sum(e.time_range.end - e.time_range.start for e in ev) / 1e3 / n
    print(f"  {name:14s} synced median {medians[0]:.2f} / {medians[1]:.2f} ms; back to back: {len(ev) / n:.1f} "
          f"kernels a step, span {span:.2f} ms, busy {busy:.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", action="store_true", help="time the op's whole fwd+bwd step (module docstring)")
    steps = ap.parse_args().steps
    dev = torch.device("cuda")
    responses = response_lengths(16)
    shapes = {"P=8192 mb=16": one_level_tree(8192, responses, device=dev),
              "4x2x2": agentic_tree(4096, [4, 2, 2], (256, 2048), 0, device=dev),
              "4x2x2x2": agentic_tree(4096, [4, 2, 2, 2], (256, 2048), 0, device=dev)}
    scale = D ** -0.5
    for name, lay in shapes.items():
        torch.manual_seed(0)
        t = lay.total_tokens
        q, do = (torch.randn(t, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(t, H_KV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        keys = (lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges)
        if steps:
            print(f"{name}: T {t}, {lay.num_nodes} nodes (fwd+bwd steps of the op)")
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

            def step(op=kvt.prefix_tree_attention, layout=lay):
                qg.grad = kg.grad = vg.grad = None
                op(qg, kg, vg, layout).backward(do)
            op_steps("prefix tree", step)
            if lay.depth <= 2:
                dl = DualKVLayout.from_lengths([(lay.lengths[0], responses)], device=dev)
                op_steps("dualkv", lambda: step(kvt.dualkv_attention, dl))
            continue
        out, lse = pt.prefix_tree_fwd(q, k, v, *keys, scale)
        print(f"{name}: T {t}, {lay.num_nodes} nodes (ms per call)")
        show("tree fwd", kernel_ms(lambda: pt.prefix_tree_fwd(q, k, v, *keys, scale)))
        show("tree bwd", kernel_ms(lambda: pt.prefix_tree_bwd(do, q, k, v, out, lse, *keys, lay.query_range_ptr,
                                                              lay.query_ranges, scale)))
        if lay.depth <= 2:
            dl = DualKVLayout.from_lengths([(lay.lengths[0], responses)], device=dev)
            o2, lse2 = dualkv_fwd(q, k, v, dl.cu_seqlens, dl.segment_prefix, scale)
            show("dualkv fwd", kernel_ms(lambda: dualkv_fwd(q, k, v, dl.cu_seqlens, dl.segment_prefix, scale)))
            show("dualkv bwd", kernel_ms(lambda: dualkv_bwd(do, q, k, v, o2, lse2, dl.cu_seqlens, dl.segment_prefix,
                                                            scale)))


if __name__ == "__main__":
    main()
