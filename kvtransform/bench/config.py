"""Structured configs of the benchmark suites, registered in Hydra's ConfigStore (a misspelt key or an unknown
enum value on the command line is a composition error, not a silently ignored setting).

Suites (``kvtransform bench SUITE [overrides...] [-m]``):

* ``dualkv-layer``: one Qwen3-8B-shaped decoder layer (hidden 4096, 32 heads, 8 KV heads, head_dim 128, MLP 14336,
  RMSNorm, no RoPE), bf16, forward+backward of ``out.sum()``, N = ``mb`` responses of lengths
  ``torch.randint(r_min, r_max + 1, (mb,), generator=Generator().manual_seed(seed))`` sharing one prompt of ``P``
  tokens. Source: DualKV (arXiv 2605.15422) App. F.4; the paper's numbers are in :mod:`kvtransform.bench.seed`.
* ``dualkv-attn``: the same layout, attention op alone (the paper's Table 1 kernel shapes), forward and backward
  timed separately, with useful TFLOP/s; ``kernel_check=true`` runs the bf16 checks of the Triton kernels first,
  ``tune=true`` sweeps their launch configs at the job's shape (then ``dualkv_kernel`` runs with the best).
* ``decode-ops``: SpeContext's decode ops (arXiv 2512.00722, §4.3) at one cache length ``S``: retrieval top-k and
  sparse gather decode against dense SDPA decode over the whole cache and a naive ``torch.gather`` + SDPA, with the
  device's copy bandwidth measured in the same job and the HBM floor (bytes moved / copy bandwidth) per row.
* ``decode``: end-to-end decode throughput (SpeContext Table 5; :class:`DecodeBenchConfig`).
* ``tree-attn`` / ``tree-layer``: prefix-tree attention on agentic trees (Tree Training, arXiv 2511.00413) and on
  DualKV's one-level shapes; configs in :mod:`.tree_config`.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hydra.core.config_store import ConfigStore

from .config_common import DType, _at_least, _check_device, _check_gqa
from .tree_config import TreeAttnBenchConfig, TreeLayerBenchConfig, validate_tree


class Method(Enum):
    """Attention implementations compared (``all`` = every one that applies to the device, in one process)."""

    all = "all"
    reference = "reference"  # packed tokens, dense bool mask, math SDPA (CPU / tiny shapes only)
    fa2 = "fa2"  # flash attention on the replicated N*(P+R_i) tokens (varlen or per-sequence flash SDPA)
    pg = "pg"  # Prefix Grouper style: prefix once, responses padded [mb, R_max] against expanded prefix K/V
    flex = "flex"  # FlexAttention on the packed tokens, shared-prefix block mask built once
    flex_rebuild = "flex_rebuild"  # the same, block mask rebuilt inside every step (layout changes per micro-batch)
    dualkv = "dualkv"  # ours: kvt.dualkv_attention on the packed tokens
    dualkv_kernel = "dualkv_kernel"  # ours: the Triton kernels called directly (attn mode; tune=true's best config)
    dualkv_compiled = "dualkv_compiled"  # layer mode: the whole layer under torch.compile, kvt ops opaque
    flex_compiled = "flex_compiled"  # layer mode: the whole layer under torch.compile around flex_attention


class Mode(Enum):
    layer = "layer"  # whole decoder layer, forward+backward of out.sum()
    attn = "attn"  # attention op alone: forward, backward, forward+backward


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
        kernel_check: first run the bf16 checks of the DualKV Triton kernels against fp64 references (a row with
            ``pass=check``; the run fails after writing its CSV when a check fails). CUDA (or TRITON_INTERPRET=1).
        tune: sweep the kernels' launch configs at the job's shape (rows ``dualkv_kernel_tune``) and time
            ``dualkv_kernel`` with the best (attn mode).
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
        window, softcap, sinks: the attention variants of the DualKV op and kernels (``kvt.dualkv_attention``'s
            arguments; ``kernels/attention_tiles.py``): a sliding window of ``window`` tokens (0 = none), logit
            soft-capping at ``softcap`` (0 = none), learned per-head sinks (random logits, with their gradient).
            Only ``dualkv`` and ``dualkv_kernel`` take them (the other methods are recorded ``unavailable``);
            ``kernel_check`` then also checks the kernels with them.
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
    kernel_check: bool = False
    tune: bool = False
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
    window: int = 0
    softcap: float = 0.0
    sinks: bool = False


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


class DecodeMethod(Enum):
    """Ops timed by ``decode-ops`` (``all`` = every one, in one process). Bytes = what the op must move."""

    all = "all"
    sparse_decode = "sparse_decode"  # kvt.sparse_decode_attention, gather mode (B selected rows per KV head)
    sparse_decode_sorted = "sparse_decode_sorted"  # the same with sorted indices
    sparse_decode_slots = "sparse_decode_slots"  # slot mode: dense (batch, H_kv, B, D) buffers
    gather_sdpa = "gather_sdpa"  # naive: torch.gather of the selected rows, then SDPA
    sdpa_flash = "sdpa_flash"  # dense decode over the whole cache, SDPA flash backend
    sdpa = "sdpa"  # dense decode over the whole cache, SDPA's own backend choice
    sparse_decode_dense = "sparse_decode_dense"  # our kernel in slot mode over the whole cache
    retrieval_topk = "retrieval_topk"  # kvt.retrieval_topk: scoring + top-k
    retrieval_scoring = "retrieval_scoring"  # the Triton scoring kernels alone
    topk = "topk"  # torch.topk (sorted, as the op) of the scores
    topk_unsorted = "topk_unsorted"  # torch.topk(sorted=False)


class GatherTune(Enum):
    none = "none"
    small = "small"
    full = "full"


@dataclass
class DecodeOpsConfig:
    """One ``decode-ops`` job: one cache length ``S`` (``-m S=4096,16384,32768`` sweeps), every op or one.

    Attributes:
        suite: suite name, recorded in the CSV and the reproduce command.
        method: one of :class:`DecodeMethod`; ``all`` runs every op.
        S: cache length in tokens (every row full: ``cache_seqlens = S``).
        batch: decode rows (sequences), one new token each.
        heads, kv_heads, head_dim: attention shape (GQA ``heads / kv_heads``); the retrieval head has the same.
        budget: selected tokens per KV head (SpeContext's ``B``).
        dtype: dtype of q and the caches.
        device: ``auto`` (cuda if available, else cpu), ``cuda`` or ``cpu``.
        warmup: untimed calls before timing.
        iters: timed samples; p20/p50/p80 are over these.
        cuda_graph: time CUDA-graph replays (decode runs under graphs; launch overhead would dominate otherwise).
        sample_ms: with ``cuda_graph``, about this many ms of calls are captured in one graph per sample.
        bandwidth_mib: size of the buffer of the copy / read bandwidth rows (measured first in every job).
        kernel_check: first run the bf16 checks of the retrieval and sparse decode kernels (row ``pass=check``).
        tune: sweep the gather kernel's launch config (``small``: 8 configs, ``full``: 51); adds
            ``sparse_decode_tuned`` rows.
        retrieval_tune: sweep the retrieval scoring kernel's launch config; adds ``retrieval_*_tuned`` rows.
        out_dir, append, plot: as in the DualKV suites.
    """

    suite: str = "decode-ops"
    method: DecodeMethod = DecodeMethod.all
    S: int = 32768
    batch: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    budget: int = 2048
    seed: int = 0
    dtype: DType = DType.bfloat16
    device: str = "auto"
    warmup: int = 3
    iters: int = 20
    cuda_graph: bool = True
    sample_ms: float = 20.0
    bandwidth_mib: int = 1024
    kernel_check: bool = False
    tune: GatherTune = GatherTune.none
    retrieval_tune: bool = False
    out_dir: str = "out/bench/decode-ops"
    append: bool = False
    plot: bool = True


class ThroughputMethod(Enum):
    """Generation paths timed by ``decode`` (``all`` = every one, in one process)."""

    all = "all"
    hf_sdpa = "hf_sdpa"  # HF generate, DynamicCache, sdpa attention
    hf_static = "hf_static"  # HF generate with a StaticCache (HF compiles the decode step itself)
    dense = "dense"  # our runtime, every cached token (full attention), CUDA graphs
    specontext = "specontext"  # our runtime, the distilled retrieval head, budget B
    quest = "quest"  # our runtime, Quest pages, budget B
    flashinfer = "flashinfer"  # dense with FlashInfer's batch decode kernel as the attention (when importable)
    specontext_offload = "specontext_offload"  # specontext with KV offload: the memory plan's request count


@dataclass
class DecodeBenchConfig:
    """One ``decode`` job: one model shape and one ``[input, output]`` request shape (``-m model=llama-8b,qwen3-8b
    input=2048 output=16384,32768`` sweeps); SpeContext Table 5 (arXiv 2512.00722 §7). Runner and method:
    :mod:`kvtransform.bench.decode`.

    Attributes:
        suite: suite name, recorded in the CSV and the reproduce command.
        method: one of :class:`ThroughputMethod`; ``all`` runs every method: ``hf_sdpa`` (HF generate,
            DynamicCache), ``hf_static`` (HF generate, StaticCache, compiled by HF), ``dense`` (our runtime, every
            cached token), ``specontext`` (our runtime, the distilled retrieval head, ``budget`` tokens),
            ``quest`` (Quest pages), ``flashinfer`` (dense through FlashInfer's decode kernel),
            ``specontext_offload`` (specontext with KV offload, §5-6: a request count the memory plan serves within
            ``gpu_gb`` and ``host_gb`` (``offload_count``), some layers' KV in pinned CPU memory with elastic
            loading; step rows give ``offloaded_layers``, the run row's note the layers on CPU by the last token).
        model: the model shape, a key of :data:`kvtransform.bench.decode.MODELS`: ``llama-8b``
            (DeepSeek-R1-Distill-Llama-8B), ``qwen3-8b`` (Qwen3-8B), ``smollm2-135m`` (the default model's shape) or
            ``tiny`` (CPU smoke); random bf16 weights
            (speed does not depend on their values).
        input, output: prompt and generated tokens per request.
        budget: SpeContext's B, tokens selected per KV head (``specontext``, ``quest``).
        requests: concurrent requests (0: the largest count whose memory fits, per method).
        max_requests: cap of the automatic request count.
        reserve_gb: GiB of device memory left free when sizing the request count (activations, graphs, compile;
            CUDA only).
        gpu_gb: cap on the memory every method may use, in GiB (2^30 bytes, the unit CUDA reports: the "total
            capacity" of its out-of-memory message), so each method is compared at the memory of a smaller card
            (0: the whole device). Everything counts against it: CUDA context, weights, KV caches, workspace and
            reserve_gb; the request counts shrink to fit, and on CUDA PyTorch's allocator is limited to the cap
            (torch.cuda.set_per_process_memory_fraction), so going past it is a real out-of-memory error. Cards
            give a process less than their name: an A800/A100 "80GB" reports 79.1-79.3 GiB (gpu_gb=79.1), an
            H200 "141GB" about 140 GiB (gpu_gb=141 is refused there; its whole card is gpu_gb=0). Refused when
            larger than the device (on a CPU: cpu_memory_gb) or smaller than the weights plus reserve_gb.
            (GiB, as plan-memory's gpu_gb.)
        cpu_memory_gb: the memory the request count is sized for on a CPU (all of it).
        host_gb: pinned CPU memory the ``specontext_offload`` method may hold for the layers it offloads, in GiB
            (0: three quarters of the memory available when the job starts); with ``gpu_gb`` it bounds that
            method's request count.
        offload_count: how ``specontext_offload`` picks its request count (``requests=0``): ``throughput`` (the
            count whose plan has the most modelled tokens/s, :mod:`kvtransform.runtime.throughput`, the model
            calibrated by two timed samples at the largest count) or ``largest`` (the largest count that fits).
        samples: context lengths at which decode steps are timed (spread over the run).
        steps: decode steps timed per sample; n0: steps of the reference run subtracted (capture, warm-up). The two
            runs' fixed costs (CUDA-graph capture, the head's prefill) vary by tens of ms between runs, which 16
            steps of ~10 ms did not average out (H200, specontext samples 8.3-12.6 ms for the same work): 64.
        prefill_tokens: prompt tokens per timed prefill (``ceil(prefill_tokens / input)`` requests, scaled).
        compile: our runtime's ``torch.compile`` of the decode program (SpeContextConfig.compile; CUDA only). On by
            default: on the H200 it took the Llama-8B step (25 requests, 8K context) from 10.29 to 7.96 ms
            (specontext) and 15.86 to 12.76 ms (dense), for ~30 s of compile per method and configuration.
        cuda_graphs: our runtime's CUDA graphs.
        fuse_projections: our runtime's projection fusion of the decode program (SpeContextConfig.fuse_projections:
            ``all``, ``qkv`` or ``none``); fusion happens before the request count is sized (the parameters become
            views of the fused weights: no memory is added; BENCHMARKS.md, "Decode throughput").
        flashinfer_tensor_cores: the ``flashinfer`` method's FlashInfer ``use_tensor_cores`` (its prefill kernel
            run for decode, meant for large GQA groups). On by default: FlashInfer's fastest decode here (H200,
            Llama-8B shape, 26 requests, [2k, 32k]: 1177 tokens/s, against 524 with its CUDA-core decode kernel).
        validate: also run the whole generation once per method and compare it with the sampled estimate (rows
            ``pass=validate``; for a short ``output``).
        seed, dtype, device, out_dir, append, plot: as in the other suites.
    """

    suite: str = "decode"
    method: ThroughputMethod = ThroughputMethod.all
    model: str = "llama-8b"
    input: int = 2048
    output: int = 32768
    budget: int = 2048
    requests: int = 0
    max_requests: int = 256
    reserve_gb: float = 8.0
    gpu_gb: float = 0.0
    cpu_memory_gb: float = 4.0
    host_gb: float = 0.0
    offload_count: str = "throughput"
    samples: int = 5
    steps: int = 64
    n0: int = 4
    prefill_tokens: int = 16384
    compile: bool = True
    cuda_graphs: bool = True
    fuse_projections: str = "all"
    flashinfer_tensor_cores: bool = True
    validate: bool = False
    seed: int = 0
    dtype: DType = DType.bfloat16
    device: str = "auto"
    out_dir: str = "out/bench/decode"
    append: bool = False
    plot: bool = True


SUITES = {
    "dualkv-layer": DualKVBenchConfig,
    "dualkv-attn": DualKVAttnBenchConfig,
    "decode-ops": DecodeOpsConfig,
    "decode": DecodeBenchConfig,
    "tree-attn": TreeAttnBenchConfig,
    "tree-layer": TreeLayerBenchConfig,
}


_CHOICES = {
    "fa2_impl": ("auto", "varlen", "sdpa"),
    "flex_compile": ("auto", "true", "false", "1", "0", "yes", "no"),
    "flex_mask": ("blocks", "eager", "compiled"),
    "fuse_projections": ("none", "qkv", "all"),
}


def validate_decode(cfg) -> None:
    """Check one composed ``decode-ops`` job before anything runs.

    Raises:
        ValueError: one line naming the setting, its value and the fix: ``S``, ``batch``, the heads, ``head_dim``,
            ``budget``, ``iters``, ``bandwidth_mib`` below 1, ``budget > S``, ``heads`` not divisible by
            ``kv_heads``, ``head_dim > 256``, a negative ``warmup``, ``sample_ms <= 0`` or an unparsable ``device``.
    """
    _at_least(cfg, {"S": "the cache length in tokens", "batch": "the number of decode rows",
                    "heads": "the number of query heads", "kv_heads": "the number of KV heads",
                    "head_dim": "the head dimension", "budget": "the selected tokens per KV head",
                    "iters": "the number of timed samples", "bandwidth_mib": "the bandwidth buffer in MiB"}, 1)
    _at_least(cfg, {"warmup": "the number of untimed calls"}, 0)
    if cfg.budget > cfg.S:
        raise ValueError(f"budget={cfg.budget} > S={cfg.S}: retrieval selects budget of the S cached tokens; "
                         f"set budget <= S")
    _check_gqa(cfg)
    if cfg.head_dim > 256:
        raise ValueError(f"head_dim={cfg.head_dim}: the decode kernels take head_dim up to 256")
    if not cfg.sample_ms > 0:
        raise ValueError(f"sample_ms={cfg.sample_ms}: the length of one timed CUDA-graph sample must be > 0")
    _check_device(cfg)


def validate_throughput(cfg) -> None:
    """Check one composed ``decode`` job before anything runs.

    Raises:
        ValueError: one line naming the setting, its value and the fix: ``input``, ``output``, ``budget``,
            ``samples``, ``steps``, ``max_requests``, ``prefill_tokens`` below 1, negative ``requests``/``n0``/
            ``reserve_gb``/``gpu_gb``, a ``gpu_gb`` cap larger than the device or smaller than the weights plus
            the reserve (:func:`~.decode_model.check_cap`), ``output`` too short for one timed sample (``n0 +
            steps + 2``), ``n0 < 2`` (the reference run must include the CUDA-graph capture), an unknown ``model``,
            ``input + output`` beyond the model's positions, an unparsable ``device``, an ``offload_count`` other
            than throughput or largest.
    """
    _at_least(cfg, {"input": "the prompt tokens per request", "output": "the generated tokens per request",
                    "budget": "the selected tokens per KV head", "samples": "the number of sampled contexts",
                    "steps": "the decode steps timed per sample", "max_requests": "the cap of the request count",
                    "prefill_tokens": "the prompt tokens per timed prefill"}, 1)
    _at_least(cfg, {"requests": "the concurrent requests (0 = as many as fit)"}, 0)
    _at_least(cfg, {"n0": "the steps of the reference run (it must include the CUDA-graph capture)"}, 2)
    for key in ("reserve_gb", "cpu_memory_gb", "gpu_gb", "host_gb"):
        if not 0 <= getattr(cfg, key) < float("inf"):
            raise ValueError(f"{key}={getattr(cfg, key)}: {key} is GiB and must be >= 0 and finite")
    if cfg.offload_count not in ("throughput", "largest"):
        raise ValueError(f"offload_count={cfg.offload_count!r}: choose throughput or largest")
    if cfg.output < cfg.n0 + cfg.steps + 2:
        raise ValueError(f"output={cfg.output} is shorter than one timed sample (n0 + steps + 2 = "
                         f"{cfg.n0 + cfg.steps + 2} tokens): raise output or lower steps")
    from .decode_model import MODELS

    if str(cfg.model) not in MODELS:
        raise ValueError(f"model={cfg.model}: choose one of {', '.join(MODELS)}")
    positions = MODELS[str(cfg.model)]["positions"]
    if cfg.input + cfg.output > positions:
        raise ValueError(f"input + output = {cfg.input + cfg.output} tokens exceed the {positions} positions of "
                         f"model={cfg.model}: shorten input or output")
    _check_device(cfg)
    if cfg.gpu_gb:
        import torch

        from .decode_model import check_cap
        from .device import resolve_device
        from .layer import torch_dtype

        dev = resolve_device(cfg)
        if dev.type != "cuda" or torch.cuda.is_available():  # (no CUDA here: bench run refuses the job itself)
            check_cap(float(cfg.gpu_gb), str(cfg.model), torch_dtype(cfg), dev, float(cfg.reserve_gb),
                      float(cfg.cpu_memory_gb))


def validate(cfg) -> None:
    """Check the values of one composed job (types are Hydra's job) before anything runs; ``decode-ops`` jobs go to
    :func:`validate_decode`.

    Raises:
        ValueError: one line naming the setting, its value and the fix: ``P``, ``mb``, ``r_min``, ``iters``,
            ``min_iters`` and the layer shape below 1, ``r_min > r_max``, ``heads`` not divisible by ``kv_heads``,
            a negative ``warmup``/``time_budget_s``/``max_mem_gb``, ``matmul_tflops <= 0``, an unknown
            ``fa2_impl``/``flex_compile``/``flex_mask`` or an unparsable ``device``.
    """
    from omegaconf import OmegaConf

    if OmegaConf.get_type(cfg) is DecodeOpsConfig:
        return validate_decode(cfg)
    if OmegaConf.get_type(cfg) is DecodeBenchConfig:
        return validate_throughput(cfg)
    if OmegaConf.get_type(cfg) in (TreeAttnBenchConfig, TreeLayerBenchConfig):
        return validate_tree(cfg)
    _at_least(cfg, {
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
    }, 1)
    if cfg.r_min > cfg.r_max:
        raise ValueError(f"r_min={cfg.r_min} > r_max={cfg.r_max}: response lengths are drawn uniformly from "
                         f"[r_min, r_max]; set r_min <= r_max")
    _check_gqa(cfg)
    for key, what in (("warmup", "untimed steps"), ("time_budget_s", "seconds (0 = no budget)"),
                      ("max_mem_gb", "GiB (0 = the device's memory)")):
        val = getattr(cfg, key)
        if val < 0:
            raise ValueError(f"{key}={val}: {key} counts {what} and must be >= 0")
    if not cfg.matmul_tflops > 0:
        raise ValueError(f"matmul_tflops={cfg.matmul_tflops}: the matmul rate of the FLOP floor must be > 0")
    if cfg.window < 0 or not 0 <= cfg.softcap < float("inf"):
        raise ValueError(f"window={cfg.window} softcap={cfg.softcap}: window is a token count and softcap a finite "
                         f"logit cap, both >= 0 (0 = off)")
    for key, allowed in _CHOICES.items():
        if not hasattr(cfg, key):  # a key of another suite
            continue
        val = str(getattr(cfg, key))
        if (val.lower() if key == "flex_compile" else val) not in allowed:
            raise ValueError(f"{key}={getattr(cfg, key)}: {key} must be one of {', '.join(allowed)}")
    _check_device(cfg)


def register() -> None:
    """Store every suite's config under its suite name (idempotent)."""
    cs = ConfigStore.instance()
    for name, node in SUITES.items():
        cs.store(name=name, node=node)


register()
