"""The DualKV single-layer benchmark (issue 5): one Qwen3-8B-shaped decoder layer, forward+backward, with the
attention implementation plugged in, on the shared-prefix layout of one prompt (``P`` tokens) and ``mb`` responses.

Token layouts the methods run on:

* packed ``[P][R_1]..[R_mb]`` (``T = P + sum R_i`` tokens): ``reference``, ``pg``, ``flex``, ``flex_rebuild``,
  ``dualkv``. Every per-token op of the layer (norms, projections, MLP) runs once on the prompt.
* replicated ``[P R_1][P R_2]..`` (``T_rep = sum (P + R_i)``): ``fa2``, the plain way (each response its own
  sequence). The layer runs ``mb`` times on the prompt.

Timing: ``warmup`` untimed steps, then ``iters`` timed steps, each between two CUDA events (host clock on CPU);
p20/p50/p80 over the steps. Peak memory: ``torch.cuda.max_memory_allocated`` from after setup (weights, inputs)
to the end of the timed steps, the same quantity the paper reports. FLOP floor (../shared/seed_tables/README.md):
``(6 * layer matmul params * T_packed + 3.5 * 4 * head_dim * heads * visible (q, k) pairs) / matmul rate``.

Source: DualKV (arXiv 2605.15422) App. F.4 for the setup; the numbers it reports are in :mod:`.seed`.
"""
from __future__ import annotations

import gc
import inspect
import math
import os
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import Method, Mode

# ----------------------------------------------------------------------------------------------------------------
# shapes, FLOPs, floor
# ----------------------------------------------------------------------------------------------------------------


def response_lengths(mb: int, r_min: int = 131, r_max: int = 2048, seed: int = 42) -> list:
    """The paper's response lengths: ``torch.randint(r_min, r_max + 1, (mb,))`` from a CPU generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(r_min, r_max + 1, (mb,), generator=g).tolist()


def visible_pairs(P: int, R: list) -> int:
    """Number of (query, key) pairs the shared-prefix mask lets through: causal prompt + each response over the
    whole prompt and causally over itself."""
    return P * (P + 1) // 2 + sum(r * P + r * (r + 1) // 2 for r in R)


def layer_matmul_params(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> int:
    """Weights of the layer's matmuls (q, k, v, o projections and the SwiGLU MLP)."""
    return hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * mlp


@dataclass
class Shape:
    """One benchmark shape: prompt length, response lengths, token counts, the useful FLOPs and their floor."""

    P: int
    R: list
    T: int  # packed tokens P + sum R
    T_rep: int  # replicated tokens sum (P + R_i)
    pairs: int  # visible (q, k) pairs
    attn_fwd_flops: float  # 4 * D * H * pairs
    layer_flops: float  # fwd+bwd useful FLOPs of the layer on the packed tokens
    floor_ms: float  # layer mode: layer_flops / rate; attn mode: 3.5 * attn_fwd_flops / rate

    @staticmethod
    def of(cfg) -> "Shape":
        R = response_lengths(cfg.mb, cfg.r_min, cfg.r_max, cfg.seed)
        P = cfg.P
        T = P + sum(R)
        T_rep = sum(P + r for r in R)
        pairs = visible_pairs(P, R)
        attn_fwd = 4.0 * cfg.head_dim * cfg.heads * pairs
        params = layer_matmul_params(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp)
        layer = 6.0 * params * T + 3.5 * attn_fwd
        rate = cfg.matmul_tflops * 1e12
        floor = (layer if _mode(cfg) == Mode.layer else 3.5 * attn_fwd) / rate * 1e3
        return Shape(P, R, T, T_rep, pairs, attn_fwd, layer, floor)


def _mode(cfg) -> Mode:
    return cfg.mode if isinstance(cfg.mode, Mode) else Mode(str(cfg.mode))


def _dtype(cfg) -> torch.dtype:
    name = cfg.dtype.value if hasattr(cfg.dtype, "value") else str(cfg.dtype)
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


# ----------------------------------------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------------------------------------

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    """Qwen3-shaped decoder layer without RoPE on a flat token axis, attention pluggable.

    ``x (T, hidden)`` -> ``x + o(attn(q, k, v))`` -> ``+ down(silu(gate) * up)``, pre-RMSNorm, Qwen3's per-head
    RMSNorm on q and k when ``qk_norm``. ``attn(q (T, H, D), k (T, H_kv, D), v (T, H_kv, D)) -> (T, H, D)``.
    Weights are drawn from ``seed`` on ``device`` (normal, std 0.02; norms 1).
    """

    def __init__(self, hidden, heads, kv_heads, head_dim, mlp, qk_norm=True, dtype=torch.bfloat16, device="cpu", seed=0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.qk_norm = heads, kv_heads, head_dim, qk_norm
        kw = dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden, heads * head_dim, **kw)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(heads * head_dim, hidden, **kw)
        self.gate_proj = nn.Linear(hidden, mlp, **kw)
        self.up_proj = nn.Linear(hidden, mlp, **kw)
        self.down_proj = nn.Linear(mlp, hidden, **kw)
        self.norm1 = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        self.norm2 = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        self.q_norm = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
        self.k_norm = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj):
                lin.weight.normal_(0.0, 0.02, generator=g)
        self.eps = 1e-6

    def forward(self, x: torch.Tensor, attn: AttnFn, return_attn: bool = False):
        T = x.shape[0]
        h = F.rms_norm(x, (x.shape[-1],), self.norm1, self.eps)
        q = self.q_proj(h).view(T, self.heads, self.head_dim)
        k = self.k_proj(h).view(T, self.kv_heads, self.head_dim)
        v = self.v_proj(h).view(T, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q = F.rms_norm(q, (self.head_dim,), self.q_norm, self.eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm, self.eps)
        a = attn(q, k, v)
        x = x + self.o_proj(a.reshape(T, self.heads * self.head_dim))
        h = F.rms_norm(x, (x.shape[-1],), self.norm2, self.eps)
        out = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return (out, a) if return_attn else out


_LAYER_CACHE: dict = {}


def get_layer(cfg, device) -> DecoderLayer:
    """One layer per (shape, dtype, device, seed), reused across the jobs of a sweep (same weights for all)."""
    key = (cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.qk_norm, _dtype(cfg), str(device), cfg.seed)
    if key not in _LAYER_CACHE:
        _LAYER_CACHE.clear()
        gc.collect()
        _LAYER_CACHE[key] = DecoderLayer(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.qk_norm,
                                         _dtype(cfg), device, cfg.seed)
    return _LAYER_CACHE[key]


# ----------------------------------------------------------------------------------------------------------------
# attention methods
# ----------------------------------------------------------------------------------------------------------------


class Unavailable(RuntimeError):
    """The method cannot run here (missing op, unsupported device); recorded as status ``unavailable``."""


def _segments(P: int, R: list, device) -> torch.Tensor:
    """int32 (T,): 0 on the prompt, i + 1 on response i (packed order)."""
    lens = torch.tensor([P] + list(R), device=device)
    return torch.repeat_interleave(torch.arange(len(R) + 1, device=device, dtype=torch.int32), lens)


def _replicated_index(P: int, R: list, device) -> torch.Tensor:
    """int64 (T_rep,): packed position of each replicated token ([P R_1][P R_2]..)."""
    parts, off = [], P
    for r in R:
        parts += [torch.arange(P), torch.arange(off, off + r)]
        off += r
    return torch.cat(parts).to(device)


def _packed_from_replicated(P: int, R: list, device) -> torch.Tensor:
    """int64 (T,): for each packed token, one replicated position holding it (the prompt from the first copy)."""
    parts, off = [torch.arange(P)], 0
    for r in R:
        parts.append(torch.arange(off + P, off + P + r))
        off += P + r
    return torch.cat(parts).to(device)


class AttnMethod:
    """A pluggable attention: ``setup`` (untimed), ``per_step`` (timed, before the forward), ``__call__``."""

    name = "?"
    replicated = False  # runs on the replicated token axis
    impl = ""

    def setup(self, P: int, R: list, cfg, device) -> None:
        self.P, self.R, self.cfg, self.device = P, list(R), cfg, device

    def per_step(self) -> None:
        pass

    def __call__(self, q, k, v):  # pragma: no cover - abstract
        raise NotImplementedError


class Reference(AttnMethod):
    """Packed tokens, dense (T, T) bool mask, SDPA (math on CPU). For tiny shapes and checks only."""

    name = "reference"

    def setup(self, P, R, cfg, device):
        super().setup(P, R, cfg, device)
        seg = _segments(P, R, device)
        T = seg.numel()
        i = torch.arange(T, device=device)
        self.mask = (i[None, :] <= i[:, None]) & ((seg[None, :] == seg[:, None]) | (seg[None, :] == 0))
        self.impl = "sdpa+dense-mask"

    def __call__(self, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=self.mask, enable_gqa=True)
        return o[0].transpose(0, 1)


def _varlen_kwargs() -> Optional[dict]:
    """Keyword arguments that make torch's varlen_attn causal with GQA, or None if this torch cannot."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" not in params:
        return None
    kw = {"enable_gqa": True}
    if "is_causal" in params:
        kw["is_causal"] = True
    elif "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        return None
    return kw


class FA2(AttnMethod):
    """Flash attention on the replicated layout: each response its own causal sequence ``[P R_i]``, no padding.

    ``fa2_impl``: ``varlen`` = ``torch.nn.attention.varlen.varlen_attn`` (one launch, GQA by index); ``sdpa`` =
    ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` per sequence under the flash backend;
    ``auto`` = varlen on CUDA when this torch's varlen_attn takes GQA and a causal flag, else sdpa.
    """

    name = "fa2"
    replicated = True

    def setup(self, P, R, cfg, device):
        super().setup(P, R, cfg, device)
        lens = [P + r for r in R]
        self.bounds = [0]
        for n in lens:
            self.bounds.append(self.bounds[-1] + n)
        self.cu = torch.tensor(self.bounds, device=device, dtype=torch.int32)
        self.max_len = max(lens)
        impl = cfg.fa2_impl
        kw = _varlen_kwargs() if device.type == "cuda" else None
        if impl == "auto":
            impl = "varlen" if kw is not None else "sdpa"
        if impl == "varlen" and kw is None:
            raise Unavailable("varlen_attn with enable_gqa and a causal flag is not in this torch / device")
        if impl not in ("varlen", "sdpa"):
            raise ValueError(f"fa2_impl must be auto, varlen or sdpa, not {impl!r}")
        self.impl, self.kw = impl, kw

    def __call__(self, q, k, v):
        if self.impl == "varlen":
            from torch.nn.attention.varlen import varlen_attn

            return varlen_attn(q, k, v, self.cu, self.cu, self.max_len, self.max_len, **self.kw)
        outs = []
        g = q.shape[1] // k.shape[1]
        with _flash_ctx(self.device):
            for s, e in zip(self.bounds[:-1], self.bounds[1:]):
                qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
                if getattr(self, "gqa_ok", True):
                    try:
                        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                    except RuntimeError:  # this torch's flash kernel without GQA: repeat K/V heads instead
                        self.gqa_ok = False
                        self.impl += " (kv heads repeated)"
                if not getattr(self, "gqa_ok", True):
                    o = F.scaled_dot_product_attention(qs, _repeat_kv(ks, g, 1), _repeat_kv(vs, g, 1), is_causal=True)
                outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)


def _flash_ctx(device):
    import contextlib

    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _repeat_kv(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=dim)


class PrefixGrouper(AttnMethod):
    """Prefix Grouper style (as the DualKV paper reimplements it): the prompt attends causally to itself once
    (flash SDPA); the responses are padded to ``[mb, R_max]`` queries against ``[mb, P + R_max]`` keys made of the
    prompt's K/V expanded per response and the response's own K/V (KV heads repeated HF-style), with a bool mask
    (prompt visible, causal within the response, padding hidden), SDPA picking its kernel."""

    name = "pg"

    def setup(self, P, R, cfg, device):
        super().setup(P, R, cfg, device)
        mb, rmax = len(R), max(R)
        Rt = torch.tensor(R, device=device)
        rows = torch.repeat_interleave(torch.arange(mb, device=device), Rt)
        starts = torch.cumsum(Rt, 0) - Rt
        cols = torch.arange(int(sum(R)), device=device) - torch.repeat_interleave(starts, Rt)
        self.pad_idx = rows * rmax + cols
        r = torch.arange(rmax, device=device)
        resp_keep = (r[None, :] <= r[:, None])[None] & (r[None, None, :] < Rt[:, None, None])  # (mb, rmax, rmax)
        pre = torch.ones(mb, rmax, P, dtype=torch.bool, device=device)
        self.mask = torch.cat([pre, resp_keep], dim=2)[:, None]  # (mb, 1, rmax, P + rmax)
        self.mb, self.rmax = mb, rmax
        self.impl = "sdpa(prefix causal)+sdpa(padded, mask)"

    def __call__(self, q, k, v):
        P, mb, rmax = self.P, self.mb, self.rmax
        H, Hkv, D = q.shape[1], k.shape[1], q.shape[2]
        g = H // Hkv
        with _flash_ctx(self.device):
            po = F.scaled_dot_product_attention(q[:P].transpose(0, 1)[None], _repeat_kv(k[:P], g, 1).transpose(0, 1)[None],
                                                _repeat_kv(v[:P], g, 1).transpose(0, 1)[None], is_causal=True)
        po = po[0].transpose(0, 1)

        def pad(x):
            z = x.new_zeros(mb * rmax, x.shape[1], D)
            return z.index_copy(0, self.pad_idx, x[P:]).view(mb, rmax, x.shape[1], D)

        qr, kr, vr = pad(q), pad(k), pad(v)
        K = torch.cat([k[:P][None].expand(mb, P, Hkv, D), kr], dim=1)
        V = torch.cat([v[:P][None].expand(mb, P, Hkv, D), vr], dim=1)
        K, V = _repeat_kv(K, g, 2), _repeat_kv(V, g, 2)
        ro = F.scaled_dot_product_attention(qr.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), attn_mask=self.mask)
        ro = ro.transpose(1, 2).reshape(mb * rmax, H, D)[self.pad_idx]
        return torch.cat([po, ro])


_FLEX_FN: dict = {}


def _flex_fn(compile_: bool, static_T: int = 0):
    """flex_attention, compiled once for the sweep, or (``static_T``) compiled with static shapes for one length T
    (dynamo reset when T changes: a full compile per shape, the fastest kernels)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compile_:
        return flex_attention
    if static_T:
        if _FLEX_FN.get("static_T") != static_T:
            torch._dynamo.reset()
            _FLEX_FN.clear()
            _FLEX_FN["static_T"] = static_T
            _FLEX_FN["static"] = torch.compile(flex_attention, dynamic=False)
        return _FLEX_FN["static"]
    if "compiled" not in _FLEX_FN:
        # one compiled flex for every shape of a sweep: the second shape makes dynamo mark the lengths dynamic; a
        # higher recompile limit keeps it from silently falling back to eager flex (which materialises T^2 scores)
        import torch._dynamo.config as dcfg

        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(dcfg, name):
                setattr(dcfg, name, max(getattr(dcfg, name), 64 if "accumulated" not in name else 512))
        _FLEX_FN["compiled"] = torch.compile(flex_attention)
    return _FLEX_FN["compiled"]


def shared_prefix_block_masks(P: int, R: list, device, block: int = 128):
    """Block-level (partial, full) bool masks ``(nQ, nKV)`` of the shared-prefix mask, computed from the layout.

    Query row ``q`` sees keys ``[0, q]`` on the prompt, ``[0, P) U [start(q), q]`` in a response; a block is *full*
    when every query row of it (inside ``T``) sees every key of the key block, *partial* when some pair is visible
    and it is not full. Work ``O(T * nKV)`` in chunks, never ``O(T^2)``.
    """
    T = P + sum(R)
    nb = (T + block - 1) // block
    seg = _segments(P, R, device).long()
    starts = torch.tensor([0] + [P + sum(R[:i]) for i in range(len(R))], device=device)
    q = torch.arange(T, device=device)
    s = starts[seg]  # start of the query's own segment (0 on the prompt)
    hi1 = torch.where(seg == 0, q, torch.full_like(q, P - 1))  # interval 1: [0, hi1]
    kb_lo = torch.arange(nb, device=device) * block
    kb_hi = torch.clamp(kb_lo + block - 1, max=T - 1)
    kb_size = torch.full_like(kb_lo, block)  # a ragged last block is never full (as create_block_mask pads it)
    anyv = torch.zeros(nb, nb, dtype=torch.int32, device=device)  # query rows of the block seeing some key
    notfull = torch.zeros(nb, nb, dtype=torch.int32, device=device)  # query rows of the block missing some key
    rows_per_chunk = max(block, (1 << 24) // max(nb, 1) // block * block)
    for r0 in range(0, T, rows_per_chunk):
        r1 = min(T, r0 + rows_per_chunk)
        qq = q[r0:r1, None]
        lo2 = torch.where(seg[r0:r1] == 0, T, s[r0:r1])[:, None]  # interval 2: [lo2, q] (empty on the prompt)
        c1 = (torch.minimum(hi1[r0:r1, None], kb_hi[None]) - kb_lo[None] + 1).clamp_min(0)
        c2 = (torch.minimum(qq, kb_hi[None]) - torch.maximum(lo2, kb_lo[None]) + 1).clamp_min(0)
        cov = c1 + c2  # visible keys of each key block, per query row
        qb = torch.arange(r0, r1, device=device) // block
        anyv.index_add_(0, qb, (cov > 0).int())
        notfull.index_add_(0, qb, (cov < kb_size[None]).int())
    if T % block:
        notfull[-1] += 1  # the padded query rows of the last block see nothing
    full = notfull == 0
    partial = anyv > 0
    partial = partial & ~full
    return partial, full


def shared_prefix_block_mask(P: int, R: list, device, mask_mod, block: int = 128):
    """FlexAttention ``BlockMask`` of the shared-prefix layout built from :func:`shared_prefix_block_masks` (what a
    trainer that knows its layout does instead of evaluating ``mask_mod`` on all ``T^2`` pairs)."""
    from torch.nn.attention.flex_attention import BlockMask

    T = P + sum(R)
    partial, full = shared_prefix_block_masks(P, R, device, block)

    def dense_to_ordered(m):
        num = m.sum(-1, dtype=torch.int32)
        idx = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = dense_to_ordered(partial)
    fkv_num, fkv_idx = dense_to_ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, fkv_num, fkv_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


class Flex(AttnMethod):
    """FlexAttention on the packed tokens with a shared-prefix block mask
    (``kv <= q and (seg[kv] == seg[q] or seg[kv] == prompt)``), GQA by ``enable_gqa``. ``rebuild``: the block mask
    is rebuilt inside every timed step, as training must when the layout changes each micro-batch."""

    name = "flex"
    rebuild = False

    def setup(self, P, R, cfg, device):
        super().setup(P, R, cfg, device)
        try:
            from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
        except Exception as e:  # pragma: no cover
            raise Unavailable(f"flex_attention not in this torch: {e}")
        if device.type == "cpu":
            raise Unavailable("FlexAttention has no backward on CPU")
        comp = cfg.flex_compile
        comp = (device.type == "cuda") if comp == "auto" else str(comp).lower() in ("1", "true", "yes")
        self.seg = _segments(P, R, device)
        self.T = self.seg.numel()
        self.fn = _flex_fn(comp, self.T if cfg.flex_static else 0)
        kind = ("compiled" + (" static" if cfg.flex_static else "")) if comp else "eager"
        self.impl = f"{kind} {cfg.flex_mask}-mask" + ("/step" if self.rebuild else " once")
        self.block_mask = None if self.rebuild else self._build()

    def _mask_mod(self):
        seg = self.seg

        def shared_prefix(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & ((seg[kv_idx] == seg[q_idx]) | (seg[kv_idx] == 0))

        return shared_prefix

    def _build(self):
        how = self.cfg.flex_mask
        if how == "blocks":
            try:
                return shared_prefix_block_mask(self.P, self.R, self.device, self._mask_mod())
            except TypeError:  # an older BlockMask.from_kv_blocks (no seq_lengths): let create_block_mask build it
                how = "eager"
                self.impl = self.impl.replace("blocks-mask", "eager-mask")
        from torch.nn.attention.flex_attention import create_block_mask

        if how == "compiled":
            if "cbm" not in _FLEX_FN:
                _FLEX_FN["cbm"] = torch.compile(create_block_mask)
            return _FLEX_FN["cbm"](self._mask_mod(), None, None, self.T, self.T, device=self.device)
        if how != "eager":
            raise ValueError(f"flex_mask must be blocks, eager or compiled, not {how!r}")
        return create_block_mask(self._mask_mod(), None, None, self.T, self.T, device=self.device)

    def per_step(self):
        if self.rebuild:
            self.block_mask = self._build()

    def __call__(self, q, k, v):
        o = self.fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    block_mask=self.block_mask, enable_gqa=True)
        return o[0].transpose(0, 1)


class FlexRebuild(Flex):
    name = "flex_rebuild"
    rebuild = True


class DualKV(AttnMethod):
    """Ours: ``kvtransform.ops.dualkv.dualkv_attention`` on the packed tokens with a ``DualKVLayout``
    (built inside every timed step when ``dualkv_layout_per_step``)."""

    name = "dualkv"

    def setup(self, P, R, cfg, device):
        super().setup(P, R, cfg, device)
        try:
            from kvtransform.layout import DualKVLayout
            from kvtransform.ops.dualkv import dualkv_attention
        except Exception as e:
            raise Unavailable(f"DualKV op not importable: {type(e).__name__}: {e}")
        self.op, self.Layout = dualkv_attention, DualKVLayout
        self.per_step_layout = bool(cfg.dualkv_layout_per_step)
        self.layout = self._build()
        self.impl = "kvt.dualkv_attention" + (" layout/step" if self.per_step_layout else "")

    def _build(self):
        return self.Layout.from_lengths([(self.P, list(self.R))], device=self.device)

    def per_step(self):
        if self.per_step_layout:
            self.layout = self._build()

    def __call__(self, q, k, v):
        out = self.op(q, k, v, self.layout)
        return out[0] if isinstance(out, (tuple, list)) else out


METHODS = {m.name: m for m in (Reference, FA2, PrefixGrouper, Flex, FlexRebuild, DualKV)}
ORDER = ["reference", "fa2", "pg", "flex", "flex_rebuild", "dualkv"]


def methods_for(cfg, device, T: int) -> list:
    """Method names a job runs: the one asked for, or with ``all`` every method that applies (``reference`` only on
    CPU or at small T, since it materialises a (T, T) mask)."""
    m = cfg.method.value if isinstance(cfg.method, Method) else str(cfg.method)
    if m != "all":
        return [m]
    return [n for n in ORDER if n != "reference" or device.type == "cpu" or T <= 4096]


# ----------------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(xs: list, p: float) -> float:
    """Linear-interpolated percentile (numpy's default) of a non-empty list."""
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def time_steps(step: Callable, device, warmup: int, iters: int, budget_s: float = 0.0, min_iters: int = 3) -> list:
    """Run ``step(mark)`` ``warmup`` times untimed, then time it ``iters`` times.

    ``step`` calls ``mark()`` at internal boundaries (e.g. between forward and backward). Returns one list per
    iteration of the milliseconds between consecutive marks, the step's start and end included as marks, measured
    with CUDA events on CUDA, ``time.perf_counter`` on CPU. With ``budget_s > 0`` the timed steps are cut to fit the
    budget (never below ``min_iters``), estimated from the last warm-up's wall time.
    """
    cuda = device.type == "cuda"
    noop = lambda: None  # noqa: E731
    t_step = 0.0
    for _ in range(max(warmup, 0)):
        t0 = time.perf_counter()
        step(noop)
        _sync(device)
        t_step = time.perf_counter() - t0
    if budget_s > 0 and t_step > 0:
        iters = max(min(iters, int(budget_s / t_step)), min(min_iters, iters))
    results = []
    if cuda:
        all_marks = []
        for _ in range(iters):
            marks = []

            def mark(marks=marks):
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)

            mark()
            step(mark)
            mark()
            all_marks.append(marks)
        torch.cuda.synchronize(device)
        for marks in all_marks:
            results.append([a.elapsed_time(b) for a, b in zip(marks[:-1], marks[1:])])
    else:
        for _ in range(iters):
            marks = []

            def mark(marks=marks):
                marks.append(time.perf_counter())

            mark()
            step(mark)
            mark()
            results.append([(b - a) * 1e3 for a, b in zip(marks[:-1], marks[1:])])
    return results


# ----------------------------------------------------------------------------------------------------------------
# one job
# ----------------------------------------------------------------------------------------------------------------

_CHECK_REF: dict = {}


def resolve_device(cfg) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def estimate_gb(cfg, shape: Shape, method: str) -> float:
    """Rough peak-memory estimate (GiB) used only to skip runs that cannot fit: weights + grads and about 160
    bf16-equivalent activations of width hidden per token in layer mode, plus pg's expanded K/V."""
    bpe = torch.finfo(_dtype(cfg)).bits // 8
    T = shape.T_rep if method == "fa2" else shape.T
    if _mode(cfg) == Mode.layer:
        params = layer_matmul_params(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp)
        gb = 2 * params * bpe + T * (10 * cfg.hidden + 4 * cfg.mlp) * bpe * 1.6
    else:
        gb = T * (cfg.heads * 4 + cfg.kv_heads * 4) * cfg.head_dim * bpe
    if method == "pg":
        mb, rmax = len(shape.R), max(shape.R)
        gb += 4 * mb * (shape.P + rmax) * cfg.heads * cfg.head_dim * bpe + mb * rmax * (shape.P + rmax) * (1 + bpe)
    if method == "reference":
        gb += shape.T * shape.T * (1 + 4 * cfg.heads)
    return gb / 2**30


def run_method(cfg, shape: Shape, name: str, device) -> list:
    """Time one method on one shape; returns CSV rows (one in layer mode; fwd, bwd, fwdbwd in attn mode)."""
    mode = _mode(cfg)
    dtype = _dtype(cfg)
    base = dict(method=name, impl="", T=shape.T_rep if name == "fa2" else shape.T, iters=0, gb=float("nan"),
                check_rel_err=float("nan"), status="ok")
    passes = ["fwdbwd"] if mode == Mode.layer else ["fwd", "bwd", "fwdbwd"]

    def fail(status):
        return [dict(base, **{"pass": p, "status": status}) for p in passes]

    cap = cfg.max_mem_gb or (torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else 0)
    if cap and estimate_gb(cfg, shape, name) > 1.2 * cap:
        return fail(f"skip-mem (est {estimate_gb(cfg, shape, name):.0f} GiB)")
    if name not in METHODS:
        return fail(f"unknown method {name}")
    meth = METHODS[name]()
    state = {}
    try:
        try:
            meth.setup(shape.P, shape.R, cfg, device)
        except Unavailable as e:
            return fail(f"unavailable: {e}")
        base["impl"] = meth.impl
        g = torch.Generator(device=device).manual_seed(cfg.seed + 1)
        rep = _replicated_index(shape.P, shape.R, device) if meth.replicated else None
        back = _packed_from_replicated(shape.P, shape.R, device) if meth.replicated else None

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
                return layer(x, meth, return_attn=True)[1].detach()

            def step(mark):
                x.grad = None
                for p in params:
                    p.grad = None
                meth.per_step()
                out = layer(x, meth)
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
                meth.per_step()
                out = meth(q, k, v)
                mark()
                out.backward(do)

        if cfg.check:
            a = forward_attn()
            if back is not None:
                a = a[back]
            finite = bool(torch.isfinite(a).all())
            key = (mode, shape.P, tuple(shape.R), cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.seed, str(dtype))
            if key not in _CHECK_REF:
                _CHECK_REF.clear()
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
            r = dict(base, **{"pass": p})
            r.update(ms_p20=percentile(ms, 20), ms_p50=percentile(ms, 50), ms_p80=percentile(ms, 80),
                     ms_mean=sum(ms) / len(ms))
            if mode == Mode.layer:
                flops = shape.layer_flops
            else:
                flops = shape.attn_fwd_flops * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[p]
            r["tflops"] = flops / (r["ms_p50"] * 1e-3) / 1e12
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
        for layer_ in _LAYER_CACHE.values():
            for p in layer_.parameters():
                p.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_job(cfg, on_row: Optional[Callable] = None) -> list:
    """All methods of one job (one P, one mb) in this process; returns CSV rows (without run metadata)."""
    device = resolve_device(cfg)
    shape = Shape.of(cfg)
    rows = []
    for name in methods_for(cfg, device, shape.T):
        for r in run_method(cfg, shape, name, device):
            r.update(mode=_mode(cfg).value, P=shape.P, mb=len(shape.R), T_packed=shape.T, T_replicated=shape.T_rep,
                     floor_ms=shape.floor_ms)
            rows.append(r)
            if on_row is not None:
                on_row(r)
    return rows
