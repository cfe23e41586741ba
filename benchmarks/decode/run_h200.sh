#!/usr/bin/env bash
# The decode-throughput table (BENCHMARKS.md, "Decode throughput"; SpeContext Table 5) on one H200, in parts that each
# fit one device call (< 600 s; model build + transform ~35 s per part). On the lent device:
#   source tools/device_env.sh && bash benchmarks/decode/run_h200.sh PART "$OUT/decode"
# PART: llama-gen (Llama-8B [2k,16k], [2k,32k]: every method but hf_static), llama-long (Llama-8B [16k,2k], [32k,2k]),
# qwen-gen, qwen-long (the same for Qwen3-8B), static (hf_static at [2k,32k], both models: HF compiles there),
# validate (a whole [2k, 512] run per method against the sampled estimate). Parts append to the same out_dir, so the
# "vs best dense" column compares methods of one part (the same process and machine state).
set -o pipefail
PART=${1:?part: llama-gen, llama-long, qwen-gen, qwen-long, static or validate}
OUT_DIR=${2:-out/bench/decode}
python3 -P - "$PART" "$OUT_DIR" <<'PY'
import sys

from kvtransform.bench import run

part, out = sys.argv[1], sys.argv[2]
common = ["samples=4", "steps=16", f"out_dir={out}", "append=true", "plot=false"]
methods = "method=hf_sdpa,dense,specontext,quest"
model = "model=qwen3-8b" if part.startswith("qwen") else "model=llama-8b"
if part.endswith("-gen"):
    run("decode", ["-m", model, "input=2048", "output=32768,16384", methods] + common)
elif part.endswith("-long"):
    run("decode", ["-m", model, "input=16384,32768", "output=2048", methods] + common)
elif part == "static":
    run("decode", ["-m", "model=llama-8b,qwen3-8b", "input=2048", "output=32768", "method=hf_static"] + common)
elif part == "validate":
    run("decode", ["-m", "model=llama-8b", "input=2048", "output=512", "requests=16", "steps=48", "validate=true",
                   "method=dense,specontext,hf_sdpa"] + common[:1] + common[2:])
else:
    sys.exit(f"unknown part {part!r}")
PY
