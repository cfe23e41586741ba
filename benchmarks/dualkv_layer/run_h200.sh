#!/usr/bin/env bash
# Reproduces benchmarks/dualkv_layer/ on one H200 (BENCHMARKS.md, section "DualKV layer").
# On a GPU machine without network access:  source tools/device_env.sh && bash benchmarks/dualkv_layer/run_h200.sh "$OUT/dualkv_layer"
# Elsewhere (a CUDA machine with kvtransform installed): bash benchmarks/dualkv_layer/run_h200.sh out/bench/dualkv-layer
# The three sweeps run in one process (baselines and ours in the same run; FlexAttention compiled once). Equivalent:
#   kvtransform bench dualkv-layer -m P=5059,8192,16384,32768 mb=4,8,16 time_budget_s=3 out_dir=DIR
#   kvtransform bench dualkv-layer -m P=65536 mb=4,16 method=flex,flex_rebuild,dualkv time_budget_s=3 append=true out_dir=DIR
#   kvtransform bench dualkv-layer -m P=131072 mb=8 method=flex,flex_rebuild,dualkv time_budget_s=3 append=true out_dir=DIR
set -o pipefail
OUT_DIR=${1:-out/bench/dualkv-layer}
python3 -P - "$OUT_DIR" <<'PY'
import sys

from kvtransform.bench import run

out = sys.argv[1]
common = ["time_budget_s=3", f"out_dir={out}"]
run("dualkv-layer", ["-m", "P=5059,8192,16384,32768", "mb=4,8,16"] + common)
# 65K / 131K: the replicated (fa2) and padded (pg) baselines need 45-170 GB and seconds per step there; only the
# packed methods run (the paper's FA2/PG columns are OOM on these rows too).
run("dualkv-layer", ["-m", "P=65536", "mb=4,16", "method=flex,flex_rebuild,dualkv", "append=true"] + common)
run("dualkv-layer", ["-m", "P=131072", "mb=8", "method=flex,flex_rebuild,dualkv", "append=true"] + common)
PY
