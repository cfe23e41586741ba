"""Probe: the gather-mode ``kvt::sparse_decode_attention`` kernel (SpeContext's per-layer attention over the selected
tokens) over launch configs at decode-suite shapes. Run on the device:
``source tools/device_env.sh && python3 -P tools/gather_split_probe.py [BATCHES [OUT.json]] [--order]``
(``--order``: only the default config, over one selection in score order and sorted by position)."""
import itertools
import json
import sys

import torch

from kvtransform.bench.timing import percentile, time_steps
from kvtransform.kernels.sparse_decode import default_config, sparse_decode_triton


def bench(fn, reps=40):
    """Median ms per call of ``fn``: CUDA-graph replays of repeated calls (the suites' timing loop)."""
    return percentile([t[0] for t in time_steps(lambda mark: fn(), "cuda", 3, reps, cuda_graph=True)], 50)


ORDER = "--order" in sys.argv      # only the default config, score order against position order
SORTED = "--sorted" in sys.argv    # the sweep over position-ordered selections (what the runtime passes)
SMALL = "--small" in sys.argv      # BLOCK_N 64/128 x splits 1, 2, 3, 4, 6; 4 warps, 2 stages
for flag in ("--order", "--sorted", "--small"):
    if flag in sys.argv:
        sys.argv.remove(flag)


def main():
    dev = torch.device("cuda")
    h, hk, d, s, bud = 32, 8, 128, 34816, 2048
    out = []
    for b in map(int, (sys.argv[1] if len(sys.argv) > 1 else "22,25,26,43,48").split(",")):
        ks = [torch.randn(b, hk, s, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        vs = [torch.randn_like(k) for k in ks]
        q = torch.randn(b, h, d, device=dev, dtype=torch.bfloat16)
        kn, vn = torch.randn(b, hk, d, device=dev, dtype=torch.bfloat16), torch.randn(b, hk, d, device=dev,
                                                                                        dtype=torch.bfloat16)
        lens = torch.full((b,), s - 64, device=dev, dtype=torch.int32)
        idx = torch.argsort(torch.rand(b, hk, s - 64, device=dev), -1)[..., :bud].to(torch.int32).contiguous()
        if SORTED:
            idx = torch.sort(idx, -1).values.contiguous()
        gb = b * hk * bud * d * 2 * 2 / 1e9
        ref = sparse_decode_triton(q, ks[0], vs[0], idx, lens, kn, vn)
        default = default_config(bud, b * hk, dev, True, d, 2)
        res = {"batch": b, "default": default}
        if ORDER:  # the default config over the same selection in score (random) order and in position order
            srt = torch.sort(idx, -1).values.contiguous()
            for name, ix in (("random_order", idx), ("position_order", srt)):
                i = [0]

                def run_ix(ix=ix):
                    i[0] ^= 1
                    sparse_decode_triton(q, ks[i[0]], vs[i[0]], ix, lens, kn, vn)
                res[name + "_ms"] = bench(run_ix)
            print(json.dumps(res), flush=True)
            out.append(res)
            del ks, vs
            continue
        best = []
        grid = itertools.product((64, 128), (1, 2, 3, 4, 6), (4,), (2,)) if SMALL else \
            itertools.product((32, 64, 128), (1, 2, 3, 4, 6, 8), (4, 8), (2, 3, 4))
        for bn, sp, w, st in grid:
            try:
                o = sparse_decode_triton(q, ks[0], vs[0], idx, lens, kn, vn, block_n=bn, num_splits=sp, num_warps=w,
                                         num_stages=st)
                if (o.float() - ref.float()).abs().max().item() > 2e-2:
                    print("mismatch", b, bn, sp, w, st, flush=True)
                    continue
                i = [0]

                def run():
                    i[0] ^= 1
                    sparse_decode_triton(q, ks[i[0]], vs[i[0]], idx, lens, kn, vn, block_n=bn, num_splits=sp,
                                         num_warps=w, num_stages=st)
                ms = bench(run)
            except Exception as e:  # out of resources
                print("fail", bn, sp, w, st, type(e).__name__, flush=True)
                continue
            best.append((ms, bn, sp, w, st))
        best.sort()
        i = [0]

        def run_default():
            i[0] ^= 1
            sparse_decode_triton(q, ks[i[0]], vs[i[0]], idx, lens, kn, vn)
        res["default_ms"] = bench(run_default)
        res["default_tbps"] = gb / res["default_ms"]
        res["best"] = [dict(ms=m, tbps=gb / m, block_n=bn, splits=sp, warps=w, stages=st) for m, bn, sp, w, st in
                       best[:6 if not SMALL else None]]
        print(json.dumps(res), flush=True)
        out.append(res)
        del ks, vs
    json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/dev/null", "w"), indent=1)


if __name__ == "__main__":
    main()
