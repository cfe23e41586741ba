"""The test decoder layer of the ``dualkv-layer`` suite: Qwen3-8B-shaped (DualKV, arXiv 2605.15422, App. F.4),
attention pluggable, on a flat token axis (packed or replicated layout)."""
from __future__ import annotations

import gc
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DecoderLayer", "get_layer", "release_grads", "torch_dtype"]

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def torch_dtype(cfg) -> torch.dtype:
    """The torch dtype of a suite config's ``dtype`` (enum or string)."""
    name = cfg.dtype.value if hasattr(cfg.dtype, "value") else str(cfg.dtype)
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


class DecoderLayer(nn.Module):
    """Qwen3-shaped decoder layer without RoPE on a flat token axis, attention pluggable.

    ``x (T, hidden)`` -> ``x + o(attn(q, k, v))`` -> ``+ down(silu(gate) * up)``, pre-RMSNorm, Qwen3's per-head
    RMSNorm on q and k when ``qk_norm``. ``attn(q (T, H, D), k (T, H_kv, D), v (T, H_kv, D)) -> (T, H, D)``.
    Weights are drawn from ``seed`` on ``device`` (normal, std 0.02; norms 1), in ``dtype``.
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
    key = (cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.qk_norm, torch_dtype(cfg), str(device),
           cfg.seed)
    if key not in _LAYER_CACHE:
        _LAYER_CACHE.clear()
        gc.collect()
        _LAYER_CACHE[key] = DecoderLayer(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.qk_norm,
                                         torch_dtype(cfg), device, cfg.seed)
    return _LAYER_CACHE[key]


def release_grads() -> None:
    """Drop the cached layer's gradients (between methods, so one method's grads do not count in the next's peak)."""
    for layer in _LAYER_CACHE.values():
        for p in layer.parameters():
            p.grad = None
