"""DualKV transform on a Qwen3-shaped random model (DualKV, arXiv 2605.15422): gradients and time vs the original.

Builds a randomly initialised Qwen3 causal LM with Qwen3-8B layer shapes (hidden 4096, 32 query / 8 KV heads,
head_dim 128, MLP 12288, vocab 151936) and ``--layers`` layers in bf16, transforms it with ``kvt.transform(model,
"dualkv")`` and runs one GRPO-like batch: one prompt of ``--prompt`` tokens, ``--responses`` responses with lengths
``R_i ~ U(--rmin, --rmax)`` (seed 42), random tokens, random advantages, loss ``Σ_i adv_i · Σ_j logprob_ij``.

Checks (the numerics rule of the kernel tests): against an fp32 reference (the same weights in fp32, the original model on
the N separate sequences), the packed bf16 module's max error on the per-response log-probs and on *every* parameter
gradient is at most 2× the original bf16 model's own error (N separate sequences, the flash path) plus an absolute
floor of ``1e-3 · max|ref|`` (bf16 has 8 mantissa bits: 2^-8 ≈ 3.9e-3).

Times forward+backward (``kvtransform.bench.timing.time_steps``: CUDA events, warm-up, median) of: the packed module; the original on the N separate
sequences (one call per response); the original on one right-padded ``(N, P + max R)`` batch with an attention mask.

Run it on a GPU after changing the DualKV transform, its passes or kernels: it is the model-level check that the
packed module's gradients obey the numerics rule (the kernel tests cover the op alone). From the repository root (on
a GPU machine without network access, ``tools/device_env.sh`` installs the checkout first)::

    source tools/device_env.sh && python3 tools/dualkv_model_check.py --out $OUT
    python tools/dualkv_model_check.py --small          # CPU smoke test with tiny shapes
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch


def build_model(layers: int, small: bool, dtype, device):
    import transformers

    if small:
        kw = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                  vocab_size=512)
    else:  # Qwen3-8B layer shapes
        kw = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  intermediate_size=12288, vocab_size=151936)
    cfg = transformers.Qwen3Config(num_hidden_layers=layers, max_position_embeddings=40960, rope_theta=1e6,
                                   tie_word_embeddings=False, rms_norm_eps=1e-6, **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(cfg)
    return model.to(dtype).eval()


def cuda_time(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of ``fn`` (the benchmarks' one timing loop: CUDA events on GPU, perf_counter on CPU)."""
    from kvtransform.bench.timing import percentile, time_steps

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return percentile([sum(t) for t in time_steps(lambda mark: fn(), dev, warmup, reps)], 50)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--responses", type=int, default=8)
    ap.add_argument("--rmin", type=int, default=128)
    ap.add_argument("--rmax", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke test")
    ap.add_argument("--out", default=None, help="directory for dualkv_model_check.json / .md")
    args = ap.parse_args(argv)
    if args.small:
        args.prompt, args.rmin, args.rmax, args.reps = min(args.prompt, 24), 4, 12, 1

    import kvtransform as kvt
    from kvtransform.config import DualKVConfig, VerifyConfig
    from kvtransform.verify import replicated_logprobs, trainable_parameters as _params
    from kvtransform.bench import git_commit

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    t_start = time.perf_counter()
    model = build_model(args.layers, args.small, dtype, dev)
    vocab = model.config.vocab_size

    # ---- transform (gate on a small real-shaped batch; bf16 tolerance) ---------------------------------------------
    t0 = time.perf_counter()
    cfg = DualKVConfig(verify_groups=[[37, [16, 5, 23]], [9, [7]]])
    gate = "passed"
    try:
        opt = kvt.transform(model, cfg, progress=False)
    except Exception as e:  # keep measuring; the failure is reported
        gate = f"FAILED: {type(e).__name__}: {str(e)[:300]}"
        opt = kvt.transform(model, DualKVConfig(verify=VerifyConfig(enabled=False)), progress=False)
    t_transform = time.perf_counter() - t0
    print(f"[{time.perf_counter() - t_start:.0f}s] transformed ({t_transform:.1f} s), gate {gate}", flush=True)
    ver = opt.report.verification

    # ---- GRPO-like batch -----------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(42)
    rl = torch.randint(args.rmin, args.rmax + 1, (args.responses,), generator=g).tolist()
    prompt = torch.randint(0, vocab, (args.prompt,), generator=g)
    responses = [torch.randint(0, vocab, (r,), generator=g) for r in rl]
    batch = kvt.pack_shared_prefix(prompt, responses, vocab_size=vocab, device=dev)
    adv = torch.randn(args.responses, generator=g).to(dev)
    params = _params(model)
    ps = [p for _, p in params]

    def loss_of(lps):
        return sum(adv[i].float() * lp.float().sum() for i, lp in enumerate(lps))

    def grads(lps, plist):
        return [x.detach().float() for x in torch.autograd.grad(loss_of(lps), plist, allow_unused=False)]

    lp_packed = batch.response_logprobs(opt(batch))
    g_packed = grads(lp_packed, ps)
    lp_packed = [x.detach().float() for x in lp_packed]
    lp_orig = replicated_logprobs(model, batch)
    g_orig = grads(lp_orig, ps)
    lp_orig = [x.detach().float() for x in lp_orig]

    # fp32 reference: same weights in fp32, original model, N separate sequences
    ref = copy.deepcopy(model).float()
    ref_ps = [p for _, p in _params(ref)]
    lp_ref = replicated_logprobs(ref, batch)
    g_ref = grads(lp_ref, ref_ps)
    lp_ref = [x.detach().float() for x in lp_ref]
    del ref, ref_ps
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    print(f"[{time.perf_counter() - t_start:.0f}s] gradients computed (packed, original bf16, fp32 reference)",
          flush=True)
    rows, worst = [], {"ratio": 0.0}
    n_fail = 0
    for (name, _), a, b, r in zip(params, g_packed, g_orig, g_ref):
        scale = float(r.abs().max())
        e_p = float((a - r).abs().max())
        e_o = float((b - r).abs().max())
        floor = 1e-3 * scale
        ok = e_p <= 2 * e_o + floor
        n_fail += not ok
        ratio = e_p / max(e_o, 1e-30)
        rows.append({"param": name, "err_packed": e_p, "err_orig": e_o, "max_ref": scale, "ok": ok})
        if ratio > worst["ratio"]:
            worst = {"ratio": ratio, "param": name, "err_packed": e_p, "err_orig": e_o, "max_ref": scale}
    lpp, lpo, lpr = torch.cat(lp_packed), torch.cat(lp_orig), torch.cat(lp_ref)
    lp_ep, lp_eo = float((lpp - lpr).abs().max()), float((lpo - lpr).abs().max())
    lp_ok = lp_ep <= 2 * lp_eo + 1e-3 * float(lpr.abs().max())
    gp_all = torch.sqrt(sum(((a - r) ** 2).sum() for a, r in zip(g_packed, g_ref)))
    go_all = torch.sqrt(sum(((b - r) ** 2).sum() for b, r in zip(g_orig, g_ref)))
    r_all = torch.sqrt(sum((r ** 2).sum() for r in g_ref))
    del g_packed, g_orig, g_ref

    # ---- timing ----------------------------------------------------------------------------------------------------
    def packed_step():
        torch.autograd.grad(loss_of(batch.response_logprobs(opt(batch))), ps)

    def separate_step():
        torch.autograd.grad(loss_of(replicated_logprobs(model, batch)), ps)

    def padded_step():
        torch.autograd.grad(loss_of(replicated_logprobs(model, batch, padded=True)), ps)

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_packed = cuda_time(packed_step, 2, args.reps)
    mem_packed = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_sep = cuda_time(separate_step, 1, args.reps)
    mem_sep = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_pad = cuda_time(padded_step, 1, args.reps)
    mem_pad = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0

    commit = git_commit()
    res = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "commit": commit, "date": time.strftime("%Y-%m-%d"),
        "model": f"Qwen3 random, {args.layers} layers, hidden {model.config.hidden_size}, heads "
                 f"{model.config.num_attention_heads}/{model.config.num_key_value_heads}, head_dim "
                 f"{model.config.head_dim}, vocab {vocab}, bf16",
        "P": args.prompt, "N": args.responses, "R": rl, "T_packed": batch.num_tokens,
        "T_replicated": batch.replicated_tokens, "T_padded": args.responses * (args.prompt + max(rl)),
        "rho": batch.token_ratio, "rho_padded": args.responses * (args.prompt + max(rl)) / batch.num_tokens,
        "gate": gate, "gate_max_rel_error": ver.max_rel_error, "gate_cases": ver.cases,
        "transform_s": t_transform,
        "logprobs": {"err_packed": lp_ep, "err_orig_bf16": lp_eo, "ok": lp_ok},
        "grads": {"num_params": len(rows), "num_fail": n_fail, "worst_ratio": worst,
                  "global_rel_packed": float(gp_all / r_all), "global_rel_orig_bf16": float(go_all / r_all)},
        "fwd_bwd_ms": {"packed_dualkv": t_packed, "original_separate": t_sep, "original_padded": t_pad},
        "peak_mem_gib": {"packed_dualkv": mem_packed, "original_separate": mem_sep, "original_padded": mem_pad},
        "speedup_vs_separate": t_sep / t_packed, "speedup_vs_padded": t_pad / t_packed,
        "wall_s": time.perf_counter() - t_start,
        "command": "source tools/device_env.sh && python3 tools/dualkv_model_check.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
    }
    ok = lp_ok and n_fail == 0 and gate == "passed"
    res["passed"] = ok
    text = json.dumps(res, indent=2)
    print(text)
    md = (f"| {res['date']} | {commit} | {res['device']} | L={args.layers} P={args.prompt} N={args.responses} "
          f"R~U({args.rmin},{args.rmax}) T={batch.num_tokens} ρ={res['rho']:.2f} | {t_packed:.1f} | {t_sep:.1f} | "
          f"{t_pad:.1f} | {mem_packed:.1f} / {mem_sep:.1f} / {mem_pad:.1f} | "
          f"{len(rows) - n_fail}/{len(rows)} (worst {worst['ratio']:.2f}×) | {res['grads']['global_rel_packed']:.2e} / "
          f"{res['grads']['global_rel_orig_bf16']:.2e} |")
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dualkv_model_check.json").write_text(text)
        (out / "dualkv_model_check.md").write_text(md + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
