# source this:  source fi_env.sh
# Environment for FlashInfer 0.7.4 JIT on a GPU machine without network access (sm_90).
SITE="${SITE:-/tmp/site}"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}"  # JIT cache: $BASE/.cache/flashinfer/0.7.4/90a/{generated,cached_ops}
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0}"        # 0.7.4 maps 9.0 -> sm_90a (-gencode=arch=compute_90a,code=sm_90a)
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"                  # not read by FlashInfer 0.7.4; only torch cpp_extension (tvm-ffi addon fallback)
export MAX_JOBS="${MAX_JOBS:-16}"                                           # ninja -j for FlashInfer JIT builds
export TVM_FFI_CACHE_DIR="${TVM_FFI_CACHE_DIR:-$FLASHINFER_WORKSPACE_BASE/tvm-ffi}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"

# FlashInfer runs `ninja` from PATH and links with `c++` (or $CXX).
if ! command -v ninja >/dev/null 2>&1 && [[ -x /opt/torch/.venv/bin/ninja ]]; then export PATH="/opt/torch/.venv/bin:$PATH"; fi
command -v ninja >/dev/null 2>&1 || echo "fi_env.sh: WARNING: ninja not on PATH; JIT builds will fail" >&2
command -v "${CXX:-c++}" >/dev/null 2>&1 || echo "fi_env.sh: WARNING: ${CXX:-c++} not on PATH; JIT builds will fail" >&2

# FlashInfer finds CUDA as $CUDA_HOME, else dirname(dirname(which nvcc)); it links with
#   -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda
# A pip-style toolkit (nvidia/cu13/{bin,lib}) has no lib64/, no unversioned libcudart.so and no
# libcuda stub, so provide them through a shim dir added with FLASHINFER_EXTRA_LDFLAGS.
if [[ -z "${CUDA_HOME:-}" ]]; then
  _nvcc="$(command -v nvcc || true)"
  if [[ -n "$_nvcc" ]]; then export CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$_nvcc")")")"; fi
fi
if [[ -z "${CUDA_HOME:-}" || ! -x "$CUDA_HOME/bin/nvcc" ]]; then
  echo "fi_env.sh: WARNING: nvcc not found (CUDA_HOME='${CUDA_HOME:-}'); JIT builds will fail (AOT modules still work)" >&2
else
  _shim="$FLASHINFER_WORKSPACE_BASE/cuda_link_shim"; mkdir -p "$_shim"
  if [[ ! -e "$CUDA_HOME/lib64/libcudart.so" ]]; then
    _rt="$(ls "$CUDA_HOME"/lib64/libcudart.so.* "$CUDA_HOME"/lib/libcudart.so* "$CUDA_HOME"/targets/x86_64-linux/lib/libcudart.so* 2>/dev/null | head -1 || true)"
    if [[ -n "$_rt" ]]; then ln -sf "$_rt" "$_shim/libcudart.so"; fi
  fi
  if [[ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]]; then
    # any libcuda works for linking (the JIT .so does not even end up NEEDing it); prefer the driver's
    _cu="${LIBCUDA:-$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')}"
    if [[ -z "$_cu" ]]; then
      _cu="$(ls "$CUDA_HOME"/lib/stubs/libcuda.so "$CUDA_HOME"/targets/x86_64-linux/lib/stubs/libcuda.so /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/local/nvidia/lib64/libcuda.so.1 2>/dev/null | head -1 || true)"
    fi
    if [[ -n "$_cu" ]]; then ln -sf "$_cu" "$_shim/libcuda.so"; fi
  fi
  if [[ -n "$(ls -A "$_shim")" ]]; then
    export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:+$FLASHINFER_EXTRA_LDFLAGS }-L$_shim"
  fi
  echo "fi_env.sh: CUDA_HOME=$CUDA_HOME  nvcc=$("$CUDA_HOME/bin/nvcc" --version | grep -o 'release [0-9.]*')  shim=[$(ls "$_shim" | tr '\n' ' ')]" >&2
fi
