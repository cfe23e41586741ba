#!/usr/bin/env bash
# Install the trimmed FlashInfer 0.7.4 bundle into $SITE (default /tmp/site). No network needed.
# usage: bash install.sh [--aot]      (--aot also unpacks prebuilt sm_90a modules, flashinfer-0.7.4-aot-*.tar.xz,
#   when you built them yourself: make.py does not; without them FlashInfer JIT-compiles on first use)
set -euo pipefail
B="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PY:-/opt/torch/.venv/bin/python3}"
SITE="${SITE:-/tmp/site}"
mkdir -p "$SITE"

# 1. apache-tvm-ffi (FlashInfer's binding layer; cp312 manylinux_2_28 wheel)
"$PY" -m pip install --no-index --no-deps --target "$SITE" "$B"/apache_tvm_ffi-0.1.15.post2-cp312-cp312-*.whl

# 2. tvm-ffi needs typing_extensions>=4.13 (uses get_annotations); torch only guarantees >=4.10.
if ! "$PY" -c "from typing_extensions import get_annotations" 2>/dev/null; then
  echo "installed typing_extensions too old -> installing bundled 4.16.0 into $SITE"
  "$PY" -m pip install --no-index --no-deps --target "$SITE" "$B"/typing_extensions-4.16.0-py3-none-any.whl
fi

# 3. trimmed flashinfer-python 0.7.4 (flashinfer/, b12x/, dist-info) -- python's tarfile, no xz binary needed
"$PY" - "$B/flashinfer_python-0.7.4-trimmed.tar.xz" "$SITE" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    t.extractall(sys.argv[2], **kw)
EOF

# 4. optional: prebuilt sm_90a AOT modules (bf16, head_dim 128) -> $SITE/flashinfer/data/aot/
if [[ "${1:-}" == "--aot" ]]; then
  "$PY" - "$B/flashinfer-0.7.4-aot-sm90a-bf16-hd128-optional.tar.xz" "$SITE" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as t:
    kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    t.extractall(sys.argv[2], **kw)
EOF
  echo "AOT modules installed under $SITE/flashinfer/data/aot"
fi
echo "installed into $SITE"
