"""Launch-config sweeps of the Triton kernels (suite options ``tune=...``), timed with the suites' one timing loop
(:func:`.timing.time_steps`); every candidate becomes a CSV row (``method`` ending in ``_tune``, the candidate in
``params``), and the best config is returned for the timed rows that follow.

* DualKV (arXiv 2605.15422): forward, dQ and dK/dV kernels at the job's shape; candidates
  ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, the first of each list the kernel's default on the H200.
* SpeContext decode (arXiv 2512.00722, §4.3): the sparse gather-decode kernel (``block_n``, warps, stages, splits)
  and the retrieval scoring kernel (``block_s``, warps, blocks per program, stages).
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import torch

from . import flops
from .timing import quantiles, time_steps

__all__ = ["FWD_CANDS", "DQ_CANDS", "DKDV_CANDS", "sweep", "tune_dualkv", "gather_grid", "retrieval_grid"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages[, PACK[, TMA]]); the first of each list is the default. Round 1 swept 6 fwd / 5 dq /
# 8 dkdv configs; these are round 2, around round 1's best (BENCHMARKS.md, DualKV op section); the forward's round 3
# (BENCHMARKS.md, DualKV op section) added the GQA-packed program (PACK: 32 query tokens x 4 heads = the same 128 tile rows) and K/V through
# tensor descriptors (TMA). Round 3 on the H200 (BENCHMARKS.md): packed + TMA 557 / 517 TFLOP/s against 459 / 455
# for 128/128/8/3; it is the default at GQA 4, D 128, bf16 (kernels/dualkv.py _default_fwd_cfg), the first list
# entry is the default elsewhere.
FWD_CANDS = [(128, 128, 8, 3), (32, 128, 8, 3, True, True), (128, 64, 8, 3), (32, 128, 8, 3, True),
             (32, 64, 8, 3, True), (128, 128, 8, 3, False, True), (128, 64, 8, 4, False, True)]
# Round 4 (BENCHMARKS.md, DualKV op section): the dQ kernel with the forward's packed GQA-4 + TMA program (the default at GQA 4,
# D 128, bf16), the dK/dV kernel with TMA Q/dO loads and 2 stages (the default at D 128, bf16).
DQ_CANDS = [(128, 64, 8, 3), (32, 64, 8, 3, True, True), (128, 64, 8, 3, False, True), (32, 64, 8, 3, True),
            (128, 32, 8, 3), (128, 128, 8, 3)]
# Round 5 (BENCHMARKS.md, DualKV op section): dK/dV over 64 keys with 4 warps and TMA (two programs per SM) is the
# default at D 128, bf16; the two-programs-per-SM forward and dQ configs of that round lost to the defaults.
DKDV_CANDS = [(64, 64, 4, 2, False, True), (64, 128, 8, 2, False, True), (64, 64, 4, 3, False, True),
              (64, 64, 8, 2, False, True), (32, 64, 4, 2, False, True), (64, 128, 8, 3), (64, 64, 4, 3),
              (128, 128, 8, 2)]


def sweep(method: str, candidates: list, step_for: Callable, device, warmup: int, iters: int, nbytes_or_flops=None,
          cuda_graph: bool = False) -> Tuple[object, List[dict]]:
    """Time ``step_for(candidate)`` (a ``step(mark)``) for each candidate; returns ``(best candidate or None,
    rows)``. A candidate that fails (out of shared memory, ...) gets a row with an ``error`` status."""
    rows, best = [], None
    for cand in candidates:
        row = dict(method=method, impl="triton", params=str(cand), status="ok", iters=0, **{"pass": "tune"})
        try:
            times = time_steps(step_for(cand), device, warmup, iters, cuda_graph=cuda_graph)
            row.update(quantiles([sum(t) for t in times]), iters=len(times))
            if nbytes_or_flops is not None:
                row.update(nbytes_or_flops(row["ms_p50"]))
            if best is None or row["ms_p50"] < best[0]:
                best = (row["ms_p50"], cand)
        except Exception as e:
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        rows.append(row)
        print(f"  {method} {cand}: " + (f"{row['ms_p50']:.4f} ms" if row["status"] == "ok" else row["status"]),
              flush=True)
    return (None if best is None else best[1]), rows


def _as_cfg(c) -> dict:
    cfg = dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3])
    for i, key in ((4, "PACK"), (5, "TMA")):
        if len(c) > i:
            cfg[key] = bool(c[i])
    return cfg


def tune_dualkv(layout, cfg, device) -> Tuple[dict, List[dict]]:
    """Sweep the forward, dQ and dK/dV launch configs of the DualKV kernels on ``layout`` (bf16/fp16 inputs of the
    job's heads and head_dim, with the job's window / soft-cap / sinks); returns ``(best {"fwd": .., "dq": ..,
    "dkdv": ..}, rows)``. Backward candidates are timed as the whole backward with the other kernel at its best /
    default."""
    from kvtransform.kernels import dualkv as K

    from .layer import torch_dtype
    from .methods import variant_kwargs

    t, h, h_kv, d = int(layout.total_tokens), cfg.heads, cfg.kv_heads, cfg.head_dim
    g = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    dt = torch_dtype(cfg)
    q, do = (torch.randn(t, h, d, device=device, generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(t, h_kv, d, device=device, generator=g).to(dt) for _ in range(2))
    cu, sp, scale = layout.cu_seqlens, layout.segment_prefix, d ** -0.5
    var = {key: (val.detach() if torch.is_tensor(val) else val) for key, val in variant_kwargs(cfg, device).items()}
    f_fwd = flops.attention_flops(layout, h, d)
    print(f"## DualKV launch-config sweep at P={layout.prefix_lens[0]}, mb={len(layout.response_lens[0])}, "
          f"H={h}/{h_kv}, D={d}, {dt}" + "".join(f", {key}" + ("" if torch.is_tensor(val) else f"={val}")
                                                 for key, val in var.items()), flush=True)
    best, rows = {}, []
    for kind, cands in (("fwd", FWD_CANDS), ("dq", DQ_CANDS), ("dkdv", DKDV_CANDS)):
        work = f_fwd * (1.0 if kind == "fwd" else flops.BACKWARD_FACTOR)

        def step_for(c, kind=kind):
            conf = dict(best, **{kind: _as_cfg(c)})
            if kind == "fwd":
                return lambda mark: K.dualkv_fwd(q, k, v, cu, sp, scale, config=conf, **var)
            out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale, **var)
            return lambda mark: K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale, config=conf, **var)

        c, r = sweep(f"dualkv_kernel_tune", cands, step_for, device, cfg.warmup, cfg.iters,
                     lambda ms, work=work: {"tflops": work / (ms * 1e-3) / 1e12})
        for row in r:
            row["params"] = f"{kind}={row['params']}"
        rows += r
        if c is not None:
            best[kind] = _as_cfg(c)
    print(f"best: {best}", flush=True)
    return best, rows


def gather_grid(size: str) -> list:
    """Candidate launch configs of the sparse gather-decode kernel: ``full`` (51) or ``small`` (8)."""
    if size == "full":
        return [dict(block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp)
                for bn in (32, 64, 128) for nw in (4, 8) for ns in (2, 3, 4) for sp in (2, 4, 8)
                if not (bn == 128 and ns == 4)]
    return [dict(block_n=64, num_warps=4, num_stages=ns, num_splits=sp) for ns in (2, 3) for sp in (1, 2, 3, 4)]


def retrieval_grid() -> list:
    """Candidate launch configs of the retrieval scoring kernel (18)."""
    grid = [dict(block_s=bs, num_warps=nw, blocks_per_prog=bpp, num_stages=ns)
            for bs in (64, 128) for nw in (4, 8) for bpp, ns in ((1, 2), (4, 2), (4, 3), (8, 3))]
    return grid + [dict(block_s=256, num_warps=8, blocks_per_prog=bpp, num_stages=2) for bpp in (1, 4)]
