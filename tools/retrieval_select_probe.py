"""Probe: the retrieval head's per-step selection (scoring + top-k) at decode-suite shapes on the GPU, with a
correctness check of every path against another. Run on the device:
``source tools/device_env.sh && python3 -P tools/retrieval_select_probe.py [BATCHES] [LENGTHS]`` (comma-separated)

For each batch and row length (every row the same length, the cache ``S`` = 34,816 slots as the [2k, 32k] suite
allocates; H_r 32 / H_kv 8, D 128, budget 2048, bf16 keys): ms per call (CUDA-graph replays, median) of
``retrieval_scores_triton`` and of ``select_topk`` sorted and unordered. Checks, printed as ``ok``/``MISMATCH``: the
two top-k orders return the same multiset of scores, no repeated or out-of-range position; the scores equal an fp64
reference on a small case with ragged lengths; ``sparse_decode_attention`` over strided q/k_new/v_new views (as the
decode program passes them) equals the same call over contiguous copies, bit for bit.
"""
import json
import sys

import torch

from kvtransform.bench.timing import percentile, time_steps
from kvtransform.kernels.retrieval import retrieval_scores_reference, retrieval_scores_triton, select_topk
from kvtransform.kernels.sparse_decode import sparse_decode_triton


def bench(fn, reps=40):
    """Median ms per call of ``fn``: CUDA-graph replays of repeated calls."""
    return percentile([t[0] for t in time_steps(lambda mark: fn(), "cuda", 3, reps, cuda_graph=True)], 50)


def same_selection(a, b, scores):
    """a, b int32 (batch, H_kv, B): the same multiset of selected scores, no repeats, -1 only as padding."""
    for x in (a, b):
        v = x.long()
        srt = torch.sort(v, -1).values
        dup = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any().item()
        if dup or (v >= scores.shape[-1]).any().item():
            return False
    def vals(x):
        v = x.long()
        g = torch.gather(scores, 2, v.clamp(min=0))
        g = torch.where(v >= 0, g, torch.full_like(g, float("-inf")))
        return torch.sort(g, -1).values
    return torch.equal(vals(a), vals(b))


def main():
    dev = torch.device("cuda")
    h, hk, d, s, bud = 32, 8, 128, 34816, 2048
    batches = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "23,26,44,49").split(",")]
    lengths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "2049,12948,23848,34747").split(",")]
    ok = True
    # fp64 reference of the scores, small case with ragged lengths
    q = torch.randn(3, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(3, hk, 4000, d, device=dev, dtype=torch.bfloat16)
    lens = torch.tensor([0, 1500, 4000], device=dev, dtype=torch.int32)
    got = retrieval_scores_triton(q, k, lens, d ** -0.5, 4, 16)
    ref = retrieval_scores_reference(q, k, lens, d ** -0.5, 4, 16)
    fin = torch.isfinite(ref)
    good = torch.equal(torch.isfinite(got), fin) and torch.equal(got.isinf(), ref.isinf()) and \
        (got[fin].double() - ref[fin]).abs().max().item() < 2e-2
    ok &= good
    print("scores vs fp64:", "ok" if good else "MISMATCH", flush=True)
    # strided views into the decode kernel (bitwise against contiguous copies)
    fused = torch.randn(4, (h + 2 * hk) * d, device=dev, dtype=torch.bfloat16)
    qv, kn, vn = (t.view(4, -1, d) for t in fused.split([h * d, hk * d, hk * d], dim=-1))
    kc = torch.randn(4, hk, 3000, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    ln = torch.tensor([5, 100, 2999, 3000], device=dev, dtype=torch.int32)
    ix = torch.sort(torch.randint(0, 3000, (4, hk, 256), device=dev, dtype=torch.int32), -1).values % ln[:, None, None]
    for idx in (None, ix):
        a = sparse_decode_triton(qv, kc, vc, idx, ln, kn, vn)
        b = sparse_decode_triton(qv.contiguous(), kc, vc, idx, ln, kn.contiguous(), vn.contiguous())
        good = torch.equal(a, b)
        ok &= good
        print(f"strided q/k_new/v_new ({'slot' if idx is None else 'gather'}):", "ok" if good else "MISMATCH",
              flush=True)
    kbig = torch.randn(max(batches), hk, s, d, device=dev, dtype=torch.bfloat16)
    for b in batches:
        q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
        k = kbig[:b]
        for n in lengths:
            lens = torch.full((b,), n, device=dev, dtype=torch.int32)
            scores = retrieval_scores_triton(q, k, lens, d ** -0.5, 4, 16)
            good = same_selection(select_topk(scores, bud), select_topk(scores, bud, ordered=False), scores)
            ok &= good
            row = {"batch": b, "length": n, "check": "ok" if good else "MISMATCH",
                   "scores_ms": round(bench(lambda: retrieval_scores_triton(q, k, lens, d ** -0.5, 4, 16)), 4),
                   "topk_sorted_ms": round(bench(lambda: select_topk(scores, bud)), 4),
                   "topk_unordered_ms": round(bench(lambda: select_topk(scores, bud, ordered=False)), 4)}
            print(json.dumps(row), flush=True)
    print("ALL OK" if ok else "SOME CHECK FAILED", flush=True)


if __name__ == "__main__":
    main()
