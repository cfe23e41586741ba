"""Runner of the ``decode`` suite: end-to-end decode throughput of long generations (SpeContext, arXiv 2512.00722
§7, Table 5; the paper's A800 numbers are in ``shared/seed_tables/specontext_throughput_a800.csv`` and
:data:`PAPER`).

One job = one model shape × one ``[input, output]`` request shape; every method of
:class:`~kvtransform.bench.config.ThroughputMethod` runs in this process on the same random-weight model (speed does
not depend on the weights' values), each with the largest number of concurrent requests whose memory fits
(:func:`max_requests`; or ``requests=N``). ``gpu_gb=G`` compares them at the memory of a smaller card: everything the
process holds (CUDA context, weights, caches, workspace, ``reserve_gb``) must fit in ``G`` GiB, the request counts
shrink to fit, and on CUDA the allocator is held to the cap (:func:`memory_cap`); every row records ``gpu_gb``
(0: the whole device).

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
:mod:`kvtransform.bench.flashinfer_decode`; a skip where FlashInfer does not import), ``specontext_offload``
(``specontext`` with KV offload, §5–6: of the request counts the memory plan serves within the device memory and
``host_gb`` of pinned CPU memory, the one with the most modelled tokens/s (``offload_count=throughput``:
:func:`.decode_ours.throughput_plan`) or the largest (``offload_count=largest``); each sampled step runs with the
layers the plan has on CPU by then, elastic loading included). Our runtime replays each step as a CUDA graph, its decode program under
``torch.compile`` (``compile=true``, CUDA only; not the offloaded per-layer program).
"""
from __future__ import annotations

import gc
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch

from kvtransform.runtime.offload import initial_capacity, plan_inputs

from .config import ThroughputMethod
from .decode_hf import hf_seconds, prefill_hf, time_hf
from .decode_model import (GIB, MODELS, OFFLOAD, OURS, PAPER, build_model, cap_fraction, capped_free, held_bytes,
                           host_limit, max_requests, model_shape, per_request_bytes, step_bytes, weight_bytes)
from .decode_ours import (Ours, offload_plan, offload_requests, offloaded_run, prefill_ours,
                          random_cache, throughput_plan, time_ours)
from .decode_sampling import integrate_steps, per_step, sample_contexts
from .device import copy_bandwidth, resolve_device
from .layer import torch_dtype

__all__ = ["MODELS", "PAPER", "ORDER", "build_model", "max_requests", "per_request_bytes", "sample_contexts",
           "integrate_steps", "step_bytes", "memory_cap", "run_job"]

ORDER = [m.value for m in ThroughputMethod if m is not ThroughputMethod.all]
OOM_RETRIES = 3  # automatic request counts: retries at -10 % after an out-of-memory error
VALIDATE_TOL = 0.05  # a sampled estimate within 5 % of the whole run (BENCHMARKS.md, "Decode throughput")


def _value(x) -> str:
    return x.value if hasattr(x, "value") else str(x)


def flashinfer_missing() -> Optional[str]:
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


def oom_where(e: BaseException) -> str:
    """The innermost kvtransform function on the traceback of ``e`` (where the memory ran out)."""
    import kvtransform
    import kvtransform.kernels
    import kvtransform.passes

    ours = tuple(str(Path(m.__file__).resolve().parent) for m in (kvtransform, kvtransform.kernels,
                                                                    kvtransform.passes))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if str(Path(f.filename).resolve()).startswith(ours)]
    return f"{frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else "?"


@contextmanager
def memory_cap(device: torch.device, cap_bytes: int):
    """Hold this process to ``cap_bytes`` of ``device`` while the ``with`` block runs (``gpu_gb``); yields the bytes
    PyTorch may hold under the cap (None: ``cap_bytes=0``, no cap).

    On CUDA the cap is enforced, not only accounted: ``torch.cuda.set_per_process_memory_fraction`` limits PyTorch's
    caching allocator (weights, KV caches, CUDA-graph pools, compile and cuBLAS workspaces: every tensor) to the cap
    less the memory in use outside it when the block starts (CUDA context, loaded kernels;
    :func:`.decode_model.cap_fraction`), so an allocation past the cap raises ``torch.cuda.OutOfMemoryError`` as on a
    card of that size, and the runner's retries at fewer requests apply. Memory allocated outside PyTorch after the
    start (kernel modules loaded later, tens of MiB) is not limited. The fraction goes back to 1 (the whole device)
    when the block ends. On a CPU nothing is limited: the request counts are sized for the cap (the part a CPU run
    can check)."""
    if not cap_bytes:
        yield None
        return
    if device.type != "cuda":
        yield int(cap_bytes)
        return
    # set_per_process_memory_fraction takes an index, not a bare "cuda" device
    device = device.index if device.index is not None else torch.cuda.current_device()
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    frac = cap_fraction(cap_bytes, total, free, torch.cuda.memory_reserved(device))
    torch.cuda.set_per_process_memory_fraction(frac, device)
    try:
        yield int(frac * total)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


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

    def ident(method) -> str:  # flashinfer_tensor_cores (host_gb): only the flashinfer (offload) rows depend on it
        keys = ("budget", "compile", "cuda_graphs", "fuse_projections", "gpu_gb") + \
            (("flashinfer_tensor_cores",) if method == "flashinfer" else ()) + \
            (("host_gb", "offload_count") if method == OFFLOAD else ())
        return f"model={model_name} input={inp} output={outl}" + "".join(
            f" {k}={str(getattr(cfg, k)).lower()}" for k in keys if getattr(cfg, k) != getattr(DecodeBenchConfig, k))

    def emit(r):
        r.setdefault("status", "ok")
        base = dict(suite=cfg.suite, mode="decode", op="generate", model=model_name, input=inp, output=outl,
                    budget=int(cfg.budget), gpu_gb=float(cfg.gpu_gb), params=ident(r.get("method")))
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
    shape = model_shape(model)
    wbytes = weight_bytes(model)
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    itemsize = torch.empty((), dtype=dtype).element_size()
    ours = None
    cap = int(float(cfg.gpu_gb) * GIB)  # 0: no cap
    n0, steps = int(cfg.n0), int(cfg.steps)
    contexts = sample_contexts(inp, outl, int(cfg.samples), n0 + steps)
    paper = PAPER.get((mshape["paper"], inp, outl), {})
    with memory_cap(device, cap) as limit:  # (limit: the bytes this process may hold, None: no cap)
        for method in methods:
            rec = dict(method=method, **{"pass": "run"})
            reqs = None  # set once the request count is chosen (an OOM before that has no count)
            try:
                why = flashinfer_missing() if method == "flashinfer" else None
                if why:
                    emit(dict(rec, status=f"skip: {why}"))
                    continue
                if method in OURS and ours is None:
                    okey = (int(cfg.budget), bool(cfg.cuda_graphs), bool(cfg.compile), str(cfg.fuse_projections))
                    if okey not in _KEEP["ours"]:
                        _KEEP["ours"][okey] = Ours(model, cfg)
                    ours = _KEEP["ours"][okey]
                    ours.cfg = cfg  # this job's settings (flashinfer_tensor_cores picks the flashinfer module)
                if method in OURS:
                    ours.runtime(method)  # its retrieval head's weights are held before the memory is measured
                gc.collect()
                if device.type == "cuda":  # under a cap: as if the device had gpu_gb (all in use counts against it)
                    torch.cuda.empty_cache()
                    free = capped_free(*torch.cuda.mem_get_info(device), cap)
                else:  # on a CPU sized for cpu_memory_gb, or the cap less the weights (reserve_gb is device memory)
                    held = held_bytes(model) + (plan_inputs(ours.runtime(method))[1].weight_bytes if method in OURS
                                                else 0)  # + the retrieval head's weights
                    free = max(0, cap - held) if cap else int(cfg.cpu_memory_gb * GIB)
                reserve = int(cfg.reserve_gb * GIB) if device.type == "cuda" else 0
                # our resident methods share one request count (the smallest that fits all): one compiled program
                sized = [m for m in OURS if m in methods and m != OFFLOAD] if method in OURS else [method]
                if method == OFFLOAD:  # the memory plan's count (§5, Eq. 8), within host_gb of pinned memory
                    reqs = int(cfg.requests) or offload_requests(ours.runtime(method), inp, outl, free - reserve,
                                                                 host_limit(cfg), int(cfg.max_requests))
                    if not reqs:
                        emit(dict(rec, status=f"skip: no request fits with offload ({free / GIB:.1f} GiB free, "
                                              f"host_gb={cfg.host_gb or 'auto'})"))
                        continue
                else:
                    reqs = int(cfg.requests) or min(max_requests(m, shape, max_length, free, reserve, itemsize,
                                                                 int(cfg.max_requests)) for m in sized)
                t0 = time.perf_counter()
                if device.type == "cuda":  # what earlier methods left behind (allocated, held by the allocator)
                    rec["mem_start_gb"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
                    rec["mem_reserved_gb"] = round(torch.cuda.memory_reserved(device) / GIB, 2)
                    rec["mem_free_gb"] = round(free / GIB, 2)
                stage = {"name": "prefill"}

                def measure(reqs):
                    """(requests, prefill_s, g, ms per sample, note, head key itemsize, validate seconds or None);
                    ``stage`` says whether the prefill (``g`` prompts, whatever ``reqs``) or the decode of ``reqs``
                    requests runs. The offload method may serve fewer requests than ``reqs`` (``offload_count``)."""
                    measured = None
                    stage["name"] = "prefill"
                    if method in OURS:
                        rt = ours.runtime(method)
                        rt.gpu_memory_bytes = limit  # (generate's own offload plan would plan for the cap)
                        note = ours.note(method)
                        if method == OFFLOAD:
                            plan = offload_plan(rt, reqs, inp, outl, free - reserve)
                            if cfg.offload_count == "throughput" and not int(cfg.requests):
                                stage["name"] = "decode"  # (the probe decodes: out of memory there tries fewer)
                                rate = bw if bw == bw else copy_bandwidth(device, 64)  # (a CPU's, for the stand-in)
                                plan, chosen = throughput_plan(rt, plan, inp, outl, free - reserve, contexts, n0,
                                                               steps, rate, shape["vocab"], device, cfg.seed)
                                note = "; ".join((note, chosen))
                                stage["name"] = "prefill"
                            reqs = plan.batch
                        prefill_s, g = prefill_ours(rt, inp, reqs, int(cfg.prefill_tokens), shape["vocab"], device)
                        stage["name"] = "decode"
                        if method == OFFLOAD:
                            stage["plan"] = plan
                            run, room = offloaded_run(rt, plan, shape["vocab"], device, cfg.seed), n0 + steps
                            ms = [per_step(lambda n, c=c: run(c, n, room), n0, steps) for c in contexts]
                            gib = plan.pinned_bytes / GIB
                            pinned = f"{gib:.1f} GiB" if gib >= 0.1 else f"{gib * 1024:.1f} MiB"
                            note += f"; {len(plan.offloaded_at(max_length))} of {shape['layers']} layers on CPU by " \
                                    f"the last token ({pinned} pinned)"
                            if cfg.validate:
                                measured = run(inp, outl - 1, 0)
                        else:
                            cache = random_cache(shape, reqs, max_length, dtype, device, cfg.seed)
                            ms = time_ours(rt, cache, contexts, n0, steps, device)
                            if rt.compile and device.type == "cuda":
                                note = "; ".join(n for n in (note, "decode program under torch.compile") if n)
                            if cfg.validate:
                                cache.cache_seqlens.fill_(inp)
                                tok = torch.randint(3, shape["vocab"], (reqs,), device=device)
                                measured = rt.decode_from(cache, tok, outl - 1).stats.decode_s
                            del cache
                        head_keys = getattr(rt.head, "keys", None)
                        head_isz = head_keys.element_size() if head_keys is not None else itemsize
                        rt.head.release()
                    else:
                        prefill_s, g = prefill_hf(model, method, inp, reqs, int(cfg.prefill_tokens), max_length, device)
                        stage["name"] = "decode"
                        ms, first = time_hf(model, method, reqs, contexts, max_length, n0, steps,
                                            dtype, device, cfg.seed)
                        note = f"first generate call {first:.1f} s (warm-up" \
                               f"{', compile' if method == 'hf_static' else ''})"
                        head_isz = itemsize
                        if cfg.validate:
                            ids = torch.randint(3, shape["vocab"], (reqs, inp + 1), device=device)
                            measured = hf_seconds(model, method, ids, inp, outl, max_length, dtype, device, cfg.seed) \
                                * (outl - 1) / outl  # generate ran outl steps
                            del ids
                    return reqs, prefill_s, g, ms, note, head_isz, measured

                retries = 0
                while True:
                    try:
                        reqs, prefill_s, g, ms, note, head_isz, measured = measure(reqs)
                        break
                    except torch.cuda.OutOfMemoryError as e:
                        # the memory model misses a temporary: the largest count that fits is found by trying (an
                        # explicit request count is the user's and is not changed; the prefill runs the same prompts
                        # at any count, so fewer requests cannot help it)
                        if int(cfg.requests) or reqs <= 1 or retries >= OOM_RETRIES or stage["name"] == "prefill":
                            raise
                        print(f"  {method}: out of memory at {reqs} requests in {oom_where(e)}: retrying with fewer",
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
                    off = {}
                    if method == OFFLOAD:  # the layers on CPU during this sample (resume_at's capacity)
                        plan, chunk = stage["plan"], ours.runtime(method).offload_chunk
                        off["offloaded_layers"] = len(plan.offloaded_at(initial_capacity(plan, ctx + n0 + steps,
                                                                                         max_length, chunk)))
                    emit(dict(method=method, **{"pass": "step"}, requests=reqs, context=ctx, **off,
                              ms_p50=round(m, 4) if m == m else None,
                              status="ok" if m == m else
                              "noisy: the longer run was never slower (left out; raise steps)",
                              params=f"{ident(method)} context={ctx}",
                              floor_ms=round(floor, 4),
                              x_floor=round(m / floor, 3) if floor == floor and m == m else None,
                              bytes_gb=round(read / 1e9, 3), gbps=round(read / m / 1e6, 1) if m > 0 else None,
                              copy_gbps=round(bw / 1e9, 1) if bw == bw else None))
                total = prefill_s + decode_s
                pt = paper.get(method) or paper.get({"hf_sdpa": "hf_flash_attn"}.get(method, ""))
                emit(dict(rec, requests=reqs, prefill_s=round(prefill_s, 3), prefill_group=g,
                          decode_s=round(decode_s, 3),
                          tokens_per_s=round(reqs * outl / total, 2),
                          decode_tokens_per_s=round(reqs * (outl - 1) / decode_s, 2),
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
                emit(dict(rec, requests=reqs, status=f"oom in {oom_where(e)}: {str(e).splitlines()[0][:160]}"))
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
