"""Prefix-tree attention on the GPU (Tree Training, arXiv 2511.00413; the kernels generalise DualKV's, arXiv
2605.15422, to any depth): a thin wrapper around the benchmark package. Run on the H200 from the repository root:

    source tools/device_env.sh && python3 -P tools/prefix_tree_gpu_check.py [--quick] [--skip-check] [--no-timing] \
        [--window N] [--softcap C] [--sinks] [tree-attn overrides ...]

1. **Numerics**: :func:`kvtransform.bench.checks_tree.check_prefix_tree_kernels` (what ``kernel_check=true`` of the
   ``tree-attn`` suite runs): forward and backward of the Triton kernels against a float64 reference, bf16 and fp16,
   trees of depth 1-7 with odd node lengths; ``--quick`` checks two of the five trees; ``--window``, ``--softcap``,
   ``--sinks``: with those attention variants (Gemma 2/3, gpt-oss), the sinks' gradient included.
2. **Timing**: ``kvtransform bench tree-attn`` (default: the agentic shape, a 4096-token prompt, turns branching
   4x2x2 ways, 256-2048 tokens each; ``kvt_tree``, ``flex_tree``, ``flat``), written under ``$OUT/tree_attn`` (or
   ``out/bench/tree-attn``); extra arguments are the suite's overrides (``fanout=4x2x2x2``, ``method=kvt_tree``).

Exit status 1 when a check fails, 2 without CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two numerics trees instead of five")
    ap.add_argument("--skip-check", action="store_true", help="timing only")
    ap.add_argument("--no-timing", action="store_true", help="numerics only")
    ap.add_argument("--window", type=int, default=None, help="check the kernels with this sliding window")
    ap.add_argument("--softcap", type=float, default=None, help="check the kernels with this logit soft-cap")
    ap.add_argument("--sinks", action="store_true", help="check the kernels with random per-head sinks")
    ap.add_argument("overrides", nargs="*", help="tree-attn overrides (key=value)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("prefix_tree_gpu_check: needs a CUDA device", file=sys.stderr)
        return 2
    from kvtransform.bench import run
    from kvtransform.bench.checks_tree import check_prefix_tree_kernels

    t0 = time.perf_counter()
    torch.manual_seed(0)
    ok = True
    if not args.skip_check:
        variants = {"window": args.window, "softcap": args.softcap, "sinks": args.sinks or None}
        ok, worst = check_prefix_tree_kernels(torch.device("cuda"), cases=(0, 1) if args.quick else None,
                                              variants=variants)
        print(f"# numerics {'passed' if ok else 'FAILED'}, worst {worst:.3f} of bound "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if not args.no_timing:
        out = os.path.join(os.environ["OUT"], "tree_attn") if os.environ.get("OUT") else "out/bench/tree-attn"
        run("tree-attn", [f"out_dir={out}"] + list(args.overrides))
    print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
