#!/usr/bin/env bash
# The decode-throughput table (BENCHMARKS.md, "Decode throughput"; SpeContext Table 5) on one H200, in parts that each
# fit in 10 minutes (model build + transform ~35 s per process, ~30 s of torch.compile per method and
# configuration of our runtime). On a GPU machine without network access:
#   source tools/device_env.sh && bash benchmarks/decode/run_h200.sh PART "$OUT/decode"
# PART: llama-gen (Llama-8B [2k,16k], [2k,32k]: dense, specontext, quest), llama-long (Llama-8B [16k,2k], [32k,2k]),
# qwen-gen, qwen-long (the same for Qwen3-8B), hf-llama, hf-qwen (hf_sdpa at every configuration of the model),
# static (hf_static at [2k,32k], both models: HF compiles there), flashinfer (dense, specontext and flashinfer at [2k,16k] and
# [2k,32k], MODEL=llama-8b or qwen3-8b; needs the FlashInfer bundle: `python tools/flashinfer_bundle/make.py .fi` here, carry
# .fi, and `(cd .fi && bash install.sh --aot) && source .fi/fi_env.sh` there first: --aot installs the prebuilt sm_90a kernels), validate (a whole [2k, 512] run per method against
# the sampled estimate; INPUTS="32768" limits the long parts, METHODS="dense,specontext" the -gen parts), a800 (the
# [2k,32k] row with every method held to an A800's memory, gpu_gb=79.1 GiB, the 79.1-79.3 GiB an A800-80GB gives a
# process; default methods dense, specontext and specontext_offload (KV offload: the memory plan's request count,
# pinned CPU memory up to host_gb, default 3/4 of RAM); GPU_GB= another cap, MODEL= the model, METHODS= the methods,
# e.g. METHODS=hf_sdpa; the full-card row is llama-gen's). Each configuration of a long part runs in its own process (a 32K-token prefill after a
# 49-request job ran out of memory in one process). Parts append to the same out_dir; "vs best dense" compares every
# dense row of the CSV at the same model, configuration and gpu_gb.
set -o pipefail
PART=${1:?part: llama-gen, llama-long, qwen-gen, qwen-long, hf-llama, hf-qwen, static, flashinfer, validate or a800}
OUT_DIR=${2:-out/bench/decode}
bench() {
    python3 -P - "$OUT_DIR" "$@" <<'PY'
import sys

from kvtransform.bench import run

out, args = sys.argv[1], sys.argv[2:]
run("decode", ["-m"] + args + ["samples=4", "steps=64", f"out_dir={out}", "append=true", "plot=false"])
PY
}
ours="method=${METHODS:-dense,specontext,quest}"
case "$PART" in
    llama-gen|qwen-gen)
        model=$([ "$PART" = qwen-gen ] && echo qwen3-8b || echo llama-8b)
        bench "model=$model" input=2048 output=32768,16384 "$ours" ;;
    llama-long|qwen-long)
        model=$([ "$PART" = qwen-long ] && echo qwen3-8b || echo llama-8b)
        for inp in ${INPUTS:-16384 32768}; do bench "model=$model" input=$inp output=2048 method=dense,specontext || exit; done ;;
    hf-llama|hf-qwen)
        model=$([ "$PART" = hf-qwen ] && echo qwen3-8b || echo llama-8b)
        bench "model=$model" input=2048 output=32768,16384 method=hf_sdpa &&
            bench "model=$model" input=16384,32768 output=2048 method=hf_sdpa ;;
    static)
        bench model=llama-8b,qwen3-8b input=2048 output=32768 method=hf_static ;;
    flashinfer)
        python3 -P -c "import flashinfer" || { echo "flashinfer does not import: install the bundle first" >&2; exit 2; }
        bench "model=${MODEL:-llama-8b}" input=2048 output=32768,16384 method=dense,specontext,flashinfer ;;
    a800)
        bench "model=${MODEL:-llama-8b}" input=2048 output=32768 "gpu_gb=${GPU_GB:-79.1}" \
            "method=${METHODS:-dense,specontext,specontext_offload}" ;;
    validate)
        python3 -P -c "from kvtransform.bench import run; import sys; run('decode', ['-m', 'model=llama-8b', \
'input=2048', 'output=512', 'requests=16', 'steps=48', 'validate=true', 'method=dense,specontext,hf_sdpa', \
'out_dir=$OUT_DIR', 'append=true', 'plot=false'])" ;;
    *) echo "unknown part $PART" >&2; exit 2 ;;
esac
