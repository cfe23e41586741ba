"""Runner of the ``decode-ops`` suite: SpeContext's decode ops (arXiv 2512.00722, §4.3) at one cache length.

One job = one ``S``: ``batch`` rows, each with a full cache of ``S`` tokens (``(batch, H_kv, S, D)`` K and V) and one
new token; retrieval (a head of the model's attention shape, the worst case for its cost) selects ``budget`` tokens
per KV head. Every op of :class:`~kvtransform.bench.config.DecodeMethod` is timed in this process on the same
tensors, as CUDA-graph replays (:func:`.timing.time_steps` with ``cuda_graph``), p20/p50/p80 ms.

Bytes counted per row (the HBM traffic the op cannot avoid): the K/V rows it must read (the ``2 * B`` selected rows
per KV head and their int32 indices, or the whole cache), plus q, k_new, v_new and out. The device's copy bandwidth
(``y.copy_(x)`` over ``bandwidth_mib``, read + written bytes) and read bandwidth (``x.sum()``) are measured first in
the same job; each row carries ``gbps``, ``pct_copy``/``pct_read`` and ``floor_ms`` = bytes / copy bandwidth.
"""
from __future__ import annotations

import gc
import os
import traceback
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .config import DecodeMethod, GatherTune
from .config_common import swept_settings
from .layer import torch_dtype
from .device import resolve_device
from .timing import quantiles, sync, time_steps

__all__ = ["ORDER", "run_job"]

ORDER = [m.value for m in DecodeMethod if m is not DecodeMethod.all]


def _enum_value(x) -> str:
    return x.value if hasattr(x, "value") else str(x)


class _Tensors:
    """The inputs of one job: caches, new token, retrieval head, selected indices and slot buffers."""

    def __init__(self, cfg, device):
        dt = torch_dtype(cfg)
        b, h, hk, d, s = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.S
        g = torch.Generator(device=device).manual_seed(cfg.seed)
        rnd = lambda *size: torch.randn(*size, generator=g, device=device).to(dt)  # noqa: E731
        self.q, self.k, self.v = rnd(b, h, d), rnd(b, hk, s, d), rnd(b, hk, s, d)
        self.kn, self.vn = rnd(b, hk, d), rnd(b, hk, d)
        self.lens = torch.full((b,), s, device=device, dtype=torch.int32)
        self.qr, self.kr = rnd(b, h, d), rnd(b, hk, s, d)
        from kvtransform.ops.sparse_decode import retrieval_topk

        self.idx = retrieval_topk(self.qr, self.kr, self.lens, cfg.budget)
        self.idx_sorted = torch.sort(self.idx, dim=-1).values
        self.safe = self.idx.clamp(min=0).long()[..., None].expand(-1, -1, -1, d)
        self.ks, self.vs = torch.gather(self.k, 2, self.safe), torch.gather(self.v, 2, self.safe)
        self.slot_len = self.lens.clamp(max=cfg.budget)
        self.q4 = self.q[:, :, None]
        self.scale = d ** -0.5
        self._scores = None

    def scores(self):
        if self._scores is None:
            from kvtransform.kernels.retrieval import retrieval_scores_triton

            self._scores = retrieval_scores_triton(self.qr, self.kr, self.lens, self.scale)
        return self._scores


def _bytes(cfg) -> dict:
    """Bytes each kind of op must move: ``sel`` (selected rows + indices), ``slots``, ``dense`` (whole cache),
    ``retrieval`` (the retrieval key cache) and ``select`` (none counted)."""
    item = torch.finfo(torch_dtype(cfg)).bits // 8
    b, h, hk, d, s, B = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.S, cfg.budget
    io = (2 * b * h * d + 2 * b * hk * d) * item  # q, out, k_new, v_new
    return dict(sel=2 * b * hk * B * d * item + b * hk * B * 4 + io, slots=2 * b * hk * B * d * item + io,
                dense=2 * b * hk * s * d * item + io, retrieval=b * hk * s * d * item, select=0)


def _sdpa_flash(t):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(t.q4, t.k, t.v, enable_gqa=True)


_TRITON_DIRECT = ("retrieval_scoring", "retrieval_scoring_tuned", "retrieval_topk_tuned", "sparse_decode_tuned")
_KVT_OPS = ("sparse_decode", "sparse_decode_sorted", "sparse_decode_slots", "sparse_decode_dense", "retrieval_topk")


def _impl(name: str, device: torch.device) -> str:
    """What a row of :func:`_op_table` runs: the registered kvt ops run Triton on CUDA and their PyTorch references
    on a CPU; the ``*_triton`` kernels called directly run Triton's interpreter there (``TRITON_INTERPRET=1``), so
    on a CPU a part (``retrieval_scoring``) can take longer than its whole (``retrieval_topk``)."""
    cuda = device.type == "cuda"
    if name in _TRITON_DIRECT:
        return "triton" if cuda else "triton interpreter"
    if name in _KVT_OPS:
        return "triton" if cuda else "torch reference"
    return "torch"


def _op_table(tune: Optional[dict] = None, rtune: Optional[dict] = None) -> dict:
    """``name -> (op, mode, bytes kind, fn(t))`` of every timed op."""
    from kvtransform.kernels.retrieval import retrieval_scores_triton, select_topk
    from kvtransform.kernels.sparse_decode import sparse_decode_triton
    from kvtransform.ops.sparse_decode import retrieval_topk, sparse_decode_attention

    B = lambda t: t.idx.shape[-1]  # noqa: E731
    ops = {
        "sparse_decode": ("sparse_decode", "gather", "sel",
                          lambda t: sparse_decode_attention(t.q, t.k, t.v, t.idx, t.lens, t.kn, t.vn)),
        "sparse_decode_sorted": ("sparse_decode", "gather", "sel",
                                 lambda t: sparse_decode_attention(t.q, t.k, t.v, t.idx_sorted, t.lens, t.kn, t.vn)),
        "sparse_decode_slots": ("sparse_decode", "slots", "slots",
                                lambda t: sparse_decode_attention(t.q, t.ks, t.vs, None, t.slot_len, t.kn, t.vn)),
        "gather_sdpa": ("sparse_decode", "gather", "sel",
                        lambda t: F.scaled_dot_product_attention(t.q4, torch.gather(t.k, 2, t.safe),
                                                                 torch.gather(t.v, 2, t.safe), enable_gqa=True)),
        "sdpa_flash": ("dense_decode", "full", "dense", _sdpa_flash),
        "sdpa": ("dense_decode", "full", "dense",
                 lambda t: F.scaled_dot_product_attention(t.q4, t.k, t.v, enable_gqa=True)),
        "sparse_decode_dense": ("dense_decode", "full", "dense",
                                lambda t: sparse_decode_attention(t.q, t.k, t.v, None, t.lens, t.kn, t.vn)),
        "retrieval_topk": ("retrieval_topk", "total", "retrieval", lambda t: retrieval_topk(t.qr, t.kr, t.lens, B(t))),
        "retrieval_scoring": ("retrieval_topk", "scoring", "retrieval",
                              lambda t: retrieval_scores_triton(t.qr, t.kr, t.lens, t.scale)),
        "topk": ("retrieval_topk", "select", "select", lambda t: select_topk(t.scores(), B(t))),
        "topk_unsorted": ("retrieval_topk", "select", "select",
                          lambda t: torch.topk(t.scores(), B(t), dim=-1, sorted=False)),
    }
    if tune:
        ops["sparse_decode_tuned"] = ("sparse_decode", "gather", "sel",
                                      lambda t: sparse_decode_triton(t.q, t.k, t.v, t.idx, t.lens, t.kn, t.vn, **tune))
    if rtune:
        ops["retrieval_scoring_tuned"] = ("retrieval_topk", "scoring", "retrieval",
                                          lambda t: retrieval_scores_triton(t.qr, t.kr, t.lens, t.scale, **rtune))
        ops["retrieval_topk_tuned"] = ("retrieval_topk", "total", "retrieval", lambda t: select_topk(
            retrieval_scores_triton(t.qr, t.kr, t.lens, t.scale, **rtune), B(t)))
    return ops


def _bandwidth(cfg, device) -> tuple:
    """Copy (read + write) and read-only bandwidth in GB/s over ``bandwidth_mib`` MiB, and their rows."""
    n = cfg.bandwidth_mib * 2**20 // 2
    x = torch.randn(n, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)
    rows, bw = [], {}
    for name, mode, fn, nbytes in (("copy", "copy", lambda m: y.copy_(x), 2 * x.numel() * 2),
                                    ("read", "read", lambda m: torch.sum(x, dtype=torch.float32), x.numel() * 2)):
        times = time_steps(fn, device, max(cfg.warmup, 1), cfg.iters)
        q = quantiles([sum(t) for t in times])
        bw[name] = nbytes / (q["ms_p50"] * 1e-3) / 1e9
        rows.append(dict(method=name, op="memcpy", mode=mode, impl="torch", status="ok", iters=len(times),
                         bytes_gb=nbytes / 1e9, gbps=bw[name], **q))
        print(f"  {name} bandwidth: {bw[name]:.0f} GB/s", flush=True)
    del x, y
    return bw["copy"], bw["read"], rows


def _gather_sweep(cfg, t, device, nbytes) -> tuple:
    from kvtransform.kernels.sparse_decode import sparse_decode_triton

    from .tune import gather_grid, sweep

    print(f"## gather-decode launch-config sweep ({_enum_value(cfg.tune)}) at S={cfg.S}", flush=True)
    return sweep("sparse_decode_tune", gather_grid(_enum_value(cfg.tune)),
                 lambda c: (lambda mark: sparse_decode_triton(t.q, t.k, t.v, t.idx, t.lens, t.kn, t.vn, **c)),
                 device, cfg.warmup, cfg.iters, lambda ms: {"gbps": nbytes / (ms * 1e-3) / 1e9},
                 cuda_graph=cfg.cuda_graph)


def _retrieval_sweep(cfg, t, device, nbytes) -> tuple:
    from kvtransform.kernels.retrieval import retrieval_scores_triton

    from .tune import retrieval_grid, sweep

    print(f"## retrieval-scoring launch-config sweep at S={cfg.S}", flush=True)
    return sweep("retrieval_scoring_tune", retrieval_grid(),
                 lambda c: (lambda mark: retrieval_scores_triton(t.qr, t.kr, t.lens, t.scale, **c)),
                 device, cfg.warmup, cfg.iters, lambda ms: {"gbps": nbytes / (ms * 1e-3) / 1e9},
                 cuda_graph=cfg.cuda_graph)


def run_job(cfg, on_row: Optional[Callable] = None) -> list:
    """Every op of one job (one ``S``) in this process; returns CSV rows (without run metadata)."""
    from . import checks

    device = resolve_device(cfg)
    nbytes = _bytes(cfg)
    params = f"b={cfg.batch} H={cfg.heads} Hkv={cfg.kv_heads} D={cfg.head_dim} S={cfg.S} B={cfg.budget}" + \
        swept_settings(cfg, ("dtype", "seed"))
    rows = []
    copy_bw = read_bw = float("nan")

    def emit(r):
        r.setdefault("params", params)
        r.setdefault("pass", "fwd")
        r.update(S=cfg.S, batch=cfg.batch, budget=cfg.budget)
        if r.get("bytes_gb") is not None and r.get("gbps") is None and r.get("ms_p50"):
            r["gbps"] = r["bytes_gb"] / (r["ms_p50"] * 1e-3)
        if r.get("gbps"):
            r.update(pct_copy=100 * r["gbps"] / copy_bw, pct_read=100 * r["gbps"] / read_bw)
        rows.append(r)
        if on_row is not None:
            on_row(r)

    print(f"## decode ops at {params}", flush=True)
    copy_bw, read_bw, bw_rows = _bandwidth(cfg, device)
    for r in bw_rows:
        emit(r)
    if cfg.kernel_check:
        emit(dict(checks.check_row("sparse_decode", "retrieval + gather/slot decode",
                                   checks.check_decode_kernels(device)), op="sparse_decode"))
    t = _Tensors(cfg, device)
    tuned = rtuned = None
    if _enum_value(cfg.tune) != GatherTune.none.value:
        tuned, tr = _gather_sweep(cfg, t, device, nbytes["sel"])
        for r in tr:
            emit(dict(r, op="sparse_decode", mode="gather", params=f"{params} {r['params']}",
                      bytes_gb=nbytes["sel"] / 1e9))
    if cfg.retrieval_tune:
        rtuned, tr = _retrieval_sweep(cfg, t, device, nbytes["retrieval"])
        for r in tr:
            emit(dict(r, op="retrieval_topk", mode="scoring", params=f"{params} {r['params']}",
                      bytes_gb=nbytes["retrieval"] / 1e9))
    ops = _op_table(tuned, rtuned)
    m = _enum_value(cfg.method)
    names = [n for n in ops if m == "all" or n == m]
    for name in names:
        op, mode, kind, fn = ops[name]
        r = dict(method=name, op=op, mode=mode, impl=_impl(name, device), status="ok", iters=0,
                 bytes_gb=nbytes[kind] / 1e9)
        if name.endswith("_tuned"):
            r["impl"] += f" {tuned if name.startswith('sparse') else rtuned}"
        try:
            if device.type == "cuda":
                sync(device)
                torch.cuda.reset_peak_memory_stats(device)
            times = time_steps(lambda mark: fn(t), device, cfg.warmup, cfg.iters, cuda_graph=cfg.cuda_graph,
                               sample_ms=cfg.sample_ms)
            r.update(quantiles([sum(x) for x in times]), iters=len(times))
            if device.type == "cuda":
                r["gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            if nbytes[kind]:
                r["floor_ms"] = nbytes[kind] / (copy_bw * 1e9) * 1e3
            else:
                r["bytes_gb"] = None
        except torch.OutOfMemoryError:
            r["status"] = "OOM"
        except Exception as e:  # one broken op must not take the others' rows with it
            if os.environ.get("KVT_BENCH_DEBUG"):
                traceback.print_exc()
            r["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        emit(r)
    del t
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
