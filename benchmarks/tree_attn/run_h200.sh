#!/usr/bin/env bash
# Prefix-tree attention on one H200 (Tree Training, arXiv 2511.00413; DualKV, arXiv 2605.15422): the bf16/fp16 kernel
# checks, then ours (kvt_tree) against FlexAttention with the tree block mask (compiled per shape) and the flattened
# trajectories (varlen_attn, else SDPA per trajectory: the row's impl says which) on agentic trees, DualKV's one-level
# shape (with kvt.dualkv_attention), and the Qwen3-8B-shaped layer on the 4x2x2 tree. Budget: under 8 minutes.
# On a GPU machine without network access:  source tools/device_env.sh && KVT_COMMIT=<sha> bash benchmarks/tree_attn/run_h200.sh "$OUT/tree_attn"
# Elsewhere (a CUDA machine with kvtransform installed): bash benchmarks/tree_attn/run_h200.sh out/bench/tree-attn
# All in one process, into one CSV. Equivalent:
#   kvtransform bench tree-attn -m prompt=4096 fanout=4x2x2,4x2x2x2 turn_min=256 turn_max=2048 kernel_check=true time_budget_s=3 out_dir=DIR
#   kvtransform bench tree-attn shape=one_level P=8192 mb=16 time_budget_s=3 append=true out_dir=DIR
#   kvtransform bench tree-layer prompt=4096 fanout=4x2x2 time_budget_s=3 append=true out_dir=DIR
set -o pipefail
OUT_DIR=${1:-out/bench/tree-attn}
python3 -P - "$OUT_DIR" <<'PY'
import sys
import time

from kvtransform.bench import run

out = sys.argv[1]
common = ["time_budget_s=3", f"out_dir={out}"]
t0 = time.perf_counter()
failed = None
try:  # a failed kernel check raises after its CSV is written: the timings still run, the script still fails
    run("tree-attn", ["-m", "prompt=4096", "fanout=4x2x2,4x2x2x2", "turn_min=256", "turn_max=2048",
                      "kernel_check=true"] + common)
except RuntimeError as e:
    failed = e
print(f"# agentic trees done at {time.perf_counter() - t0:.0f} s", flush=True)
run("tree-attn", ["shape=one_level", "P=8192", "mb=16", "append=true"] + common)
print(f"# one-level done at {time.perf_counter() - t0:.0f} s", flush=True)
run("tree-layer", ["prompt=4096", "fanout=4x2x2", "append=true"] + common)
print(f"# total {time.perf_counter() - t0:.0f} s", flush=True)
if failed is not None:
    raise SystemExit(f"kernel checks failed: {failed}")
PY
