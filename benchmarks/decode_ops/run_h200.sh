#!/usr/bin/env bash
# Reproduces the decode-ops numbers (BENCHMARKS.md, section "SpeContext decode ops") on one H200: bf16 kernel
# checks, the gather-kernel and retrieval-scoring launch-config sweeps, then every op at each S, copy bandwidth
# measured in the same run.
# On a GPU machine without network access:  source tools/device_env.sh && KVT_COMMIT=<sha> bash benchmarks/decode_ops/run_h200.sh "$OUT/decode_ops"
# Elsewhere (a CUDA machine with kvtransform installed): bash benchmarks/decode_ops/run_h200.sh out/bench/decode-ops
set -o pipefail
OUT_DIR=${1:-out/bench/decode-ops}
SEQLENS=${SEQLENS:-4096,16384,32768}
python3 -P -m kvtransform.bench decode-ops -m "S=$SEQLENS" kernel_check=true tune=small retrieval_tune=true \
    "out_dir=$OUT_DIR"
