"""The ``decode`` suite's models and memory maths: the model shapes it runs (random weights), SpeContext Table 5's
numbers (arXiv 2512.00722 §7), and the bytes a decode step reads and a request holds, from which the HBM floor and
the largest request count that fits come. Used by the suite's config checks (:mod:`.config`) and its runner
(:mod:`.decode`); imports nothing of either.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["OURS", "OFFLOAD", "MODELS", "PAPER", "GIB", "build_model", "weight_bytes", "held_bytes", "model_shape",
           "step_bytes", "per_request_bytes", "max_requests", "device_bytes", "check_cap", "capped_free",
           "cap_fraction", "host_limit"]

from kvtransform.runtime.memory import GIB  # noqa: E402  the suite's memory settings are GiB, as plan-memory's

OURS = {"dense": "dense", "specontext": "distilled", "quest": "quest",  # method -> retrieval head
        "flashinfer": "dense",  # (its slot-mode program calls FlashInfer's kernel: decode_ours.Ours.runtime)
        "specontext_offload": "distilled"}  # (with KV offload: the memory plan sizes it, decode_ours)
OFFLOAD = "specontext_offload"

#: Model shapes (random weights). ``llama-8b``: DeepSeek-R1-Distill-Llama-8B (Llama-3.1-8B); ``qwen3-8b``: Qwen3-8B;
#: ``smollm2-135m``: SmolLM2-135M (tied embeddings; the default model's shape, for quick GPU checks); ``tiny``: a
#: 2-layer Llama for CPU smoke runs.
MODELS = {
    "llama-8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336,
                     vocab=128256, rope_theta=500000.0, positions=131072, paper="DeepSeek-R1-Distill-Llama-8B"),
    "qwen3-8b": dict(arch="qwen3", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=12288,
                     vocab=151936, rope_theta=1000000.0, positions=40960, paper="Qwen3-8B"),
    "smollm2-135m": dict(arch="llama", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, inter=1536,
                         vocab=49152, rope_theta=100000.0, positions=8192, tie=True, paper=None),
    "tiny": dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512,
                 rope_theta=10000.0, positions=8192, paper=None),
}

#: SpeContext Table 5 (A800-80GB, budget 2048): ``(paper model, input, output, method) -> (tokens/s, requests)``.
PAPER = {
    ("DeepSeek-R1-Distill-Llama-8B", 2048, 16384): {"hf_eager": (45.57, 4), "hf_flash_attn": (145.88, 16),
                                                    "flashinfer": (490.04, 16), "shadowkv": (366.74, 16),
                                                    "specontext": (824.22, 32)},
    ("DeepSeek-R1-Distill-Llama-8B", 2048, 32768): {"hf_eager": (27.74, 4), "hf_flash_attn": (87.74, 8),
                                                    "flashinfer": (314.25, 8), "shadowkv": (240.47, 16),
                                                    "specontext": (690.59, 32)},
    ("DeepSeek-R1-Distill-Llama-8B", 16384, 2048): {"hf_flash_attn": (87.71, 8), "flashinfer": (320.41, 8),
                                                    "shadowkv": (168.06, 32), "specontext": (526.47, 16)},
    ("DeepSeek-R1-Distill-Llama-8B", 32768, 2048): {"hf_flash_attn": (46.89, 6), "flashinfer": (222.06, 8),
                                                    "shadowkv": (132.07, 64), "specontext": (346.88, 16)},
    ("Qwen3-8B", 2048, 16384): {"hf_eager": (33.77, 4), "hf_flash_attn": (129.67, 16), "flashinfer": (420.12, 16),
                                "specontext": (592.39, 32)},
    ("Qwen3-8B", 2048, 32768): {"hf_eager": (19.28, 4), "hf_flash_attn": (62.89, 8), "flashinfer": (254.92, 8),
                                "specontext": (424.92, 32)},
    ("Qwen3-8B", 16384, 2048): {"hf_flash_attn": (60.31, 8), "flashinfer": (259.28, 8), "specontext": (336.71, 16)},
    ("Qwen3-8B", 32768, 2048): {"hf_flash_attn": (32.56, 6), "flashinfer": (156.92, 6), "specontext": (210.75, 16)},
}


def build_model(name: str, dtype: torch.dtype, device, seed: int = 0, **overrides):
    """A random-weight causal LM of the shape :data:`MODELS` ``[name]`` (weights ``N(0, 0.02)``, which keeps
    activations finite through 36 layers), ``sdpa`` attention, in ``dtype`` on ``device``. ``overrides`` replace
    entries of the shape (``layers=4, hidden=1024, ...``: a smaller model of the same family).

    Raises:
        ValueError: an unknown shape name or override key.
    """
    import transformers

    if name not in MODELS:
        raise ValueError(f"unknown model shape {name!r}; choose one of {', '.join(MODELS)}")
    unknown = set(overrides) - set(MODELS[name])
    if unknown:
        raise ValueError(f"unknown shape key(s) {sorted(unknown)}; a shape has {', '.join(MODELS[name])}")
    m = dict(MODELS[name], **overrides)
    common = dict(num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                  head_dim=m["head_dim"], hidden_size=m["hidden"], intermediate_size=m["inter"],
                  vocab_size=m["vocab"], max_position_embeddings=m["positions"],
                  tie_word_embeddings=bool(m.get("tie", False)),
                  rope_theta=m["rope_theta"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if m["arch"] == "qwen3":
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding table (one row per token)."""
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb
    return total if tied else total - emb.numel() * emb.element_size()


def held_bytes(model) -> int:
    """Bytes of every parameter the device holds (tied weights counted once): what a memory cap must hold."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def model_shape(model) -> dict:
    """``layers``, ``kv_heads``, ``heads``, ``head_dim`` and ``vocab`` of ``model``'s config (what the memory maths
    and the random caches need)."""
    c = model.config
    return dict(layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, heads=c.num_attention_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                vocab=c.vocab_size)


def step_bytes(method: str, shape: dict, requests: int, context: int, max_length: int, budget: int,
               itemsize: int = 2, page_size: int = 16, head_itemsize: Optional[int] = None) -> int:
    """Bytes of KV cache and retrieval state one decode step must read for ``requests`` rows of ``context``
    cached tokens (weights not included).

    Dense methods read every cached token's K and V in every layer. ``specontext`` reads the ``min(budget,
    context)`` selected tokens in every layer plus its head's key cache over the context (``H_kv × D`` per token
    in ``head_itemsize``); ``quest`` reads its selected pages' tokens plus every page's min and max keys in every
    layer (it scores the whole page table of ``max_length``)."""
    per_tok = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * itemsize  # K and V, all layers
    if method in ("specontext", OFFLOAD):  # (an offloaded layer reads its slots: the same selected tokens)
        head = shape["kv_heads"] * shape["head_dim"] * (head_itemsize or itemsize) * context
        return requests * (per_tok * min(budget, context) + head)
    if method == "quest":
        sel = min(context, math.ceil(budget / page_size) * page_size)
        pages = math.ceil(max_length / page_size)
        return requests * (per_tok * sel + per_tok * pages)
    return requests * per_tok * context


def per_request_bytes(method: str, shape: dict, max_length: int, itemsize: int = 2, page_size: int = 16) -> int:
    """Device bytes one request holds while decoding with ``method`` (its KV cache of ``max_length`` tokens and the
    method's per-request state and temporaries; see :func:`max_requests`)."""
    L, hk, d = shape["layers"], shape["kv_heads"], shape["head_dim"]
    kv = 2 * L * hk * max_length * d * itemsize
    if method in OURS:  # token ids, selections (indices, previous selection, overlap bitmap)
        extra = 8 * max_length + hk * max_length * 9
        if method in ("specontext", OFFLOAD):
            extra += hk * max_length * d * itemsize
        if method == "quest":  # page min/max and the prefill's one-layer temporaries
            extra += 2 * L * hk * math.ceil(max_length / page_size) * d * itemsize + 2 * kv // L
        return kv + extra
    if method == "hf_sdpa":  # DynamicCache grows by torch.cat: one layer's old and new copy coexist
        return kv + 2 * kv // L
    if method == "hf_static":  # attention with a mask over the static cache expands one layer's K/V to all heads
        return kv + 8 * max_length + (shape["heads"] // hk) * kv // L
    return kv + 8 * max_length  # paged caches (flashinfer) + ids


def max_requests(method: str, shape: dict, max_length: int, free_bytes: int, reserve_bytes: int,
                 itemsize: int = 2, cap: int = 256) -> int:
    """The largest number of concurrent requests whose decoding state fits ``free_bytes - reserve_bytes`` (at least
    1, at most ``cap``)."""
    per = per_request_bytes(method, shape, max_length, itemsize)
    return int(max(1, min(cap, (free_bytes - reserve_bytes) // per)))


def device_bytes(device, cpu_memory_gb: float) -> int:
    """The memory of the job's device that a ``gpu_gb`` cap must fit in: CUDA's total capacity of the device
    (``torch.cuda.get_device_properties(d).total_memory``, the figure of CUDA's out-of-memory message), or on a CPU
    the ``cpu_memory_gb`` GiB the suite sizes for."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(cpu_memory_gb * GIB)


def check_cap(gpu_gb: float, name: str, dtype: torch.dtype, device, reserve_gb: float, cpu_memory_gb: float) -> None:
    """Refuse a ``gpu_gb`` cap (GiB) larger than the device (:func:`device_bytes`) or too small for model shape
    ``name``'s weights in ``dtype`` plus the reserve (``reserve_gb``, counted on CUDA only, as the suite does); the
    weights are counted on the ``meta`` device (nothing allocated). ``gpu_gb=0``: no cap, nothing checked.

    Raises:
        ValueError: one line naming the cap, the limit and the fix.
    """
    if not gpu_gb:
        return
    dev = torch.device(device)
    have = device_bytes(dev, cpu_memory_gb)
    what = f"the {have / GIB:.4g} GiB of {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else \
        f"cpu_memory_gb={cpu_memory_gb} (the memory sized for on a CPU)"
    def gib(n: int, up: bool) -> float:  # n bytes in GiB to 4 significant digits, rounded up or down
        scale = 10 ** (3 - math.floor(math.log10(n / GIB)))
        return (math.ceil if up else math.floor)(n / GIB * scale) / scale

    if gpu_gb * GIB > have:
        raise ValueError(f"gpu_gb={gpu_gb} is larger than {what}: set gpu_gb <= {gib(have, False):g} or gpu_gb=0 "
                         f"(the whole device)")
    need = held_bytes(build_model(name, dtype, "meta")) + (int(reserve_gb * GIB) if dev.type == "cuda" else 0)
    if gpu_gb * GIB < need:
        raise ValueError(f"gpu_gb={gpu_gb} cannot hold model={name}'s weights"
                         f"{f' plus reserve_gb={reserve_gb}' if dev.type == 'cuda' else ''} ({need / GIB:.4g} GiB): "
                         f"set gpu_gb >= {gib(need, True):g} (or gpu_gb=0: the whole device)")


def capped_free(free_bytes: int, total_bytes: int, cap_bytes: int) -> int:
    """Free bytes of a device of ``total_bytes`` with ``free_bytes`` free, as if it had only ``cap_bytes``: whatever
    is in use (CUDA context, weights, the allocator's cache, other processes) counts against the cap, so
    ``free - (total - cap)`` (at least 0). ``cap_bytes=0``: no cap, ``free_bytes``."""
    return int(free_bytes) if not cap_bytes else max(0, int(free_bytes) - (int(total_bytes) - int(cap_bytes)))


def cap_fraction(cap_bytes: int, total_bytes: int, free_bytes: int, reserved_bytes: int) -> float:
    """The ``torch.cuda.set_per_process_memory_fraction`` that keeps this process within ``cap_bytes``: PyTorch's
    caching allocator may then hold ``cap - outside`` bytes, ``outside = total - free - reserved`` being the memory
    in use outside it (the CUDA context, loaded kernel modules, other processes), measured now."""
    outside = int(total_bytes) - int(free_bytes) - int(reserved_bytes)
    return max(0.0, min(1.0, (int(cap_bytes) - outside) / int(total_bytes)))


def host_limit(cfg) -> int:
    """Pinned CPU bytes the ``specontext_offload`` method may hold for offloaded layers: ``host_gb`` GiB, or (0)
    three quarters of the memory available now (``MemAvailable`` of /proc/meminfo; the physical memory where that
    file is missing): the process's own weights, compile workers and page cache need the rest."""
    if float(cfg.host_gb):
        return int(float(cfg.host_gb) * GIB)
    import os

    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    return int(0.75 * avail)
