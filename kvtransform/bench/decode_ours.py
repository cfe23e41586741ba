"""The ``decode`` suite's methods that run our SpeContext runtime (``dense``, ``specontext``, ``quest``,
``flashinfer``, ``specontext_offload``): one transform of the job's model shared by them, one retrieval head each, a
random KV cache to decode from, and their timed decode steps and prefill (arXiv 2512.00722 §7); for
``specontext_offload`` the memory plan's request count and offloaded steps (§5–6).
"""
from __future__ import annotations

import torch

from .decode_model import OURS
from .decode_sampling import per_step, timed_prefill

__all__ = ["Ours", "use_flashinfer", "distilled_state", "random_cache", "time_ours", "prefill_ours",
           "offload_plan", "offload_requests", "offloaded_run", "throughput_plan"]


class Ours:
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
                state, note = distilled_state(self.model)
            module = SpeContextModule(self.sp.core["prefill"], self.sp.core["decode"], self.base, self.sp.report,
                                      self.sp.info, self.sp.head.scale, model=self.model, head_name=head,
                                      head_state=state)
            if method == "flashinfer":
                note = use_flashinfer(module.runtime, bool(self.cfg.flashinfer_tensor_cores))
            module.runtime.offload = method == "specontext_offload"
            self.modules[key], self.notes[key] = module, note
        return self.modules[key].runtime


def use_flashinfer(rt, tensor_cores: bool) -> str:
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


def distilled_state(model) -> tuple:
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


def random_cache(shape, requests, max_length, dtype, device, seed):
    from kvtransform.runtime.cache import KVCache

    cache = KVCache.allocate(shape["layers"], requests, shape["kv_heads"], max_length, shape["head_dim"], dtype,
                             device)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in range(shape["layers"]):
        cache.k[layer].normal_(generator=g)
        cache.v[layer].normal_(generator=g)
    cache.token_ids.random_(3, shape["vocab"], generator=g)
    return cache


def time_ours(rt, cache, contexts, n0, steps, device) -> list:
    """ms per decode step at each context: (run of n0 + steps) − (run of n0), both from the same cache state."""
    tok = torch.randint(3, rt.info.vocab_size, (cache.batch,), device=device)
    cache.cache_seqlens.fill_(contexts[0])
    rt.decode_from(cache, tok, n0)  # warm-up: kernel compilation / autotuning stays out of the first sample
    out = []
    for ctx in contexts:
        def run(n, ctx=ctx):
            cache.cache_seqlens.fill_(ctx)
            return rt.decode_from(cache, tok, n).stats.decode_s

        out.append(per_step(run, n0, steps))
    return out


def prefill_ours(rt, input_len, requests, prefill_tokens, vocab, device) -> tuple:
    """:func:`timed_prefill` of the runtime's packed prefill (the cache it builds is dropped)."""
    def prefill(g):
        rt.prefill([torch.randint(3, vocab, (input_len,)) for _ in range(g)], input_len, device)

    return timed_prefill(prefill, input_len, requests, prefill_tokens, device)


def offload_plan(rt, requests: int, input_len: int, output_len: int, free_bytes: int):
    """The runtime's memory plan (:func:`~kvtransform.runtime.offload.make_plan`) for ``requests`` rows with
    ``free_bytes`` of device memory beside the weights and the retrieval head's weights (both held already when
    the suite measures what is free). Raises ValueError when no plan fits."""
    from kvtransform.runtime.offload import make_plan, plan_inputs

    model, head = plan_inputs(rt)  # the weights as the plan counts them
    held = model.weight_bytes + head.weight_bytes
    return make_plan(rt, requests, input_len, output_len, held + max(0, int(free_bytes)))


def offload_requests(rt, input_len: int, output_len: int, free_bytes: int, host_limit: int, cap: int) -> int:
    """The largest request count, 0 to ``cap``, that KV offload serves (SpeContext §5, Eq. 8): its memory plan
    (:func:`offload_plan`) fits ``free_bytes`` of device memory beside the weights, and the K/V of the layers it has
    on CPU at the last token fit ``host_limit`` bytes of pinned CPU memory (``MemoryPlan.pinned_bytes``)."""
    def fits(batch):
        try:
            return offload_plan(rt, batch, input_len, output_len, free_bytes).pinned_bytes <= host_limit
        except ValueError:  # no plan fits the device memory
            return False

    lo, hi = 0, int(cap)
    while lo < hi:  # both limits grow with the count: the largest that fits, by bisection
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def offloaded_run(rt, plan, vocab, device, seed):
    """``run(ctx, n, room) -> seconds`` of ``n`` offloaded decode steps of ``plan.batch`` rows from ``ctx`` cached
    tokens: a fresh :class:`~kvtransform.runtime.offload.OffloadedKVCache` and engine each run, placed at ``ctx``
    with room for ``room`` steps before a growth (:meth:`~kvtransform.runtime.offload.OffloadEngine.resume_at`;
    ``n <= room``: no growth or move inside a timed run), the plan's layers on CPU from the start; the pinned CPU
    buffers are allocated by the first run and reused. The K/V values are zeros: the step's work does not depend on
    them (the distilled head selects from token ids; the token ids are random)."""
    from kvtransform.runtime.offload import LayerReady, OffloadedKVCache, OffloadEngine

    info = rt.info
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(3, vocab, (plan.batch, plan.final_len), generator=g, device=device)
    tok = torch.randint(3, vocab, (plan.batch,), generator=g, device=device)
    host = []

    def run(ctx, n, room):
        cache = OffloadedKVCache(info.num_layers, plan.batch, info.num_kv_heads, plan.final_len, info.head_dim,
                                 getattr(torch, info.dtype), device, capacity=1)
        if host:
            cache.host, cache.host_view = host
        engine = OffloadEngine(cache, plan, int(rt.head.budget), int(rt.offload_chunk),
                               rt.programs.layer_split(LayerReady))
        engine.preallocate()
        engine.resume_at(ctx, room)
        host[:] = [cache.host, cache.host_view]
        cache.token_ids.copy_(ids)
        stats = rt.decode_from(cache, tok, n, engine=engine).stats
        run.overlap = stats.selection_overlap  # of the consecutive selections of this run (None: one step)
        return stats.decode_s

    run.overlap = None
    return run


def throughput_plan(rt, top, input_len: int, output_len: int, free_bytes: int, contexts, n0: int, steps: int,
                    hbm_bytes_per_s: float, vocab: int, device, seed: int) -> tuple:
    """``(plan, note)``: the request count, at most ``top.batch``, whose memory plan has the most modelled
    tokens/s (:func:`~kvtransform.runtime.throughput.best_batch`), the model calibrated on this run's own steps.

    Two offloaded runs of the largest plan ``top`` (:func:`offload_plan`) are timed as the suite times a sample
    (:func:`~kvtransform.bench.decode_sampling.per_step`): at the first sampled context (few or no layers on CPU:
    the step over its HBM floor at ``hbm_bytes_per_s`` gives ``gpu_factor``) and at the last (the rest of the step is
    elastic loading: with the measured selection overlap it gives the link rate). When the last sample has no layer
    on CPU, or its step is no slower than the model's GPU part, offload costs nothing measurable and ``top`` stays.
    """
    from kvtransform.runtime.offload import initial_capacity, plan_inputs
    from kvtransform.runtime.throughput import StepModel, best_batch, step_bytes

    run, room = offloaded_run(rt, top, vocab, device, seed), n0 + steps
    first, last = int(contexts[0]), int(contexts[-1])
    ms_first = per_step(lambda n: run(first, n, room), n0, steps)
    ms_last = per_step(lambda n: run(last, n, room), n0, steps)
    overlap = run.overlap or 0.0
    chunk = int(rt.offload_chunk)
    layers = [len(top.offloaded_at(initial_capacity(top, c + room, top.final_len, chunk))) for c in (first, last)]
    largest = "largest count that fits: offload cost not measurable in the probe"
    if not (ms_first == ms_first and ms_last == ms_last):
        return top, f"{largest} (noisy samples)"
    if layers[1] == 0:
        return top, f"{largest} (no layer on CPU at context {last})"
    reads, _ = step_bytes(top, first, chunk)
    factor = max(1.0, ms_first / 1000 / (reads / hbm_bytes_per_s)) if not layers[0] else 1.0
    reads, _ = step_bytes(top, last, chunk)
    moved = step_bytes(top, last + room, chunk)[1] * (1 - overlap)  # the layers on CPU at the run's capacity
    spent = ms_last / 1000 - factor * reads / hbm_bytes_per_s
    if spent <= 0 or moved <= 0:
        return top, (f"{largest} (the step with {layers[1]} layers on CPU, {ms_last:.3g} ms, is no slower than the "
                     f"modelled GPU step; overlap {overlap:.2f})")
    sm = StepModel(hbm_bytes_per_s, moved / spent, overlap, factor, chunk)
    model, head = plan_inputs(rt)
    plan, rate = best_batch(model, head, sm, gpu_bytes=model.weight_bytes + head.weight_bytes + max(0, free_bytes),
                            input_len=input_len, output_len=output_len, budget=int(rt.head.budget),
                            max_batch=top.batch)
    return plan, (f"count for the most modelled tokens/s ({rate:.0f}; of at most {top.batch}): probe at "
                  f"{top.batch} requests, overlap {overlap:.2f}, link {sm.link_bytes_per_s / 1e9:.1f} GB/s, "
                  f"GPU step {factor:.2f}x its floor")
