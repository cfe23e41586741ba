"""Structured configs of the benchmark suites, registered in Hydra's ConfigStore (a misspelt key or an unknown
enum value on the command line is a composition error, not a silently ignored setting).

Suites (``kvtransform bench SUITE [overrides...] [-m]``):

* ``dualkv-layer``: one Qwen3-8B-shaped decoder layer (hidden 4096, 32 heads, 8 KV heads, head_dim 128, MLP 14336,
  RMSNorm, no RoPE), bf16, forward+backward of ``out.sum()``, N = ``mb`` responses of lengths
  ``torch.randint(r_min, r_max + 1, (mb,), generator=Generator().manual_seed(seed))`` sharing one prompt of ``P``
  tokens. Source: DualKV (arXiv 2605.15422) App. F.4; the paper's numbers are in :mod:`kvtransform.bench.seed`.
* ``dualkv-attn``: the same layout, attention op alone (the paper's Table 1 kernel shapes), forward and backward
  timed separately, with useful TFLOP/s.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hydra.core.config_store import ConfigStore


class Method(Enum):
    """Attention implementations compared (``all`` = every one that applies to the device, in one process)."""

    all = "all"
    reference = "reference"  # packed tokens, dense bool mask, math SDPA (CPU / tiny shapes only)
    fa2 = "fa2"  # flash attention on the replicated N*(P+R_i) tokens (varlen or per-sequence flash SDPA)
    pg = "pg"  # Prefix Grouper style: prefix once, responses padded [mb, R_max] against expanded prefix K/V
    flex = "flex"  # FlexAttention on the packed tokens, shared-prefix block mask built once
    flex_rebuild = "flex_rebuild"  # the same, block mask rebuilt inside every step (layout changes per micro-batch)
    dualkv = "dualkv"  # ours: kvt.dualkv_attention on the packed tokens


class Mode(Enum):
    layer = "layer"  # whole decoder layer, forward+backward of out.sum()
    attn = "attn"  # attention op alone: forward, backward, forward+backward


class DType(Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


@dataclass
class DualKVBenchConfig:
    """One benchmark job (one ``P``, one ``mb``, one method or ``all``); ``-m`` sweeps expand into many jobs that
    run in one process and land in one CSV.

    Attributes:
        suite: suite name, recorded in the CSV and the reproduce command.
        mode: ``layer`` (decoder layer fwd+bwd) or ``attn`` (attention op alone).
        method: one of :class:`Method`; ``all`` runs every method that applies to the device.
        P: prompt (shared prefix) length in tokens.
        mb: number of responses sharing the prompt.
        r_min, r_max: response lengths are drawn uniformly from ``[r_min, r_max]`` with ``seed``.
        seed: seed of the response lengths (42 = the paper's) and of the weights / inputs.
        hidden, heads, kv_heads, head_dim, mlp: layer shape (Qwen3-8B by default).
        qk_norm: Qwen3's per-head RMSNorm on q and k.
        dtype: compute dtype of weights and activations.
        device: ``auto`` (cuda if available, else cpu), ``cuda`` or ``cpu``.
        warmup: untimed steps before timing (the paper: 2).
        iters: timed steps (the paper: 5); p20/p50/p80 are over these.
        time_budget_s: if > 0, fewer timed steps (never under ``min_iters``) when one step is so slow that ``iters``
            steps would exceed this many seconds.
        min_iters: floor of timed steps under ``time_budget_s``.
        check: compare each method's attention output with the first method run on the same shape (relative
            Frobenius error, recorded in the CSV).
        matmul_tflops: bf16 matmul rate used for the FLOP floor (790 = measured on the H200).
        fa2_impl: ``auto`` (varlen_attn with GQA if torch has it, else per-sequence flash SDPA), ``varlen``, ``sdpa``.
        flex_compile: ``auto`` (torch.compile on CUDA, eager on CPU), ``true`` or ``false``.
        flex_mask: how the FlexAttention block mask is built: ``blocks`` (from the layout's segment bounds, O(T * T/128)
            work, what a trainer that knows its layout does), ``eager`` (``create_block_mask``, evaluates the mask on
            all T^2 pairs) or ``compiled`` (``torch.compile(create_block_mask)``).
        flex_static: compile flex_attention with static shapes for each T (dynamo reset per shape: a full compile per
            job, but static-shape kernels). Default off: one compile shared by the sweep, dynamic after the first
            shape; on the H200 (BENCHMARKS.md) those later shapes ran 1-9% slower than the calibration's flex.
        dualkv_layout_per_step: build the DualKV layout inside each timed step (as training must).
        max_mem_gb: skip (status ``skip-mem``) a method whose estimated peak exceeds this (0 = the device's memory).
        out_dir: where ``results.csv``, ``results.md`` and ``results.png`` are written.
        append: append to an existing ``results.csv`` in ``out_dir`` instead of replacing it.
        plot: write the PNG plot.
    """

    suite: str = "dualkv-layer"
    mode: Mode = Mode.layer
    method: Method = Method.all
    P: int = 8192
    mb: int = 8
    r_min: int = 131
    r_max: int = 2048
    seed: int = 42
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    qk_norm: bool = True
    dtype: DType = DType.bfloat16
    device: str = "auto"
    warmup: int = 2
    iters: int = 5
    time_budget_s: float = 0.0
    min_iters: int = 3
    check: bool = True
    matmul_tflops: float = 790.0
    fa2_impl: str = "auto"
    flex_compile: str = "auto"
    flex_mask: str = "blocks"
    flex_static: bool = False
    dualkv_layout_per_step: bool = True
    max_mem_gb: float = 0.0
    out_dir: str = "out/bench/dualkv-layer"
    append: bool = False
    plot: bool = True


@dataclass
class DualKVAttnBenchConfig(DualKVBenchConfig):
    """``dualkv-attn``: the attention op alone at the paper's Table 1 kernel shapes (H=32, H_kv=8, D=128)."""

    suite: str = "dualkv-attn"
    mode: Mode = Mode.attn
    P: int = 8192
    mb: int = 16
    iters: int = 10
    warmup: int = 3
    out_dir: str = "out/bench/dualkv-attn"


SUITES = {
    "dualkv-layer": DualKVBenchConfig,
    "dualkv-attn": DualKVAttnBenchConfig,
}


_CHOICES = {
    "fa2_impl": ("auto", "varlen", "sdpa"),
    "flex_compile": ("auto", "true", "false", "1", "0", "yes", "no"),
    "flex_mask": ("blocks", "eager", "compiled"),
}


def validate(cfg) -> None:
    """Check the values of one composed job (types are Hydra's job) before anything runs.

    Raises:
        ValueError: one line naming the setting, its value and the fix: ``P``, ``mb``, ``r_min``, ``iters``,
            ``min_iters`` and the layer shape below 1, ``r_min > r_max``, ``heads`` not divisible by ``kv_heads``,
            a negative ``warmup``/``time_budget_s``/``max_mem_gb``, ``matmul_tflops <= 0``, an unknown
            ``fa2_impl``/``flex_compile``/``flex_mask`` or an unparsable ``device``.
    """
    at_least_1 = {
        "P": "the prompt (shared prefix) length in tokens",
        "mb": "the number of responses sharing the prompt",
        "r_min": "the shortest response length in tokens",
        "r_max": "the longest response length in tokens",
        "iters": "the number of timed steps",
        "min_iters": "the floor of timed steps under time_budget_s",
        "hidden": "the layer's hidden size",
        "heads": "the number of query heads",
        "kv_heads": "the number of KV heads",
        "head_dim": "the head dimension",
        "mlp": "the MLP width",
    }
    for key, what in at_least_1.items():
        val = getattr(cfg, key)
        if val < 1:
            raise ValueError(f"{key}={val}: {key} is {what} and must be >= 1; set {key}=1 or more")
    if cfg.r_min > cfg.r_max:
        raise ValueError(f"r_min={cfg.r_min} > r_max={cfg.r_max}: response lengths are drawn uniformly from "
                         f"[r_min, r_max]; set r_min <= r_max")
    if cfg.heads % cfg.kv_heads != 0:
        raise ValueError(f"heads={cfg.heads} is not divisible by kv_heads={cfg.kv_heads} (GQA); pick kv_heads "
                         f"dividing heads")
    for key, what in (("warmup", "untimed steps"), ("time_budget_s", "seconds (0 = no budget)"),
                      ("max_mem_gb", "GiB (0 = the device's memory)")):
        val = getattr(cfg, key)
        if val < 0:
            raise ValueError(f"{key}={val}: {key} counts {what} and must be >= 0")
    if not cfg.matmul_tflops > 0:
        raise ValueError(f"matmul_tflops={cfg.matmul_tflops}: the matmul rate of the FLOP floor must be > 0")
    for key, allowed in _CHOICES.items():
        val = str(getattr(cfg, key))
        if (val.lower() if key == "flex_compile" else val) not in allowed:
            raise ValueError(f"{key}={getattr(cfg, key)}: {key} must be one of {', '.join(allowed)}")
    if str(cfg.device) != "auto":
        import torch

        try:
            torch.device(str(cfg.device))
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"device={cfg.device}: device must be auto, cpu, cuda or cuda:N") from None


def register() -> None:
    """Store every suite's config under its suite name (idempotent)."""
    cs = ConfigStore.instance()
    for name, node in SUITES.items():
        cs.store(name=name, node=node)


register()
