"""Smoke test for the trimmed FlashInfer 0.7.4 bundle on an H200 (sm_90).

Run it on the GPU machine after installing a bundle (before the decode suite's flashinfer method), after
`source fi_env.sh`:  python3 smoke_test.py [--no-tc] [--no-graph] [--small-pages P]
Checks BatchDecodeWithPagedKVCacheWrapper (HND, one page per request, page_size=S, bf16,
GQA 32/8, head_dim 128) against a float32 torch reference, eager and CUDA-graph, CUDA-core
decode and tensor-core decode (use_tensor_cores=True).

--small-pages P (optional, experimental): FlashInfer's scheduler splits KV only at page
granularity, so page_size=S with one page per request gives just B*Hkv CTAs (no split-KV).
This re-describes the SAME (B, Hkv, S, D) memory as pages of P tokens through an as_strided
view (page stride P*D, head stride S*D) and checks/times that too.
"""

import math
import os
import sys
import time

import torch

t0 = time.time()
import flashinfer  # noqa: E402

print(f"flashinfer {flashinfer.__version__} from {flashinfer.__file__} (import {time.time() - t0:.1f}s)")
import tvm_ffi  # noqa: E402

print(f"tvm_ffi {tvm_ffi.__version__}; torch {torch.__version__} cuda {torch.version.cuda}; "
      f"torch.Tensor.__dlpack_c_exchange_api__: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
from flashinfer.jit import env as jit_env  # noqa: E402

print(f"JIT dir: {jit_env.FLASHINFER_JIT_DIR}")
print(f"device: {torch.cuda.get_device_name()} cc={torch.cuda.get_device_capability()}")

B, Hq, Hkv, D, S = 8, 32, 8, 128, 4096
LAST = 3000
dev = "cuda"
torch.manual_seed(0)
k = torch.randn(B, Hkv, S, D, dtype=torch.bfloat16, device=dev)  # (num_pages, Hkv, page_size, D), HND
v = torch.randn_like(k)
q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device=dev)


def reference(q, k, v, lens):
    """GQA attention, softmax scale 1/sqrt(D), request b attends to keys [0, lens[b])."""
    G = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=dev)
    for b in range(B):
        L = int(lens[b])
        kb = k[b, :, :L].float().repeat_interleave(G, dim=0)  # (Hq, L, D)
        vb = v[b, :, :L].float().repeat_interleave(G, dim=0)
        s = torch.einsum("hd,hld->hl", q[b].float(), kb) / math.sqrt(D)
        out[b] = torch.einsum("hl,hld->hd", torch.softmax(s, dim=-1), vb)
    return out


def check(name, o, lens):
    ref = reference(q, k, v, lens)
    rel = ((o.float() - ref).norm() / ref.norm()).item()
    mx = (o.float() - ref).abs().max().item()
    wrong = reference(q, k, v, [S] * B)  # what a kernel ignoring last_page_len would give
    rel_wrong = ((o.float() - wrong).norm() / wrong.norm()).item()
    ok = rel < 1e-2 and mx < 2e-2 and o.shape == (B, Hq, D) and o.dtype == torch.bfloat16
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: rel_err={rel:.2e} max_abs={mx:.2e} "
          f"(vs all-{S}-keys ref: {rel_wrong:.2e})")
    return ok


def time_it(fn, iters=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / iters * 1e3  # us


indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
indices = torch.arange(B, dtype=torch.int32, device=dev)
last = torch.full((B,), LAST, dtype=torch.int32, device=dev)
ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
plan_kw = dict(pos_encoding_mode="NONE", data_type=torch.bfloat16, q_data_type=torch.bfloat16)
all_ok = True
modes = [False] + ([] if "--no-tc" in sys.argv else [True])

for tc in modes:
    tag = "tensor-core" if tc else "cuda-core"
    # ---- eager (the snippet from the brief) ----
    t = time.time()
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND", use_tensor_cores=tc)
    w.plan(indptr, indices, last, Hq, Hkv, D, S, **plan_kw)
    o = w.run(q, (k.unsqueeze(1).squeeze(1), v))
    torch.cuda.synchronize()
    print(f"{tag}: first plan+run {time.time() - t:.1f}s (includes JIT build if not cached); "
          f"backend={w.resolved_backend}")
    all_ok &= check(f"{tag} eager", o, [LAST] * B)
    print(f"  {tag} eager run: {time_it(lambda: w.run(q, (k, v))):.1f} us/call")

    if "--no-graph" in sys.argv:
        continue
    # ---- CUDA graph: fixed indptr/indices/last_page_len buffers ----
    indptr_buf = torch.empty(B + 1, dtype=torch.int32, device=dev)
    indices_buf = torch.empty(B, dtype=torch.int32, device=dev)
    last_buf = torch.empty(B, dtype=torch.int32, device=dev)
    ws_g = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wg = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws_g, kv_layout="HND", use_cuda_graph=True, use_tensor_cores=tc,
        paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
        paged_kv_last_page_len_buffer=last_buf)
    wg.plan(indptr, indices, last, Hq, Hkv, D, S, **plan_kw)
    o_static = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture
            wg.run(q, (k, v), out=o_static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        wg.run(q, (k, v), out=o_static)
    g.replay()
    torch.cuda.synchronize()
    all_ok &= check(f"{tag} cuda-graph replay", o_static, [LAST] * B)
    # re-plan with new (ragged) lengths, same batch size, replay the SAME graph
    new_lens = [1 + (997 * (i + 1)) % S for i in range(B)]
    wg.plan(indptr, indices, torch.tensor(new_lens, dtype=torch.int32, device=dev), Hq, Hkv, D, S, **plan_kw)
    g.replay()
    torch.cuda.synchronize()
    all_ok &= check(f"{tag} cuda-graph replay after re-plan {new_lens}", o_static, new_lens)
    print(f"  {tag} graph replay: {time_it(g.replay):.1f} us/call")

if "--small-pages" in sys.argv:
    P = int(sys.argv[sys.argv.index("--small-pages") + 1])
    NP = S // P
    assert S % P == 0
    n_pages_total = (B - 1) * Hkv * NP + NP  # last valid page index + 1 within k's storage
    kp = torch.as_strided(k, (n_pages_total, Hkv, P, D), (P * D, S * D, D, 1))
    vp = torch.as_strided(v, (n_pages_total, Hkv, P, D), (P * D, S * D, D, 1))
    n = -(-LAST // P)
    indptr_s = torch.arange(B + 1, dtype=torch.int32, device=dev) * n
    indices_s = (torch.arange(B, device=dev)[:, None] * (Hkv * NP)
                 + torch.arange(n, device=dev)[None, :]).to(torch.int32).flatten()
    last_s = torch.full((B,), LAST - (n - 1) * P, dtype=torch.int32, device=dev)
    for tc in modes:
        tag = f"small-pages P={P} {'tensor-core' if tc else 'cuda-core'}"
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND", use_tensor_cores=tc)
            w.plan(indptr_s, indices_s, last_s, Hq, Hkv, D, P, **plan_kw)
            o = w.run(q, (kp, vp))
            torch.cuda.synchronize()
            all_ok &= check(tag, o, [LAST] * B)
            print(f"  {tag} eager run: {time_it(lambda: w.run(q, (kp, vp))):.1f} us/call")
        except Exception as e:  # optional path: report, do not hide
            all_ok = False
            print(f"[FAIL] {tag}: {type(e).__name__}: {e}")

print("ALL PASS" if all_ok else "SOME FAILED")
sys.exit(0 if all_ok else 1)
