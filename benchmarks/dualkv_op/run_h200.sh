#!/usr/bin/env bash
# Reproduces the DualKV attention-op numbers (BENCHMARKS.md, section "DualKV attention op") on one H200: bf16 kernel
# checks, a launch-config sweep at each shape, then ours (op and raw kernels), FlexAttention and FA2 on the paper's
# Table 1 shapes.
# On a GPU machine without network access:  source tools/device_env.sh && KVT_COMMIT=<sha> bash benchmarks/dualkv_op/run_h200.sh "$OUT/dualkv_op"
set -o pipefail
OUT_DIR=${1:-out/bench/dualkv-attn}
python3 -P -m kvtransform.bench dualkv-attn -m P=4096,8192,16384,32768 mb=8,16 kernel_check=true tune=true \
    time_budget_s=3 "out_dir=$OUT_DIR"
