"""On CUDA: the registered ops called directly (as a transformed graph calls them, past the validating wrappers)
with inconsistent inputs either refuse them on the device or compute the documented masked result, never touching
memory outside their tensors. Run it on a GPU after changing an op's input checks or a kernel's indexing, under
``compute-sanitizer --tool memcheck`` to prove the last part:

    source tools/device_env.sh && compute-sanitizer --tool memcheck python3 -P tools/gpu_op_guards.py

Exit status 0 when every check passes; one line per check.
"""
from __future__ import annotations

import subprocess
import sys

import torch

import kvtransform  # noqa: F401  registers torch.ops.kvt.*
from kvtransform.kernels.sparse_decode import sparse_decode_reference

_BAD_LAYOUT = """
import torch, kvtransform
t = {t}
q = torch.randn(t, 4, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(t, 1, 64, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 8, 16], dtype=torch.int32, device="cuda")
sp = torch.tensor([-1, 0], dtype=torch.int32, device="cuda")
out = torch.ops.kvt.dualkv_attention(q, k, k, cu, sp, 0.125)
torch.cuda.synchronize()
print("NO ERROR")
"""


def main() -> int:
    dev = torch.device("cuda")
    ok = True
    gen = torch.Generator(device=dev).manual_seed(0)

    def report(name, passed, detail=""):
        nonlocal ok
        ok &= bool(passed)
        print(f"{'ok  ' if passed else 'FAIL'} {name} {detail}")

    # 1. sparse decode: indices past cache_seqlens / S_max, negative, and cache_seqlens > S_max or < 0
    b, h, h_kv, s, d, budget = 3, 8, 2, 257, 128, 64
    q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(b, h_kv, s, d, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    kn = torch.randn(b, h_kv, d, device=dev, dtype=torch.bfloat16, generator=gen)
    vn = torch.randn_like(kn)
    lens = torch.tensor([200, 10_000, -5], dtype=torch.int32, device=dev)
    idx = torch.randint(-50, 2 * s, (b, h_kv, budget), device=dev, dtype=torch.int32, generator=gen)
    idx[0, 0, :4] = torch.tensor([2**30, -2**30, s, s - 1], dtype=torch.int32)
    out = torch.ops.kvt.sparse_decode_attention(q, kc, vc, idx, lens, kn, vn, d ** -0.5)
    ref = sparse_decode_reference(q.float(), kc.float(), vc.float(), idx, lens, kn.float(), vn.float(), d ** -0.5)
    err = float((out.float() - ref.float()).abs().max())
    report("sparse_decode_attention: out-of-range indices and lengths are masked", torch.isfinite(out).all() and
           err < 2e-2, f"(max abs error vs masked reference {err:.2e})")
    # 2. retrieval top-k with cache_seqlens beyond S_max and negative
    sel = torch.ops.kvt.retrieval_topk(q, kc, lens, budget, 0, 0, d ** -0.5)
    in_range = bool(((sel >= -1) & (sel < s)).all())
    report("retrieval_topk: cache_seqlens clamped to [0, S_max]", in_range and bool((sel[2] == -1).all()),
           f"(indices within [-1, {s}); empty row all -1: {bool((sel[2] == -1).all())})")
    # 3. dualkv: a layout inconsistent with T is a device-side assert (in a child process: it poisons the context)
    for t in (18, 14):
        proc = subprocess.run([sys.executable, "-P", "-c", _BAD_LAYOUT.format(t=t)], capture_output=True, text=True)
        refused = proc.returncode != 0 and "NO ERROR" not in proc.stdout
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:120]
        report(f"dualkv_attention: cu_seqlens[-1]=16 with T={t} refused on the device", refused, f"({tail})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
