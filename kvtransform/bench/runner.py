"""Runner of the DualKV suites (``dualkv-layer``, ``dualkv-attn``): one job = one prompt of ``P`` tokens shared by
``mb`` responses, every method of :mod:`.methods` timed in this process on the same inputs.

Timing (:func:`.timing.time_steps`): ``warmup`` untimed steps, then ``iters`` timed steps, each between two CUDA
events (host clock on CPU); p20/p50/p80 over the steps. Peak memory: ``torch.cuda.max_memory_allocated`` from after
setup (weights, inputs) to the end of the timed steps, the quantity the DualKV paper reports. FLOP floor
(:mod:`.flops`): layer mode ``(6 * layer matmul params * T_packed + 3.5 * 4 * head_dim * heads * visible pairs) /
matmul rate``; attn mode ``3.5 * 4 * head_dim * heads * visible pairs / rate``.

Source: DualKV (arXiv 2605.15422) App. F.4 for the setup; the numbers it reports are in :mod:`.seed`.
"""
from __future__ import annotations

import gc
import os
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from kvtransform.layout import DualKVLayout

from . import flops
from .config import Mode
from .config_common import swept_settings
from .device import resolve_device
from .layer import get_layer, release_grads, torch_dtype
from .methods import METHODS, Unavailable, methods_for, variant_kwargs
from .timing import quantiles, time_steps

__all__ = ["response_lengths", "Shape", "packed_from_replicated", "resolve_device", "estimate_gb", "run_method",
           "run_job"]


def response_lengths(mb: int, r_min: int = 131, r_max: int = 2048, seed: int = 42) -> list:
    """The paper's response lengths: ``torch.randint(r_min, r_max + 1, (mb,))`` from a CPU generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(r_min, r_max + 1, (mb,), generator=g).tolist()


def _mode(cfg) -> Mode:
    return cfg.mode if isinstance(cfg.mode, Mode) else Mode(getattr(cfg.mode, "value", str(cfg.mode)))


@dataclass
class Shape:
    """One benchmark shape: the layout (on the CPU), token counts, the useful FLOPs and their floor."""

    layout: DualKVLayout
    T: int  # packed tokens P + sum R
    T_rep: int  # replicated tokens sum (P + R_i)
    pairs: int  # visible (q, k) pairs
    attn_fwd_flops: float  # 4 * D * H * pairs
    layer_flops: float  # fwd+bwd useful FLOPs of the layer on the packed tokens
    floor_ms: float  # layer mode: layer_flops / rate; attn mode: 3.5 * attn_fwd_flops / rate

    @property
    def P(self) -> int:
        return int(self.layout.prefix_lens[0])

    @property
    def R(self) -> list:
        return [int(r) for r in self.layout.response_lens[0]]

    @property
    def key(self) -> tuple:
        """What identifies the shape's tokens (the check reference is per key)."""
        return (self.P, tuple(self.R))

    def replicated_index(self, layout) -> torch.Tensor:
        return layout.replicated_index()

    def packed_from_replicated(self, layout) -> torch.Tensor:
        return packed_from_replicated(layout)

    @staticmethod
    def of(cfg) -> "Shape":
        lay = DualKVLayout.from_lengths([(cfg.P, response_lengths(cfg.mb, cfg.r_min, cfg.r_max, cfg.seed))])
        T, pairs = int(lay.total_tokens), lay.visible_pairs()
        T_rep = int(lay.replicated_cu_seqlens()[-1])
        attn_fwd = flops.attention_flops(pairs, cfg.heads, cfg.head_dim)
        layer = flops.layer_flops(T, pairs, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp)
        work = layer if _mode(cfg) == Mode.layer else attn_fwd * (1 + flops.BACKWARD_FACTOR)
        return Shape(lay, T, T_rep, pairs, attn_fwd, layer, work / (cfg.matmul_tflops * 1e12) * 1e3)


def packed_from_replicated(layout) -> torch.Tensor:
    """int64 ``(T,)``: for each packed token, the first replicated position holding it (a prefix from its group's
    first copy): ``replicated[packed_from_replicated(layout)] == packed``."""
    rep = layout.replicated_index()
    pos = torch.arange(rep.numel(), device=rep.device)
    first = torch.full((int(layout.total_tokens),), rep.numel(), dtype=torch.long, device=rep.device)
    return first.scatter_reduce(0, rep, pos, reduce="amin")


def estimate_gb(cfg, shape: Shape, method: str, replicated: bool = None) -> float:
    """Rough peak-memory estimate (GiB) used only to skip runs that cannot fit: weights + grads and about 160
    bf16-equivalent activations of width hidden per token in layer mode, plus pg's expanded K/V. ``replicated``:
    the method runs on the replicated axis (default: ``method == "fa2"``)."""
    bpe = torch.finfo(torch_dtype(cfg)).bits // 8
    replicated = method == "fa2" if replicated is None else replicated
    if hasattr(shape, "estimate_gb"):  # a shape of another suite (the tree suites)
        return shape.estimate_gb(cfg, method, replicated, bpe)
    T = shape.T_rep if replicated else shape.T
    if _mode(cfg) == Mode.layer:
        params = flops.layer_matmul_params(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp)
        gb = 2 * params * bpe + T * (10 * cfg.hidden + 4 * cfg.mlp) * bpe * 1.6
    else:
        gb = T * (cfg.heads * 4 + cfg.kv_heads * 4) * cfg.head_dim * bpe
    if method == "pg":
        mb, rmax = len(shape.R), max(shape.R)
        gb += 4 * mb * (shape.P + rmax) * cfg.heads * cfg.head_dim * bpe + mb * rmax * (shape.P + rmax) * (1 + bpe)
    if method == "reference":
        gb += shape.T * shape.T * (1 + 4 * cfg.heads)
    return gb / 2**30


_CHECK_REF: dict = {}
_CHECK_REFS_KEPT = 4  # (CPU copies of an attention output each: a few hundred MB at the paper's largest shapes)


def clear_check_reference() -> None:
    """Forget the output the rows of a shape are checked against (``check_vs``): each ``kvtransform bench``
    invocation compares its own methods only, never a row of an earlier invocation in the same process."""
    _CHECK_REF.clear()


def run_method(cfg, shape: Shape, name: str, device, launch_config: Optional[dict] = None,
               methods: Optional[dict] = None) -> list:
    """Time one method on one shape; returns CSV rows (one in layer mode; fwd, bwd, fwdbwd in attn mode).
    ``launch_config`` goes to ``dualkv_kernel`` (the ``tune`` sweep's best). ``methods``: the adapter registry
    (default :data:`.methods.METHODS`; the tree suites pass theirs, with a shape of the same interface:
    ``T``, ``T_rep``, ``key``, ``layout``, ``replicated_index``, ``packed_from_replicated``, the FLOP counts)."""
    mode = _mode(cfg)
    dtype = torch_dtype(cfg)
    registry = METHODS if methods is None else methods
    replicated = bool(getattr(registry.get(name), "replicated", False))
    base = dict(method=name, impl="", T=shape.T_rep if replicated else shape.T, iters=0, gb=float("nan"),
                check_rel_err=float("nan"), status="ok")
    passes = ["fwdbwd"] if mode == Mode.layer else ["fwd", "bwd", "fwdbwd"]

    def fail(status):
        return [dict(base, **{"pass": p, "status": status}) for p in passes]

    cap = cfg.max_mem_gb or (torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0)
    est = estimate_gb(cfg, shape, name, replicated)
    if cap and est > 1.2 * cap:
        return fail(f"skip-mem (est {est:.0f} GiB)")
    if name not in registry:
        return fail(f"unknown method {name}")
    meth = registry[name]()
    if launch_config:
        meth.launch_config = launch_config
    state = {}
    try:
        layout = shape.layout.to(device)
        try:
            meth.setup(layout, cfg, device)
        except Unavailable as e:
            return fail(f"unavailable: {e}")
        base["impl"] = meth.impl
        g = torch.Generator(device=device).manual_seed(cfg.seed + 1)
        rep = shape.replicated_index(layout) if meth.replicated else None
        back = shape.packed_from_replicated(layout) if meth.replicated else None

        def leaf(*size, scale=1.0):
            t = torch.randn(*size, generator=g, device=device, dtype=torch.float32).mul_(scale).to(dtype)
            if rep is not None:
                t = t[rep]
            return t.requires_grad_()

        if mode == Mode.layer:
            layer = get_layer(cfg, device)
            x = leaf(shape.T, cfg.hidden)
            state["x"] = x
            params = list(layer.parameters())

            def forward_attn():  # grad mode as in the step, so compiled flex is not recompiled for no_grad
                meth.per_step()
                return meth.layer_forward(layer, x)[1].detach()

            def step(mark):
                x.grad = None
                for p in params:
                    p.grad = None
                meth.per_step()
                out = meth.layer_forward(layer, x)[0]
                out.sum().backward()
        else:
            q = leaf(shape.T, cfg.heads, cfg.head_dim)
            k = leaf(shape.T, cfg.kv_heads, cfg.head_dim)
            v = leaf(shape.T, cfg.kv_heads, cfg.head_dim)
            T_m = q.shape[0]
            do = torch.randn(T_m, cfg.heads, cfg.head_dim, generator=g, device=device, dtype=torch.float32).to(dtype)
            state.update(q=q, k=k, v=v, do=do)

            def forward_attn():
                meth.per_step()
                return meth(q, k, v).detach()

            def step(mark):
                q.grad = k.grad = v.grad = None
                meth.attn_step(q, k, v, do, mark)

        if cfg.check:
            a = forward_attn()
            if back is not None:
                a = a[back]
            finite = bool(torch.isfinite(a).all())
            # every setting that changes the attention output (a sweep over one of them compared a method with
            # another setting's output); the references of a few settings are kept, so that a method x dtype sweep
            # (jobs alternating settings) checks each method against the first of its own setting
            key = (mode, shape.key, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.qk_norm, cfg.seed,
                   str(dtype), cfg.get("window", 0), cfg.get("softcap", 0.0), cfg.get("sinks", False))
            if key not in _CHECK_REF:
                while len(_CHECK_REF) >= _CHECK_REFS_KEPT:
                    _CHECK_REF.pop(next(iter(_CHECK_REF)))
                _CHECK_REF[key] = (name, a.detach().to("cpu"))
                base["check_rel_err"] = 0.0
            else:
                ref = _CHECK_REF[key][1].to(device).float()
                base["check_rel_err"] = float((a.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                del ref
            base["check_vs"] = _CHECK_REF[key][0]
            del a
            if not finite:
                base["status"] = "nonfinite"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = time_steps(step, device, cfg.warmup, cfg.iters, cfg.time_budget_s, cfg.min_iters)
        base["impl"] = meth.impl
        if device.type == "cuda":
            base["gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        base["iters"] = len(times)
        rows = []
        for i, p in enumerate(passes):
            ms = [sum(t) for t in times] if p == "fwdbwd" else [t[i] for t in times]
            r = dict(base, **{"pass": p}, **quantiles(ms))
            if mode == Mode.layer:
                work = shape.layer_flops
            else:
                work = shape.attn_fwd_flops * {"fwd": 1.0, "bwd": flops.BACKWARD_FACTOR,
                                               "fwdbwd": 1.0 + flops.BACKWARD_FACTOR}[p]
            r["tflops"] = work / (r["ms_p50"] * 1e-3) / 1e12
            rows.append(r)
        return rows
    except torch.OutOfMemoryError:
        return fail("OOM")
    except Exception as e:  # a broken method must not take the other methods' rows with it
        if os.environ.get("KVT_BENCH_DEBUG"):
            traceback.print_exc()
        msg = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return fail(msg)
    finally:
        state.clear()
        meth = None
        release_grads()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_job(cfg, on_row: Optional[Callable] = None) -> list:
    """All methods of one job (one P, one mb) in this process; returns CSV rows (without run metadata).

    ``kernel_check`` first runs the bf16 checks of the DualKV kernels (:mod:`.checks`, one row with ``pass=check``;
    :func:`kvtransform.bench.run` fails after writing the CSV if a check failed); ``tune`` sweeps the kernels'
    launch configs at this shape (:mod:`.tune`, rows ``dualkv_kernel_tune``) and times ``dualkv_kernel`` with the
    best."""
    from . import checks, tune

    device = resolve_device(cfg)
    shape = Shape.of(cfg)
    rows, best = [], None
    # the attention variants name the rows too (a window=0,4096 sweep keeps both in one CSV; TFLOP/s count the
    # pairs of the full causal mask)
    variants = "".join(f" {key}={cfg.get(key)}" for key in ("window", "softcap", "sinks") if cfg.get(key, 0)) + \
        swept_settings(cfg, ("r_min", "r_max", "seed", "hidden", "heads", "kv_heads", "head_dim", "mlp", "qk_norm",
                             "dtype", "fa2_impl", "flex_compile", "flex_mask", "flex_static", "dualkv_layout_per_step"))

    def emit(r):
        r.setdefault("op", "decoder_layer" if _mode(cfg) == Mode.layer else "dualkv_attention")
        r.update(mode=_mode(cfg).value, P=shape.P, mb=len(shape.R), T_packed=shape.T, T_replicated=shape.T_rep,
                 floor_ms=shape.floor_ms if device.type == "cuda" else None)  # (a GPU matmul rate)
        r["params"] = f"P={shape.P} mb={len(shape.R)}" + variants + (f" {r['params']}" if r.get("params") else "")
        rows.append(r)
        if on_row is not None:
            on_row(r)

    if cfg.kernel_check:
        emit(checks.check_row("dualkv_kernel", "default config", checks.check_dualkv_kernels(device)))
        var = variant_kwargs(cfg, device)  # the variants' kernel paths too: each alone, then together
        for one in [{key: val} for key, val in var.items()] + ([var] if len(var) > 1 else []):
            what = " ".join(one)  # in params too: the CSV keys rows by (method, pass, params)
            emit(dict(checks.check_row("dualkv_kernel", f"default config, {what}",
                                       checks.check_dualkv_kernels(device, variants=one)), params=what))
    if cfg.tune:
        best, tune_rows = tune.tune_dualkv(shape.layout.to(device), cfg, device)
        for r in tune_rows:
            emit(r)
        if cfg.kernel_check and best:  # the tuned configs must pass too (the D=128 cases)
            emit(checks.check_row("dualkv_kernel", "tuned config",
                                  checks.check_dualkv_kernels(device, config=best, cases=(0, 1)), "check_tuned"))
    for name in methods_for(cfg, device, shape.T):
        for r in run_method(cfg, shape, name, device, launch_config=best if name == "dualkv_kernel" else None):
            emit(r)
    return rows
