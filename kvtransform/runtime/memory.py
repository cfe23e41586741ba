"""The SpeContext memory model (arXiv 2512.00722 §6, Eq. 6–8, Alg. 1–2): when each layer's KV cache moves to CPU
during a long decode, and the largest batch that fits a GPU.

Notation (all sizes in bytes, lengths in tokens per row):

* ``M``: GPU memory the run may use (``gpu_bytes``); ``W``: the LLM's weights; ``P``: the retrieval head's own
  weights; ``R``: a reserve for activations and workspace (``reserve_bytes``);
* ``L`` layers, ``b`` rows (batch), ``c = 2 · H_kv · D · e``: K+V bytes of one token of one layer of one row
  (``e``: bytes per element of the KV dtype); ``c_h``: the head's own per-token state of one row (e.g. the
  distilled head's one-layer key cache; 0 for heads that keep none);
* ``B``: the budget, tokens per KV head attended per step; an offloaded layer keeps a ``B``-token slot buffer on the
  GPU (``b · B · c`` bytes) and its full K/V in pinned CPU memory;
* ``n``: the cached sequence length (the longest row), growing from the input length ``I`` to ``S = I + O``.

**Eq. 6** (GPU memory at length ``n`` with ``k`` layers offloaded)::

    M_k(n) = W + P + R + b · [ (L − k) · n · c  +  k · B · c  +  n · c_h ]

**Eq. 7** (the ``k``-th offload, Alg. 2): layers move last layer first (layer ``L − k`` is the ``k``-th to go) as
soon as the memory with ``k − 1`` layers offloaded would exceed ``M``; the threshold is the first length that does
not fit::

    T_k = floor( (M − W − P − R − b · (k − 1) · B · c) / (b · ((L − k + 1) · c + c_h)) ) + 1

clamped below at ``I`` (a layer that cannot hold even the prompt moves right after the prefill); ``T_k > S`` means
the layer never moves (reported as ``None``). Thresholds are non-decreasing in ``k`` whenever ``n ≥ B``.

**Eq. 8** (Alg. 1, the largest batch): a batch ``b`` fits when the prefill fits with every layer resident,
``M_0(I) ≤ M``, and the end of the decode fits with every layer offloaded, ``M_L(S) ≤ M``::

    b_max = floor( (M − W − P − R) / max(I · (L · c + c_h),  L · B · c + S · c_h) )

and without offload (every layer resident up to ``S``): ``b_resident = floor((M − W − P − R) / (S · (L · c + c_h)))``.

The runtime (:mod:`kvtransform.runtime.offload`) grows resident layers in chunks and offloads, before each growth to
capacity ``n``, the layers whose threshold is ``≤ n`` (:meth:`MemoryPlan.offloaded_at`).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from ..utils import is_count

GIB = 2 ** 30  # the memory settings (gpu_gb, head_gb, reserve_gb) and the printed plan are GiB, as CUDA reports memory
MAX_GIB = 2 ** 20  # the largest memory setting accepted (1 PiB): far past any device, and finite in bytes
MAX_GBPS = 1e6  # the largest rate accepted (1 PB/s)

__all__ = ["ModelMemory", "HeadMemory", "MemoryPlan", "PlanMemoryConfig", "plan_memory", "run_plan_memory"]


@dataclass(frozen=True)
class ModelMemory:
    """The LLM's memory facts.

    Attributes:
        weight_bytes: bytes of all parameters (``W``).
        num_layers, num_kv_heads, head_dim: ``L``, ``H_kv``, ``D``.
        kv_dtype_bytes: bytes per element of the KV cache (``e``: 2 for bf16/fp16, 4 for fp32).
        max_positions: the model's context window (``max_position_embeddings``; 0: unknown).
        window: the sliding window of the model's window layers in tokens (0: none), which KV offload does not
            take yet (``passes/programs.py``).

    Raises:
        ValueError: a field that is not an integer (``weight_bytes``, ``max_positions`` >= 0, the others >= 1).
    """

    weight_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    max_positions: int = 0
    window: int = 0

    def __post_init__(self):
        _check_counts(self, ("weight_bytes", "max_positions", "window"), ("num_layers", "num_kv_heads", "head_dim",
                                                                          "kv_dtype_bytes"))

    @property
    def kv_token_bytes(self) -> int:
        """``c = 2 · H_kv · D · e``: K+V bytes of one token of one layer of one row."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "ModelMemory":
        """From an instantiated HF causal LM (real or on the ``meta`` device): weights counted from its parameters
        (tied embeddings once), the KV dtype is the parameters' dtype."""
        cfg = model.config
        _check_config(cfg)
        seen, weight = set(), 0
        for p in model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                weight += p.numel() * p.element_size()
        dtype = next(model.parameters()).dtype
        from kvtransform.model_features import config_attention_variants

        window = config_attention_variants(model).get("window")
        return cls(weight_bytes=weight, num_layers=int(cfg.num_hidden_layers),
                   num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
                   head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
                   kv_dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                   max_positions=int(getattr(cfg, "max_position_embeddings", None) or 0),
                   window=int(window) if isinstance(window, int) and window > 0 else 0)

    @classmethod
    def from_config(cls, config, dtype: torch.dtype = torch.bfloat16) -> "ModelMemory":
        """From a transformers ``PretrainedConfig``: the model is built on the ``meta`` device (no memory) to count
        its parameters in ``dtype``."""
        import transformers

        _check_config(config)  # (before transformers divides by them)
        try:
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as e:  # transformers lists every causal-LM config class: keep the first sentence
            raise ValueError(f"model type {getattr(config, 'model_type', '?')!r} has no causal-LM class in "
                             f"transformers ({str(e).split('Model type should be')[0].strip()[:200]})") from None
        return cls.from_model(model)


@dataclass(frozen=True)
class HeadMemory:
    """The retrieval head's own memory: ``weight_bytes`` (``P``) and ``token_bytes`` per cached token per row
    (``c_h``); ``resident_layers``: the first layers whose KV cache the head reads (the ``self`` head: layer 0), so
    the plan never offloads them (the last layer moves first)."""

    weight_bytes: int = 0
    token_bytes: int = 0
    resident_layers: int = 0

    def __post_init__(self):
        _check_counts(self, ("weight_bytes", "token_bytes", "resident_layers"), ())


def _check_counts(obj, non_negative, positive) -> None:
    """One line for a field of ``obj`` that is not an integer ``>= 0`` (``non_negative``) or ``>= 1``
    (``positive``); NumPy integers count as integers."""
    for names, low in ((non_negative, 0), (positive, 1)):
        for key in names:
            v = getattr(obj, key)
            if not is_count(v, low, numpy=True):
                raise ValueError(f"{type(obj).__name__}.{key}={v!r} must be an integer >= {low}")


def _check_config(cfg) -> None:
    """The config fields the memory model reads: one line naming a missing, non-integer or non-positive one."""
    need = ["num_hidden_layers", "num_attention_heads"] + [k for k in ("num_key_value_heads", "head_dim")
                                                           if getattr(cfg, k, None) is not None]
    if getattr(cfg, "head_dim", None) is None:
        need.append("hidden_size")
    for key in need:
        v = getattr(cfg, key, None)
        if not is_count(v, 1, numpy=True):
            what = " (hidden_size / num_attention_heads where not given)" if key == "head_dim" else ""
            raise ValueError(f"model config: {key}={v!r}{what} must be an integer >= 1 (fix the model's config.json)")
    heads, kv_heads = int(cfg.num_attention_heads), getattr(cfg, "num_key_value_heads", None)
    if kv_heads is not None and heads % int(kv_heads):  # GQA: every KV head serves the same number of query heads
        raise ValueError(f"model config: num_attention_heads={heads} is not a multiple of num_key_value_heads="
                         f"{int(kv_heads)} (fix the model's config.json)")
    if getattr(cfg, "head_dim", None) is None and int(cfg.hidden_size) % heads:
        raise ValueError(f"model config: hidden_size={int(cfg.hidden_size)} is not a multiple of num_attention_heads="
                         f"{heads} and no head_dim is given (fix the model's config.json)")


@dataclass
class MemoryPlan:
    """The output of :func:`plan_memory`.

    Attributes:
        thresholds: per layer index ``l``, the sequence length (tokens) at which layer ``l`` moves to CPU, or None
            when it stays on the GPU up to ``input_len + output_len``; the last layer moves first.
        max_batch: the largest batch that fits with offload (Eq. 8); ``max_batch_resident`` without offload.
        peak_bytes: the largest ``M_k(n)`` over the run with this plan (bytes).
        resident_bytes: ``M_0(S)``, what the run would need without offload.
    """

    model: ModelMemory
    head: HeadMemory
    gpu_bytes: int
    reserve_bytes: int
    batch: int
    input_len: int
    output_len: int
    budget: int
    thresholds: list = field(default_factory=list)
    max_batch: int = 0
    max_batch_resident: int = 0
    peak_bytes: int = 0
    resident_bytes: int = 0

    @property
    def final_len(self) -> int:
        return self.input_len + self.output_len

    @property
    def pinned_bytes(self) -> int:
        """Pinned CPU bytes holding the K/V of the layers on CPU at the last token (``S`` tokens per row)."""
        return len(self.offloaded_at(self.final_len)) * self.batch * self.final_len * self.model.kv_token_bytes

    @property
    def needs_offload(self) -> bool:
        return any(t is not None for t in self.thresholds)

    def offloaded_at(self, length: int) -> list:
        """Layer indices that are on CPU at sequence length ``length`` (ascending)."""
        return [l for l, t in enumerate(self.thresholds) if t is not None and t <= length]

    def gpu_bytes_at(self, length: int) -> int:
        """``M_k(n)`` (Eq. 6) at ``n = length`` with the layers this plan offloads by then."""
        return _m_k(self.model, self.head, self.reserve_bytes, self.batch, self.budget, length,
                    len(self.offloaded_at(length)))

    def rows(self) -> list:
        """One dict per offload event, in order: ``k``, ``layer``, ``length`` (tokens), ``gpu_gb`` before and
        after the move, ``cpu_gb`` (pinned CPU memory holding offloaded K/V at ``S``), in GiB (:data:`GIB`)."""
        out, c, b = [], self.model.kv_token_bytes, self.batch
        for k, l in enumerate(sorted((l for l, t in enumerate(self.thresholds) if t is not None),
                                     key=lambda l: (self.thresholds[l], -l)), start=1):
            n = self.thresholds[l]
            before = _m_k(self.model, self.head, self.reserve_bytes, b, self.budget, n, k - 1)
            after = _m_k(self.model, self.head, self.reserve_bytes, b, self.budget, n, k)
            out.append({"k": k, "layer": l, "length": n, "gpu_gb_before": before / GIB,
                        "gpu_gb_after": after / GIB, "cpu_gb": k * b * self.final_len * c / GIB})
        return out

    def table(self) -> str:
        """The plan as a markdown table plus a summary line."""
        head = (f"GiB = 2**30 bytes. GPU {self.gpu_bytes / GIB:.1f} GiB, weights {self.model.weight_bytes / GIB:.2f} "
                f"GiB, batch {self.batch}, [{self.input_len} in, {self.output_len} out], budget {self.budget}: without "
                f"offload {self.resident_bytes / GIB:.1f} GiB; with it peak {self.peak_bytes / GIB:.1f} GiB; largest "
                f"batch {self.max_batch_resident} resident, " + (f"{self.max_batch} with offload" if not self.model.window
                                                                 else "no offload (sliding-window layers)"))
        lines = [head, "", "| # | layer | moves at length (tokens) | GPU GiB before | GPU GiB after | pinned CPU GiB "
                           "(at the end) |", "|---:|---:|---:|---:|---:|---:|"]
        for r in self.rows():
            lines.append(f"| {r['k']} | {r['layer']} | {r['length']} | {r['gpu_gb_before']:.2f} | "
                         f"{r['gpu_gb_after']:.2f} | {r['cpu_gb']:.2f} |")
        if not self.needs_offload:
            lines.append("| - | - | never: every layer stays on the GPU | | | |")
        return "\n".join(lines)


def _m_k(model: ModelMemory, head: HeadMemory, reserve: int, batch: int, budget: int, n: int, k: int) -> int:
    """Eq. 6."""
    c, L = model.kv_token_bytes, model.num_layers
    return model.weight_bytes + head.weight_bytes + reserve + batch * ((L - k) * n * c + k * budget * c
                                                                       + n * head.token_bytes)


def plan_memory(model: ModelMemory, head: HeadMemory, *, gpu_bytes: int, batch: int, input_len: int,
                output_len: int, budget: int, reserve_bytes: int = 0) -> MemoryPlan:
    """Offload thresholds (Eq. 7, Alg. 2) and the largest batch (Eq. 8, Alg. 1); see the module docstring.

    Args:
        model, head: :class:`ModelMemory`, :class:`HeadMemory`.
        gpu_bytes: GPU memory the run may use (bytes, ``M``). batch: rows. input_len, output_len: tokens per row
        (the longest prompt; tokens to generate). budget: ``B``, tokens per KV head per step. reserve_bytes: ``R``.

    Returns:
        :class:`MemoryPlan`.

    Raises:
        ValueError: a ``model`` / ``head`` of another type, a non-positive size, or a batch that does not fit even
            with every layer offloaded (the message gives the largest batch that fits and the GPU memory the
            requested one needs).
    """
    for name, x, kind in (("model", model, ModelMemory), ("head", head, HeadMemory)):
        if not isinstance(x, kind):
            raise ValueError(f"plan_memory's {name} must be a {kind.__name__}; got {type(x).__name__}"
                             + (" (HeadMemory() for a head that holds no memory)" if name == "head" else ""))
    sizes = dict(gpu_bytes=gpu_bytes, batch=batch, input_len=input_len, output_len=output_len, budget=budget)
    bad = {k: v for k, v in sizes.items() if not is_count(v, 1, numpy=True)}
    if not bad and not is_count(reserve_bytes, numpy=True):
        bad = {"reserve_bytes": reserve_bytes}
    if bad:
        raise ValueError(f"plan_memory needs positive integer sizes (bytes, tokens, rows; reserve_bytes >= 0); got "
                         f"{bad}")
    gpu_bytes, batch, input_len, output_len, budget, reserve_bytes = (int(x) for x in (
        gpu_bytes, batch, input_len, output_len, budget, reserve_bytes))
    c, L, ch = model.kv_token_bytes, model.num_layers, head.token_bytes
    pin = min(max(int(head.resident_layers), 0), L)  # layers that never move
    S = input_len + output_len
    free = gpu_bytes - model.weight_bytes - head.weight_bytes - reserve_bytes
    per_row = max(input_len * (L * c + ch), (L - pin) * budget * c + pin * S * c + S * ch)
    max_resident = max(free // (S * (L * c + ch)), 0) if free > 0 else 0
    # offload never needs more than staying resident (a budget past S would count slots larger than the cache)
    max_batch = max(free // per_row if free > 0 else 0, max_resident)
    plan = MemoryPlan(model, head, gpu_bytes, reserve_bytes, batch, input_len, output_len, budget,
                      max_batch=int(max_batch), max_batch_resident=int(max_resident))
    if batch > max_batch:
        need = max(_m_k(model, head, reserve_bytes, batch, budget, input_len, 0),
                   _m_k(model, head, reserve_bytes, batch, min(budget, S), S, L - pin))  # no more slots than tokens
        which = ("every layer's KV" if not pin else "no layer's KV (the retrieval head reads every layer)" if pin >= L
                 else f"the KV of every layer but the {pin} the retrieval head reads")
        if max_batch < 1:  # not even one row: the fixed part (weights, head, reserve) or one row leaves no room
            fixed = model.weight_bytes + head.weight_bytes + reserve_bytes
            one = _m_k(model, head, reserve_bytes, 1, min(budget, S), S, L - pin)  # no more slots than tokens
            raise ValueError(f"no batch fits {gpu_bytes / GIB:.4g} GiB: the weights, head and reserve alone take "
                             f"{fixed / GIB:.4g} GiB and one row of [{input_len}, {output_len}] needs "
                             f"{max(one, _m_k(model, head, reserve_bytes, 1, budget, input_len, 0)) / GIB:.4g} GiB in all "
                             f"with {which} on CPU: raise gpu_gb (or lower "
                             f"{'head_gb, ' if head.weight_bytes else ''}reserve_gb, shorten [input, output])")
        raise ValueError(f"batch {batch} does not fit {gpu_bytes / GIB:.3g} GiB even with {which} on CPU "
                         f"(needs {need / GIB:.3g} GiB at the prefill or at {S} tokens): lower the batch to "
                         f"{max_batch} or shorten [input, output]")
    thresholds: list = [None] * L
    for k in range(1, L - pin + 1):
        avail = free - batch * (k - 1) * budget * c
        t = max(avail // (batch * ((L - k + 1) * c + ch)) + 1, input_len)
        if t > S:
            break
        thresholds[L - k] = int(t)
    plan.thresholds = thresholds
    plan.resident_bytes = _m_k(model, head, reserve_bytes, batch, budget, S, 0)
    events = sorted({input_len, S} | {t for t in thresholds if t is not None})
    peaks = [_m_k(model, head, reserve_bytes, batch, budget, n, len(plan.offloaded_at(n))) for n in events]
    # just before each move the previous count still holds one token less
    peaks += [_m_k(model, head, reserve_bytes, batch, budget, t - 1, len(plan.offloaded_at(t - 1)))
              for t in thresholds if t is not None and t - 1 >= input_len]
    plan.peak_bytes = int(max(peaks))
    return plan


@dataclass
class PlanMemoryConfig:
    """``kvtransform plan-memory MODEL`` settings (Hydra structured config).

    Attributes:
        model: the model whose shapes are planned (``model.name``: registry name, local HF directory or a cached hub
            id; only its config is read for directories and hub ids: weights are counted on the ``meta`` device).
        gpu_gb: GPU memory the run may use, in GiB (:data:`GIB`, as CUDA and the decode suite's ``gpu_gb`` count:
            an "80 GB" card gives a process ≈ 79.1 GiB). batch: rows. input_len, output_len: tokens per row.
        budget: tokens per KV head per decode step (``SpeContextConfig.budget``).
        head_gb: the retrieval head's weights in GiB; head_token_bytes: its own state per cached token per row
            (bytes; e.g. a one-layer key cache ``H_kv · D · e``); head_resident_layers: the first layers whose KV
            cache the head reads (1 for the ``self`` head), never offloaded.
        reserve_gb: activations and workspace kept free, in GiB.
        dtype: weight and KV dtype (``bfloat16`` | ``float16`` | ``float32``).
        hbm_gbps, link_gbps: the device's memory read rate and the host-to-GPU rate of elastic loading, GB/s (1e9
            bytes/s; the decode suite's ``copy_gbps`` and BENCHMARKS.md "Decode throughput" give the H200's); both
            set (0: off) add the modelled decode tokens/s of ``batch``, of the batch with the most and of the
            largest resident batch (:mod:`kvtransform.runtime.throughput`). overlap: fraction of a step's selection
            the previous step selected too (0 to 1; ``GenerationStats.selection_overlap``); gpu_factor: a real
            step's time over its HBM floor (>= 1; the decode suite's ``worst step / floor``). host_gb: pinned CPU
            memory the best batch may hold, GiB (0: no bound).
    """

    model: Any = None
    gpu_gb: float = 80.0
    batch: int = 1
    input_len: int = 2048
    output_len: int = 6144  # [2048, 6144] fits the default model's 8192-token window (a longer one is refused)
    budget: int = 2048
    head_gb: float = 0.0
    head_token_bytes: int = 0
    head_resident_layers: int = 0
    reserve_gb: float = 0.0
    dtype: str = "bfloat16"
    hbm_gbps: float = 0.0
    link_gbps: float = 0.0
    overlap: float = 0.5
    gpu_factor: float = 1.0
    host_gb: float = 0.0


def _model_memory(name: str, dtype: torch.dtype) -> ModelMemory:
    """:class:`ModelMemory` of a registry model (loaded) or of a local directory / cached hub id (config only)."""
    from kvtransform.models import REGISTRY, load_model

    if name in REGISTRY or str(name).endswith(".gguf"):
        model, _ = load_model(name, dtype=dtype)
        return ModelMemory.from_model(model)
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a missing path, bad JSON, a field transformers' validation refuses
        why = " ".join(line.strip() for line in str(e).splitlines()[:2])
        raise ValueError(f"cannot read the config of model {name!r}: give a registry name, a local directory with "
                         f"a valid config.json or a hub id in the local Hugging Face cache ({why})") from None
    return ModelMemory.from_config(config, dtype)


def run_plan_memory(cfg) -> MemoryPlan:
    """The ``plan-memory`` job: build the plan of ``cfg`` (:class:`PlanMemoryConfig`).

    Raises:
        ValueError: a bad dtype, size, rate or throughput setting, an unreadable model, a batch that does not fit
            (see :func:`plan_memory`), or one that needs offload on a model with sliding-window layers.
    """
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if cfg.dtype not in dtypes:
        raise ValueError(f"dtype={cfg.dtype!r}: choose one of {', '.join(dtypes)}")
    # real numbers within a range, one line per bad value (nan, a bool, a string, None: not a number); the
    # throughput keys only matter with both rates set (0: off)
    gib, gbps = "a number of GiB", "a number of GB/s"
    ranges = [("gpu_gb", gib, 1e-9, MAX_GIB, ""),  # 1e-9 GiB: one byte
              ("head_gb", gib, 0, MAX_GIB, ""), ("reserve_gb", gib, 0, MAX_GIB, ""),
              ("host_gb", gib, 0, MAX_GIB, " (0: no bound)"), ("overlap", "a fraction", 0, 1, ""),
              ("gpu_factor", "a step's time over its floor", 1, 1e6, ""),
              ("hbm_gbps", gbps, 0, MAX_GBPS, " (0: off)"), ("link_gbps", gbps, 0, MAX_GBPS, " (0: off)")]
    for key, what, low, high, note in ranges:
        v = getattr(cfg, key)
        x = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else float("nan")
        if not (low <= x <= high):
            raise ValueError(f"{key}={v!r} must be {what} from {low:.15g} to {high:.15g}{note}")
    if (cfg.hbm_gbps > 0) != (cfg.link_gbps > 0):
        raise ValueError(f"hbm_gbps={cfg.hbm_gbps!r}, link_gbps={cfg.link_gbps!r}: the throughput model needs both "
                         f"rates > 0 (or neither)")
    for key in ("batch", "input_len", "output_len", "budget"):  # before the model loads
        v = getattr(cfg, key)
        if not is_count(v, 1, numpy=True):
            raise ValueError(f"{key}={v!r} must be an integer >= 1")
    for key in ("head_token_bytes", "head_resident_layers"):
        v = getattr(cfg, key)
        if not is_count(v, numpy=True):
            raise ValueError(f"{key}={v!r} must be an integer >= 0")
    name = cfg.model.name if hasattr(cfg.model, "name") else cfg.model
    mm = _model_memory(str(name), dtypes[cfg.dtype])
    if mm.max_positions and cfg.input_len + cfg.output_len > mm.max_positions:
        raise ValueError(f"input_len + output_len = {cfg.input_len + cfg.output_len} tokens is past the model's "
                         f"context window ({mm.max_positions}, max_position_embeddings): shorten [input, output]")
    if cfg.head_resident_layers > mm.num_layers:
        raise ValueError(f"head_resident_layers={cfg.head_resident_layers} is more than the model's "
                         f"{mm.num_layers} layers: give 0 to {mm.num_layers} (1 for the self head)")
    head = HeadMemory(weight_bytes=int(float(cfg.head_gb) * GIB), token_bytes=int(cfg.head_token_bytes),
                      resident_layers=int(cfg.head_resident_layers))
    plan = plan_memory(mm, head, gpu_bytes=int(float(cfg.gpu_gb) * GIB), batch=int(cfg.batch),
                       input_len=int(cfg.input_len), output_len=int(cfg.output_len), budget=int(cfg.budget),
                       reserve_bytes=int(float(cfg.reserve_gb) * GIB))
    if mm.window and plan.needs_offload:
        raise ValueError(f"batch {plan.batch} needs KV offload, which does not take sliding-window layers yet (this "
                         f"model's window: {mm.window} tokens): the largest resident batch is "
                         f"{plan.max_batch_resident}")
    return plan
