"""SpeContext on CUDA (arXiv 2512.00722 §4–5): CUDA-graph decode == eager decode, and decode ms/step against the HBM
floor. Run on the device (bf16, greedy), from the repository root:

    source tools/device_env.sh && python3 -P tools/specontext_gpu_check.py [--quick] [--contexts 4096,16384,32768]

1. **Graph == eager** for the default model (SmolLM2-135M via ``kvt.load_model``; a random-weight model of the same
   shape when the GGUF loader is unavailable) and for a random-weight 8B-shaped Llama (32 layers, 32/8 heads,
   head_dim 128, hidden 4096, intermediate 14336, vocab 128256): batch 8, prompt 2048, 256 new tokens, head
   ``quest`` budget 2048 (selection active past 2048 tokens). Tokens and per-step selection checksums must match.
2. **Decode ms/step** of the 8B shape at contexts 4K/16K/32K (batch ``--timing-batch``, default 4): sparse (quest,
   budget 2048, CUDA graph), ``head=dense`` (CUDA graph), and HF ``generate`` (sdpa, DynamicCache pre-filled with
   the context). The cache holds random K/V (decode cost does not depend on the values). HBM floor = (weight bytes
   + KV bytes the step must read) / copy bandwidth measured here: ``dense`` reads all K/V; sparse reads the selected
   K/V plus the quest page min/max keys (2 × L × B × H_kv × ctx/16 × D). Prints a markdown table and writes
   ``specontext_gpu_check.csv`` (into ``$OUT`` when set).

Needs no Hydra; works with torch 2.11 / triton 3.6 / transformers 5.17. Exit status 1 when a graph/eager check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

import torch

import kvtransform as kvt
from kvtransform.bench.decode import copy_bandwidth, weight_bytes as step_weight_bytes
from kvtransform.bench.report import save_rows
from kvtransform.runtime.cache import KVCache
from kvtransform.runtime.generate import _GraphStep

DEV = torch.device("cuda")
DT = torch.bfloat16


def log(*a):
    print(*a, flush=True)


def random_llama(layers=32, heads=32, kv_heads=8, head_dim=128, hidden=4096, inter=14336, vocab=128256,
                 positions=40960, tie=False):
    import transformers

    cfg = transformers.LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   head_dim=head_dim, hidden_size=hidden, intermediate_size=inter, vocab_size=vocab,
                                   max_position_embeddings=positions, tie_word_embeddings=tie, rope_theta=500000.0,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEV):
        model = transformers.LlamaForCausalLM._from_config(cfg, torch_dtype=DT)
    for p in model.parameters():  # keep activations in range through 32 random layers
        p.data.normal_(0, 0.02)
    return model.eval()


def default_model():
    try:
        model, tok = kvt.load_model("smollm2-135m", dtype="bfloat16")
        return model.to(DEV).eval(), tok, "smollm2-135m"
    except Exception as e:  # no gguf wheel / no cached GGUF: same shape, random weights
        log(f"[default model] load_model failed ({type(e).__name__}: {str(e)[:120]}); using a random-weight "
            f"SmolLM2-135M-shaped Llama")
        return random_llama(30, 9, 3, 64, 576, 1536, 49152, 8192, tie=True), None, "smollm2-135m-shape (random)"


def transform(model, **cfg):
    t0 = time.perf_counter()
    sp = kvt.transform(model, kvt.SpeContextConfig(**cfg), progress=False)
    v = sp.report.verification
    log(f"  transform {cfg}: {sp.report.count('sparse_decode')} sites sparse_decode, gate max_rel "
        f"{v.max_rel_error:.2e} passed {v.passed} ({time.perf_counter() - t0:.1f} s)")
    return sp


def with_head(sp, head):
    cfg = dataclasses.replace(sp.config, head=head)
    return type(sp)(sp.core["prefill"], sp.core["decode"], cfg, sp.report, sp.info, sp.head.scale)


def graph_vs_eager(sp, name, batch, prompt, new, tok=None) -> bool:
    vocab = sp.info.vocab_size
    if tok is not None:
        from kvtransform.verify import text_token_ids

        ids = torch.stack([text_token_ids(tok, vocab, prompt, offset=97 * b) for b in range(batch)])
    else:
        ids = torch.randint(3, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(DEV)
    res = {}
    for graphs in (False, True):
        sp.runtime.cuda_graphs = graphs
        out = sp.generate(ids, max_new_tokens=new, eos_token_id=None, return_dict_in_generate=True, progress=False)
        res[graphs] = out
        st = out.stats
        log(f"  {name} {'graph' if graphs else 'eager'}: {st.decode_steps} steps, {st.ms_per_step:.2f} ms/step, "
            f"prefill {st.prefill_s:.2f} s, overlap {st.selection_overlap:.3f}, cuda_graph={st.cuda_graph}")
    sp.runtime.cuda_graphs = True
    same_tok = torch.equal(res[False].sequences, res[True].sequences)
    same_sel = res[False].stats.selection_checksums == res[True].stats.selection_checksums
    n_diff = int((res[False].sequences != res[True].sequences).sum())
    log(f"  {name}: graph == eager tokens: {same_tok} ({n_diff} differ); selections identical: {same_sel}")
    return same_tok and same_sel


@torch.no_grad()
def time_runtime(sp, batch, ctx, steps, graphs=True) -> float:
    """ms/step of the SpeContext decode step with a random cache of ``ctx`` tokens per row."""
    rt, info = sp.runtime, sp.info
    cache = KVCache.allocate(info.num_layers, batch, info.num_kv_heads, ctx + steps + 8, info.head_dim, DT, DEV)
    cache.k.normal_()
    cache.v.normal_()
    cache.cache_seqlens.fill_(ctx)
    rt.head.prefill(cache)
    tok = torch.randint(3, info.vocab_size, (batch,), device=DEV)
    sel = rt.head.step(cache, None)
    logits, q = rt.decode(cache, tok, sel)
    tok = logits.argmax(-1)
    step = None
    if graphs:
        step = _GraphStep(rt, cache)
        step.q = q.clone()
        logits, _ = step(tok)
    else:
        sel = rt.head.step(cache, q)
        logits, q = rt.decode(cache, logits.argmax(-1), sel)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        if step is not None:
            logits, _ = step(logits.argmax(-1))
        else:
            sel = rt.head.step(cache, q)
            logits, q = rt.decode(cache, logits.argmax(-1), sel)
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0) / steps
    del cache, step
    return ms


@torch.no_grad()
def time_hf(model, batch, ctx, steps) -> float:
    """ms/step of HF ``generate`` (sdpa) continuing from a DynamicCache pre-filled with ``ctx`` random tokens."""
    from transformers import DynamicCache

    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    data = [(torch.randn(batch, cfg.num_key_value_heads, ctx, d, dtype=DT, device=DEV),
             torch.randn(batch, cfg.num_key_value_heads, ctx, d, dtype=DT, device=DEV))
            for _ in range(cfg.num_hidden_layers)]
    ids = torch.randint(3, cfg.vocab_size, (batch, ctx + 1), device=DEV)

    def run(n):
        cache = DynamicCache(data)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)
    short, long = run(2), run(steps + 2)
    del data
    return 1000 * (long - short) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a fast smoke of the script itself)")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--timing-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip-default", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("specontext_gpu_check needs CUDA")
    t_start = time.perf_counter()
    batch, prompt, new = (2, 256, 32) if args.quick else (8, 2048, 256)
    budget = 128 if args.quick else 2048
    ok = True
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; batch {batch}, prompt {prompt}, "
        f"{new} new tokens, quest budget {budget}")

    if not args.skip_default:
        log("[1] default model: CUDA graph vs eager")
        model, tok, name = default_model()
        sp = transform(model, budget=budget, head="quest")
        ok &= graph_vs_eager(sp, name, batch, prompt, new, tok)
        del sp, model
        gc.collect()
        torch.cuda.empty_cache()

    log("[2] random-weight 8B-shaped Llama: CUDA graph vs eager")
    shape = dict(layers=4, hidden=1024, heads=8, kv_heads=2, inter=2048, vocab=32000) if args.quick else {}
    model = random_llama(**shape)
    sp = transform(model, budget=budget, head="quest")
    ok &= graph_vs_eager(sp, "llama-8b-shape", batch, prompt, new)
    log(f"  elapsed {time.perf_counter() - t_start:.0f} s")

    log("[3] decode ms/step vs HBM floor")
    bw = copy_bandwidth(DEV)
    weight_bytes = step_weight_bytes(model)  # every weight but the input embedding (one row per token)
    info = sp.info
    dense = with_head(sp, "dense")
    rows = []
    contexts = [int(c) for c in args.contexts.split(",")] if not args.quick else [1024, 2048]
    tb = args.timing_batch
    for ctx in contexts:
        kv_all = 2 * info.num_layers * tb * info.num_kv_heads * ctx * info.head_dim * 2
        sel = min(budget, ctx)
        kv_sparse = 2 * info.num_layers * tb * info.num_kv_heads * sel * info.head_dim * 2
        retrieval = 2 * info.num_layers * tb * info.num_kv_heads * (ctx // 16) * info.head_dim * 2
        for label, fn, read in (
                ("sparse quest B=%d" % budget, lambda: time_runtime(sp, tb, ctx, args.steps), kv_sparse + retrieval),
                ("dense (runtime)", lambda: time_runtime(dense, tb, ctx, args.steps), kv_all),
                ("HF generate sdpa", lambda: time_hf(model, tb, ctx, args.steps), kv_all)):
            try:
                ms = fn()
            except torch.cuda.OutOfMemoryError:
                ms = float("nan")
            gc.collect()
            torch.cuda.empty_cache()
            floor = 1000 * (weight_bytes + read) / bw
            rows.append({"context": ctx, "batch": tb, "mode": label, "ms_per_step": round(ms, 3),
                         "floor_ms": round(floor, 3), "x_floor": round(ms / floor, 2),
                         "bytes_read_GB": round((weight_bytes + read) / 1e9, 2)})
            log(f"  ctx {ctx:6d} {label:22s} {ms:8.2f} ms/step  floor {floor:7.2f} ms  ({ms / floor:.2f}x)  "
                f"[{time.perf_counter() - t_start:.0f} s]")
    log(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; weights read per step {weight_bytes / 1e9:.2f} GB\n")
    table, out = save_rows(rows, "specontext_gpu_check.csv")
    log(table)
    log(f"\nwrote {out}; total {time.perf_counter() - t_start:.0f} s")
    log("SPECONTEXT GPU CHECK " + ("OK" if ok else "FAILED (graph != eager)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
