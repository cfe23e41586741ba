"""Runner of the ``decode`` suite: end-to-end decode throughput of long generations (SpeContext, arXiv 2512.00722
§7, Table 5; the paper's A800 numbers are in ``shared/seed_tables/specontext_throughput_a800.csv`` and
:data:`PAPER`).

One job = one model shape × one ``[input, output]`` request shape; every method of
:class:`~kvtransform.bench.config.ThroughputMethod` runs in this process on the same random-weight model (speed does
not depend on the weights' values), each with the largest number of concurrent requests whose memory fits
(:func:`max_requests`; or ``requests=N``).

A 32k-token generation per configuration is too long to run whole, so each method's decode step is timed at
``samples`` context lengths spread over the generation (``steps`` steps per sample: the difference of a run of
``n0 + steps`` and of ``n0`` decode steps from a cache holding that context, so graph capture and warm-up cancel),
and the decode time of the whole run is the sum over every step of the piecewise-linear interpolation between the
samples. ``validate=true`` checks that estimate against a measured full run of the same job (meant for a short
``output``). Prefill is timed separately on ``ceil(prefill_tokens / input)`` requests and scaled to all of them; the
end-to-end tokens/s is ``requests × output / (prefill + decode)``.

Per sampled step the HBM floor is (weight bytes + the bytes the step must read from the KV cache and the retrieval
state) / the copy bandwidth measured in the same job: dense methods must read the whole context's K/V, ``specontext``
the selected ``budget`` tokens of every layer plus the retrieval head's key cache, ``quest`` the selected pages plus
every page's min/max keys.

Methods: ``hf_sdpa`` (HF ``generate``, DynamicCache, sdpa), ``hf_static`` (HF ``generate`` with a StaticCache: HF
compiles the decode step itself), ``dense`` (our runtime, every token: the slot-mode program, each layer reading its
cache up to the row's length), ``specontext`` (our runtime, the ``distilled`` head: the packaged one when it fits the
model, else a randomly initialised head of the same architecture, which costs the same), ``quest`` (our runtime,
Quest pages), ``flashinfer`` (``dense`` with FlashInfer's batch decode kernel as every layer's attention:
:mod:`kvtransform.bench.flashinfer_decode`; a skip where FlashInfer does not import). Our runtime replays each step
as a CUDA graph, its decode program under ``torch.compile`` (``compile=true``, CUDA only).
"""
from __future__ import annotations

import gc
import math
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from .config import ThroughputMethod
from .layer import torch_dtype
from .runner import resolve_device
from .timing import sync

__all__ = ["MODELS", "PAPER", "ORDER", "build_model", "max_requests", "sample_contexts", "integrate_steps",
           "step_bytes", "run_job"]

ORDER = [m.value for m in ThroughputMethod if m is not ThroughputMethod.all]
OOM_RETRIES = 3  # automatic request counts: retries at -10 % after an out-of-memory error
VALIDATE_TOL = 0.05  # a sampled estimate within 5 % of the whole run (issue 17)
OURS = {"dense": "dense", "specontext": "distilled", "quest": "quest",  # method -> retrieval head
        "flashinfer": "dense"}  # (its slot-mode program calls FlashInfer's kernel: _Ours.runtime)

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


def _value(x) -> str:
    return x.value if hasattr(x, "value") else str(x)


# ------------------------------------------------------------------------------------------------------- the model


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


def _shape(model) -> dict:
    c = model.config
    return dict(layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads, heads=c.num_attention_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                vocab=c.vocab_size)


# ------------------------------------------------------------------------------------------------------ the numbers


def sample_contexts(input_len: int, output_len: int, samples: int, tail: int) -> list:
    """Context lengths (tokens in the cache before a decode step) at which steps are timed: ``samples`` points
    spread evenly over the run's steps, the last ``tail`` tokens short of the cache's end (a timed sample decodes
    ``tail`` tokens). Decode steps run at contexts ``input + 1 .. input + output - 1``."""
    first, last = input_len + 1, max(input_len + 1, input_len + output_len - 1 - tail)
    if samples <= 1 or last == first:
        return [first]
    return sorted({round(first + (last - first) * i / (samples - 1)) for i in range(samples)})


def integrate_steps(contexts: list, ms: list, input_len: int, output_len: int) -> float:
    """Seconds of all ``output - 1`` decode steps (contexts ``input + 1 .. input + output - 1``) from step times
    ``ms`` sampled at ``contexts``: linear between samples, constant beyond the first and the last."""
    import numpy as np

    steps = np.arange(input_len + 1, input_len + output_len, dtype=np.float64)
    return float(np.interp(steps, np.asarray(contexts, dtype=np.float64), np.asarray(ms, dtype=np.float64)).sum()
                 / 1000.0)


def step_bytes(method: str, shape: dict, requests: int, context: int, max_length: int, budget: int,
               itemsize: int = 2, page_size: int = 16, head_itemsize: Optional[int] = None) -> int:
    """Bytes of KV cache and retrieval state one decode step must read for ``requests`` rows of ``context``
    cached tokens (weights not included).

    Dense methods read every cached token's K and V in every layer. ``specontext`` reads the ``min(budget,
    context)`` selected tokens in every layer plus its head's key cache over the context (``H_kv × D`` per token
    in ``head_itemsize``); ``quest`` reads its selected pages' tokens plus every page's min and max keys in every
    layer (it scores the whole page table of ``max_length``)."""
    per_tok = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * itemsize  # K and V, all layers
    if method == "specontext":
        head = shape["kv_heads"] * shape["head_dim"] * (head_itemsize or itemsize) * context
        return requests * (per_tok * min(budget, context) + head)
    if method == "quest":
        sel = min(context, math.ceil(budget / page_size) * page_size)
        pages = math.ceil(max_length / page_size)
        return requests * (per_tok * sel + per_tok * pages)
    return requests * per_tok * context


def copy_bandwidth(device, mib: int = 4096) -> float:
    """Device copy bandwidth in bytes/s: read + written bytes of ``y.copy_(x)`` over ``mib`` MiB, best of 6."""
    a = torch.empty(mib << 19, dtype=torch.int16, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    n = 2 * a.numel() * a.element_size()
    del a, b
    return n / best


def per_request_bytes(method: str, shape: dict, max_length: int, itemsize: int = 2, page_size: int = 16) -> int:
    """Device bytes one request holds while decoding with ``method`` (its KV cache of ``max_length`` tokens and the
    method's per-request state and temporaries; see :func:`max_requests`)."""
    L, hk, d = shape["layers"], shape["kv_heads"], shape["head_dim"]
    kv = 2 * L * hk * max_length * d * itemsize
    if method in OURS:  # token ids, selections (indices, previous selection, overlap bitmap)
        extra = 8 * max_length + hk * max_length * 9
        if method == "specontext":
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


# ------------------------------------------------------------------------------------------------- our runtime


class _Ours:
    """Our SpeContext runtime on the job's model: one transform (captured programs shared by the methods), one
    :class:`~kvtransform.transforms.specontext.SpeContextModule` per method (its retrieval head)."""

    def __init__(self, model, cfg):
        import kvtransform as kvt

        self.model, self.cfg = model, cfg
        self.base = kvt.SpeContextConfig(head="quest", budget=int(cfg.budget), cuda_graphs=bool(cfg.cuda_graphs),
                                         compile=bool(cfg.compile), fuse_projections=str(cfg.fuse_projections))
        self.sp = kvt.transform(model, self.base, progress=False)
        self.modules, self.notes = {}, {}
        self.sp.runtime._fused()  # projections fused (shared, or copies) before the request count is sized

    def key(self, method):
        """Which module serves ``method`` under the current :attr:`cfg` (``flashinfer``: one per
        ``flashinfer_tensor_cores``, a setting no other method reads)."""
        return (method, bool(self.cfg.flashinfer_tensor_cores)) if method == "flashinfer" else method

    def note(self, method) -> str:
        return self.notes[self.key(method)]

    def built(self, method) -> bool:
        return self.key(method) in self.modules

    def runtime(self, method):
        """The runtime of ``method`` (built at its first use; ``flashinfer``: the dense head's, its slot-mode
        program calling FlashInfer's kernel)."""
        key = self.key(method)
        if key not in self.modules:
            from kvtransform.transforms.specontext import SpeContextModule

            head, state, note = OURS[method], None, ""
            if head == "distilled":
                state, note = _distilled_state(self.model)
            module = SpeContextModule(self.sp.core["prefill"], self.sp.core["decode"], self.base, self.sp.report,
                                      self.sp.info, self.sp.head.scale, model=self.model, head_name=head,
                                      head_state=state)
            if method == "flashinfer":
                note = _use_flashinfer(module.runtime, bool(self.cfg.flashinfer_tensor_cores))
            self.modules[key], self.notes[key] = module, note
        return self.modules[key].runtime


def _use_flashinfer(rt, tensor_cores: bool) -> str:
    """Make ``rt`` (a dense-head runtime) decode through FlashInfer's kernel: its slot-mode program (the fused one
    when projections are fused) with every attention site calling ``kvt_bench::flashinfer_decode``; returns the
    row's note."""
    import flashinfer

    from .flashinfer_decode import FlashInferDecode, flashinfer_program, register

    handle = register(FlashInferDecode(tensor_cores))
    rt.slot_rewrite = lambda slot_program: flashinfer_program(slot_program, handle)
    return (f"FlashInfer {getattr(flashinfer, '__version__', '?')} fa2 batch decode"
            f"{' (tensor cores)' if tensor_cores else ''}, one page per request (no split-KV), in our "
            f"{'compiled ' if rt.compile else ''}program{' and CUDA graph' if rt.cuda_graphs else ''}")


def _distilled_state(model) -> tuple:
    """``(head_state, note)``: the packaged distilled head when one fits the model, else a randomly initialised
    head of the same architecture (the speed of a trained one; its selections are not meaningful)."""
    import json

    from kvtransform.runtime.distilled import DistilledBlock, fingerprint, shipped_head_for

    if shipped_head_for(model) is not None:
        return None, "packaged distilled head"
    c = model.config
    torch.manual_seed(0)
    block = DistilledBlock(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                           getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                           rope_theta=float(getattr(c, "rope_theta", 10000.0) or 10000.0))
    meta = {"arch": block.arch, "fingerprint": fingerprint(model)}
    state = {f"block.{k}": v for k, v in block.state_dict().items()}
    state["meta"] = json.dumps(meta)
    return state, "distilled head, random weights (same architecture and cost as a trained one)"


def _random_cache(shape, requests, max_length, dtype, device, seed):
    from kvtransform.runtime.cache import KVCache

    cache = KVCache.allocate(shape["layers"], requests, shape["kv_heads"], max_length, shape["head_dim"], dtype,
                             device)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in range(shape["layers"]):
        cache.k[layer].normal_(generator=g)
        cache.v[layer].normal_(generator=g)
    cache.token_ids.random_(3, shape["vocab"], generator=g)
    return cache


def _time_ours(rt, cache, contexts, n0, steps, device) -> list:
    """ms per decode step at each context: (run of n0 + steps) − (run of n0), both from the same cache state."""
    tok = torch.randint(3, rt.info.vocab_size, (cache.batch,), device=device)
    cache.cache_seqlens.fill_(contexts[0])
    rt.decode_from(cache, tok, n0)  # warm-up: kernel compilation / autotuning stays out of the first sample
    out = []
    for ctx in contexts:
        def run(n, ctx=ctx):
            cache.cache_seqlens.fill_(ctx)
            return rt.decode_from(cache, tok, n).stats.decode_s

        out.append(_per_step(run, n0, steps))
    return out


def _per_step(run: Callable, n0: int, steps: int, tries: int = 3) -> float:
    """ms per step from ``run(n) -> seconds`` of ``n`` decode steps: ``(run(n0 + steps) - run(n0)) / steps``, the
    fixed costs (capture, head prefill, warm-up) cancelling. Timing noise can make the longer run the faster one:
    then it is measured again, up to ``tries`` times, and NaN (a ``noisy`` sample, left out of the integral) when it
    never is slower."""
    for _ in range(tries):
        short = run(n0)
        diff = run(n0 + steps) - short
        if diff > 0:
            return 1000 * diff / steps
    return float("nan")


def _timed_prefill(prefill: Callable, input_len: int, requests: int, prefill_tokens: int, device) -> tuple:
    """(seconds to prefill all ``requests``, requests per timed prefill): ``prefill(g)`` runs ``g`` prompts of
    ``input_len`` tokens (``g = prefill_tokens // input_len``, 1 to ``requests``); the second of two calls is timed
    (the first warms up) and scaled by ``requests / g``."""
    g = max(1, min(requests, prefill_tokens // input_len))
    for _ in range(2):
        sync(device)
        t0 = time.perf_counter()
        prefill(g)
        sync(device)
    return (time.perf_counter() - t0) * requests / g, g


def _prefill_ours(rt, input_len, requests, prefill_tokens, vocab, device) -> tuple:
    """:func:`_timed_prefill` of the runtime's packed prefill (the cache it builds is dropped)."""
    def prefill(g):
        rt.prefill([torch.randint(3, vocab, (input_len,)) for _ in range(g)], input_len, device)

    return _timed_prefill(prefill, input_len, requests, prefill_tokens, device)


# ------------------------------------------------------------------------------------------------ Hugging Face


def _hf_cache(model, method, requests, ctx, max_length, dtype, device, seed):
    """A Hugging Face cache holding ``ctx`` random tokens per row: DynamicCache (``hf_sdpa``) or StaticCache of
    ``max_length`` (``hf_static``)."""
    from transformers import DynamicCache, StaticCache

    s = _shape(model)
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(n):
        return torch.randn(requests, s["kv_heads"], n, s["head_dim"], generator=g, device=device, dtype=dtype)

    if method == "hf_sdpa":
        cache = DynamicCache()
        for layer in range(s["layers"]):
            cache.update(rnd(ctx), rnd(ctx), layer)
        return cache
    cache = StaticCache(config=model.config, max_cache_len=max_length)
    one = rnd(1)
    for layer, lay in enumerate(cache.layers):
        lay.lazy_initialization(one, one)
        lay.keys[:, :, :ctx].normal_(generator=g)
        lay.values[:, :, :ctx].normal_(generator=g)
        if hasattr(lay, "cumulative_length"):
            lay.cumulative_length.fill_(ctx)
    return cache


def _hf_seconds(model, method, ids, ctx, n, max_length, dtype, device, seed) -> float:
    """Seconds of ``generate`` producing ``n`` tokens per row of ``ids`` ``(requests, ctx + 1)`` from a cache
    pre-filled with ``ctx`` random tokens (the cache is built outside the timed part)."""
    cache = _hf_cache(model, method, ids.shape[0], ctx, max_length, dtype, device, seed)
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                   min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    sync(device)
    dt = time.perf_counter() - t0
    del cache
    gc.collect()
    return dt


def _time_hf(model, method, requests, contexts, max_length, n0, steps, dtype, device, seed) -> tuple:
    """(ms per step at each context, seconds of the first (warm-up/compile) call): ``generate`` continuing from
    a cache pre-filled with the context, (n0 + steps) − n0 steps."""
    vocab = model.config.vocab_size
    out, first = [], None
    for ctx in contexts:
        ids = torch.randint(3, vocab, (requests, ctx + 1), device=device)

        def run(n, ctx=ctx, ids=ids):
            return _hf_seconds(model, method, ids, ctx, n, max_length, dtype, device, seed)

        if first is None:
            first = run(n0)  # warm-up (HF compiles a static-cache decode step here)
        out.append(_per_step(run, n0, steps))
        del ids
    return out, first


def _prefill_hf(model, method, input_len, requests, prefill_tokens, max_length, device) -> tuple:
    """:func:`_timed_prefill` of the model's forward into a fresh DynamicCache / StaticCache, last logits only."""
    from transformers import DynamicCache, StaticCache

    def prefill(g):
        ids = torch.randint(3, model.config.vocab_size, (g, input_len), device=device)
        cache = DynamicCache() if method == "hf_sdpa" else StaticCache(config=model.config, max_cache_len=max_length)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    return _timed_prefill(prefill, input_len, requests, prefill_tokens, device)


# ------------------------------------------------------------------------------------------------------ the job


def _flashinfer_missing() -> Optional[str]:
    """Why the ``flashinfer`` method cannot run here (None: FlashInfer imports): not installed, or installed but
    failing to import (the error, so a broken install is not mistaken for a missing one)."""
    try:
        import flashinfer  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "flashinfer" or (e.name or "").startswith("flashinfer."):
            return "flashinfer is not installed on this machine"
        return f"flashinfer does not import ({type(e).__name__}: {e})"
    except Exception as e:  # noqa: BLE001 - any import-time failure of an installed FlashInfer
        return f"flashinfer does not import ({type(e).__name__}: {str(e)[:200]})"
    return None


def _oom_where(e: BaseException) -> str:
    """The innermost kvtransform function on the traceback of ``e`` (where the memory ran out)."""
    import kvtransform
    import kvtransform.kernels
    import kvtransform.passes

    ours = tuple(str(Path(m.__file__).resolve().parent) for m in (kvtransform, kvtransform.kernels,
                                                                    kvtransform.passes))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if str(Path(f.filename).resolve()).startswith(ours)]
    return f"{frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else "?"


def run_job(cfg, on_row: Optional[Callable] = None) -> list:
    """Run one ``decode`` job (one model shape, one ``[input, output]``); returns its CSV rows (one ``pass=run`` row
    per method with the throughput, one ``pass=step`` row per sampled context with ms/step and the HBM floor, and
    ``pass=validate`` rows with ``validate=true``)."""
    device = resolve_device(cfg)
    dtype = torch_dtype(cfg)
    methods = ORDER if cfg.method is ThroughputMethod.all or _value(cfg.method) == "all" else [_value(cfg.method)]
    model_name = _value(cfg.model)
    mshape = MODELS[model_name]
    inp, outl = int(cfg.input), int(cfg.output)
    max_length = inp + outl
    rows = []
    # runtime settings that differ from the suite's defaults are part of a row's identity (params): a -m sweep over
    # them keeps every job's rows, and a row says how it was made when a default changes later
    from .config import DecodeBenchConfig

    def ident(method) -> str:  # flashinfer_tensor_cores: only the flashinfer rows depend on it
        keys = ("budget", "compile", "cuda_graphs", "fuse_projections") + \
            (("flashinfer_tensor_cores",) if method == "flashinfer" else ())
        return f"model={model_name} input={inp} output={outl}" + "".join(
            f" {k}={str(getattr(cfg, k)).lower()}" for k in keys if getattr(cfg, k) != getattr(DecodeBenchConfig, k))

    def emit(r):
        r.setdefault("status", "ok")
        base = dict(suite=cfg.suite, mode="decode", op="generate", model=model_name, input=inp, output=outl,
                    budget=int(cfg.budget), params=ident(r.get("method")))
        base.update(r)
        rows.append(base)
        if on_row:
            on_row(base)

    if max_length > mshape["positions"]:
        for m in methods:
            emit(dict(method=m, **{"pass": "run"}, status=f"skip: {max_length} tokens > {mshape['positions']} "
                                                           f"positions of {model_name}"))
        return rows
    key = (model_name, str(dtype), str(device), int(cfg.seed))
    if _KEEP.get("key") != key:  # jobs of one sweep share the model and its transform
        _KEEP.clear()
        gc.collect()
        _KEEP.update(key=key, model=build_model(model_name, dtype, device, cfg.seed), ours={})
    model = _KEEP["model"]
    shape = _shape(model)
    wbytes = weight_bytes(model)
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    itemsize = torch.empty((), dtype=dtype).element_size()
    ours = None
    contexts = sample_contexts(inp, outl, int(cfg.samples), int(cfg.n0) + int(cfg.steps))
    paper = PAPER.get((mshape["paper"], inp, outl), {})
    for method in methods:
        rec = dict(method=method, **{"pass": "run"})
        reqs = None  # set once the request count is chosen (an OOM before that has no count)
        try:
            why = _flashinfer_missing() if method == "flashinfer" else None
            if why:
                emit(dict(rec, status=f"skip: {why}"))
                continue
            if method in OURS and ours is None:
                okey = (int(cfg.budget), bool(cfg.cuda_graphs), bool(cfg.compile), str(cfg.fuse_projections))
                if okey not in _KEEP["ours"]:
                    _KEEP["ours"][okey] = _Ours(model, cfg)
                ours = _KEEP["ours"][okey]
                ours.cfg = cfg  # this job's settings (flashinfer_tensor_cores picks the flashinfer module)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                free = torch.cuda.mem_get_info(device)[0]
            else:  # on a CPU the request count is sized for cpu_memory_gb (reserve_gb is device memory)
                free = int(cfg.cpu_memory_gb * 2 ** 30)
            reserve = int(cfg.reserve_gb * 2 ** 30) if device.type == "cuda" else 0
            # our three methods share one request count (the smallest that fits all): one compiled program
            sized = [m for m in OURS if m in methods] if method in OURS else [method]
            reqs = int(cfg.requests) or min(max_requests(m, shape, max_length, free, reserve, itemsize,
                                                         int(cfg.max_requests)) for m in sized)
            t0 = time.perf_counter()
            if device.type == "cuda":  # what the previous methods left behind (allocated, and held by the allocator)
                rec["mem_start_gb"] = round(torch.cuda.memory_allocated(device) / 2 ** 30, 2)
                rec["mem_reserved_gb"] = round(torch.cuda.memory_reserved(device) / 2 ** 30, 2)
                rec["mem_free_gb"] = round(free / 2 ** 30, 2)
            stage = {"name": "prefill"}

            def measure(reqs):
                """(prefill_s, g, ms per sample, note, head key itemsize, validate seconds or None); ``stage`` says
                whether the prefill (``g`` prompts, whatever ``reqs``) or the decode of ``reqs`` requests runs."""
                measured = None
                stage["name"] = "prefill"
                if method in OURS:
                    rt = ours.runtime(method)
                    prefill_s, g = _prefill_ours(rt, inp, reqs, int(cfg.prefill_tokens), shape["vocab"], device)
                    stage["name"] = "decode"
                    cache = _random_cache(shape, reqs, max_length, dtype, device, cfg.seed)
                    ms = _time_ours(rt, cache, contexts, int(cfg.n0), int(cfg.steps), device)
                    note = "; ".join(n for n in (ours.note(method), "decode program under torch.compile" if
                                                 rt.compile and device.type == "cuda" else "") if n)
                    head_isz = rt.head.keys.element_size() if getattr(rt.head, "keys", None) is not None else itemsize
                    if cfg.validate:
                        cache.cache_seqlens.fill_(inp)
                        tok = torch.randint(3, shape["vocab"], (reqs,), device=device)
                        measured = rt.decode_from(cache, tok, outl - 1).stats.decode_s
                    del cache
                    rt.head.release()
                else:
                    prefill_s, g = _prefill_hf(model, method, inp, reqs, int(cfg.prefill_tokens), max_length, device)
                    stage["name"] = "decode"
                    ms, first = _time_hf(model, method, reqs, contexts, max_length, int(cfg.n0), int(cfg.steps), dtype,
                                         device, cfg.seed)
                    note, head_isz = f"first generate call {first:.1f} s (warm-up{', compile' if method == 'hf_static' else ''})", itemsize
                    if cfg.validate:
                        ids = torch.randint(3, shape["vocab"], (reqs, inp + 1), device=device)
                        measured = _hf_seconds(model, method, ids, inp, outl, max_length, dtype, device, cfg.seed) \
                            * (outl - 1) / outl  # generate ran outl steps
                        del ids
                return prefill_s, g, ms, note, head_isz, measured

            retries = 0
            while True:
                try:
                    prefill_s, g, ms, note, head_isz, measured = measure(reqs)
                    break
                except torch.cuda.OutOfMemoryError as e:
                    # the memory model misses a temporary: the largest count that fits is found by trying (an
                    # explicit request count is the user's and is not changed; the prefill runs the same prompts
                    # at any count, so fewer requests cannot help it)
                    if int(cfg.requests) or reqs <= 1 or retries >= OOM_RETRIES or stage["name"] == "prefill":
                        raise
                    print(f"  {method}: out of memory at {reqs} requests in {_oom_where(e)}: retrying with fewer",
                          flush=True)
                # outside the handler: the failed attempt's tensors (held by the traceback) are released
                retries += 1
                reqs = max(1, int(reqs * 0.9))
                if method in OURS:
                    ours.runtime(method).head.release()
                gc.collect()
                torch.cuda.empty_cache()
            if retries:
                note = "; ".join(n for n in (note, f"{retries} out-of-memory retr{'y' if retries == 1 else 'ies'} "
                                                   f"(-10% requests each)") if n)
            good = [(c, m) for c, m in zip(contexts, ms) if m == m]
            if not good:
                raise RuntimeError("every sampled step was noisy (the longer run never slower): raise steps")
            decode_s = integrate_steps([c for c, _ in good], [m for _, m in good], inp, outl)
            for ctx, m in zip(contexts, ms):
                read = wbytes + step_bytes(method, shape, reqs, ctx, max_length, int(cfg.budget), itemsize,
                                           head_itemsize=head_isz)
                floor = 1000 * read / bw if bw == bw else float("nan")
                emit(dict(method=method, **{"pass": "step"}, requests=reqs, context=ctx,
                          ms_p50=round(m, 4) if m == m else None,
                          status="ok" if m == m else "noisy: the longer run was never slower (left out; raise steps)",
                          params=f"{ident(method)} context={ctx}",
                          floor_ms=round(floor, 4), x_floor=round(m / floor, 3) if floor == floor and m == m else None,
                          bytes_gb=round(read / 1e9, 3), gbps=round(read / m / 1e6, 1) if m > 0 else None,
                          copy_gbps=round(bw / 1e9, 1) if bw == bw else None))
            total = prefill_s + decode_s
            pt = paper.get(method) or paper.get({"hf_sdpa": "hf_flash_attn"}.get(method, ""))
            emit(dict(rec, requests=reqs, prefill_s=round(prefill_s, 3), prefill_group=g, decode_s=round(decode_s, 3),
                      tokens_per_s=round(reqs * outl / total, 2), decode_tokens_per_s=round(reqs * (outl - 1) /
                                                                                           decode_s, 2),
                      ms_per_step_mean=round(1000 * decode_s / max(outl - 1, 1), 3),
                      paper_tokens_per_s=pt[0] if pt else None, paper_requests=pt[1] if pt else None,
                      note=note, wall_s=round(time.perf_counter() - t0, 1)))
            if cfg.validate:
                err = decode_s / measured - 1
                emit(dict(method=method, **{"pass": "validate"}, requests=reqs, decode_s=round(measured, 3),
                          estimate_s=round(decode_s, 3), rel_err=round(err, 4),
                          status="ok" if abs(err) <= VALIDATE_TOL else
                          f"outside {VALIDATE_TOL:.0%}: raise steps/samples (on a CPU: OMP_NUM_THREADS=1)"))
        except torch.cuda.OutOfMemoryError as e:
            emit(dict(rec, requests=reqs, status=f"oom in {_oom_where(e)}: {str(e).splitlines()[0][:160]}"))
        except Exception as e:  # one method failing must not lose the others' rows
            traceback.print_exc()
            emit(dict(rec, status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
        finally:
            if method in OURS and ours is not None and ours.built(method):  # (not when building it failed)
                ours.runtime(method).head.release()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    model = ours = None  # (closures above read these names: rebinding, not del)
    gc.collect()
    return rows


_KEEP: dict = {}  # the last job's model and transforms (a sweep's jobs on one model reuse them)
