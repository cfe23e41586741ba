"""What KV offload can buy at an A800's memory (SpeContext arXiv 2512.00722 §5-6), from two CPU measurements:

1. the shipped distilled head's consecutive-selection overlap on real text (SmolLM2-135M; the head scores from token
   ids alone, so no LLM forward is needed): the share of a step's selected entries the previous step had selected,
   which is what elastic loading does not copy again;
2. the decode throughput model of ``kvtransform.runtime.throughput`` (calibrated on the H200: BENCHMARKS.md, "Decode
   throughput", at an A800's memory) at the Llama-8B shape, [2k, 32k], budget 2048, ``gpu_gb=79.1``: the tokens/s of
   SpeContext with offload at twice dense's request count, against dense at its largest count, both steps at the same
   ratio to their HBM floors, for the copies added to the step (the captured step) and fully hidden behind it.

Usage: ``python3 -P tools/offload_bound_probe.py [--docs argparse.py difflib.py idlelib/NEWS2x.txt] [--steps 128]``
"""
from __future__ import annotations

import argparse

import torch

from kvtransform.bench.decode_model import GIB, build_model
from kvtransform.runtime import throughput
from kvtransform.runtime.memory import HeadMemory, ModelMemory, plan_memory
from kvtransform.runtime.throughput import StepModel, step_bytes


def head_overlap(model, tok, doc: str, budget: int, context: int, steps: int) -> float:
    from kvtransform.config import SpeContextConfig
    from kvtransform.runtime.cache import KVCache
    from kvtransform.runtime.heads import make_head
    from kvtransform.runtime.outputs import _overlap
    from kvtransform.textdata import read_text

    cfg = model.config
    ids = torch.tensor(tok(read_text(doc))["input_ids"][:context + steps + 1])
    prefix = int(ids.numel()) - steps - 1
    d = cfg.hidden_size // cfg.num_attention_heads
    head = make_head("distilled", SpeContextConfig(head="distilled", budget=budget), d ** -0.5)
    head.bind(model)
    k = torch.zeros(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, ids.numel() + 1, d)  # unread by this head
    cache = KVCache(k, k, torch.tensor([prefix], dtype=torch.int32), ids[None].clone())
    head.prefill(cache)
    prev, total = None, 0.0
    for i in range(steps):
        cache.cache_seqlens.fill_(prefix + i)
        cache.set_current(ids[prefix + i:prefix + i + 1])
        sel = head.step(cache, None)
        if prev is not None:
            total += float(_overlap(prev, sel, ids.numel() + 1))
        prev = sel
    return total / (steps - 1), prefix


def bound(overlaps, factors, hidden: bool):
    m = ModelMemory.from_model(build_model("llama-8b", torch.bfloat16, "meta"))
    head = HeadMemory(weight_bytes=GIB // 8, token_bytes=m.num_kv_heads * m.head_dim * 2)  # the head's own keys
    kw = dict(gpu_bytes=int(79.1 * GIB), input_len=2048, output_len=32768, reserve_bytes=8 * GIB)
    dense_b = 1
    while True:  # dense: every cached token read, nothing offloaded
        try:
            if plan_memory(m, HeadMemory(), batch=dense_b + 1, budget=2048 + 32768, **kw).needs_offload:
                break
        except ValueError:
            break
        dense_b += 1
    dense_plan = plan_memory(m, HeadMemory(), batch=dense_b, budget=2048 + 32768, **kw)
    ours_plan = plan_memory(m, head, batch=2 * dense_b, budget=2048, **kw)
    original = throughput.step_seconds

    def hidden_step(plan, n, sm):  # the copies run beside the GPU step: the slower of the two
        reads, moved = step_bytes(plan, n, sm.chunk)
        return max(sm.gpu_factor * reads / sm.hbm_bytes_per_s, (1.0 - sm.overlap) * moved / sm.link_bytes_per_s)

    throughput.step_seconds = hidden_step if hidden else original
    try:
        for f in factors:
            rate = lambda ov: throughput.tokens_per_second(  # noqa: E731
                ours_plan, StepModel(4.29e12, 42.7e9, ov, f, 1024))
            dense = throughput.tokens_per_second(dense_plan, StepModel(4.29e12, 42.7e9, 1.0, f, 1024))
            need = next((o / 100 for o in range(101) if rate(o / 100) >= 3 * dense), None)
            cells = "; ".join(f"overlap {o:.2f}: {rate(o) / dense:.2f}x" for o in overlaps)
            print(f"  copies {'hidden' if hidden else 'added'}, steps {f}x their floor: dense {dense_b} requests "
                  f"{dense:.0f} tok/s; offload at {2 * dense_b}: {cells}; >= 3x needs overlap >= {need}")
    finally:
        throughput.step_seconds = original


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", nargs="+", default=["argparse.py", "difflib.py", "idlelib/NEWS2x.txt"])
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from kvtransform.models import load_model

    model, tok = load_model("smollm2-135m")
    measured = []
    for doc in args.docs:
        for budget, context in ((256, 2048), (1024, 2048), (256, 8064), (512, 8064), (1024, 8064), (2048, 8064)):
            ov, cached = head_overlap(model, tok, doc, budget, context, args.steps)
            measured.append(ov)
            print(f"{doc}: budget {budget} of {cached}-{cached + args.steps} cached tokens "
                  f"({budget / cached:.0%}): overlap {ov:.3f}")
    print("A800 memory, Llama-8B shape, [2k, 32k], budget 2048 (throughput model, 42.7 GB/s host link):")
    for hidden in (False, True):
        bound((0.6, 0.75, 0.9), (1.0, 1.2, 1.41), hidden)


if __name__ == "__main__":
    main()
