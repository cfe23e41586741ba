"""The ``kvtransform optimize transform=dualkv`` demo (a CLI feature, not part of the transform): a real GRPO-like
batch — responses sampled from the model itself — checked for exactness and timed against the padded replicated
batch (DualKV, arXiv 2605.15422). Configured by ``transform.demo.*`` (:class:`kvtransform.config.DualKVDemoConfig`).
"""
from __future__ import annotations

import time

import torch

from kvtransform.config import DualKVConfig
from kvtransform.packing import pack_shared_prefix
from kvtransform.utils import device_of
from kvtransform.verify import check_exactness, replicated_logprobs, sample_text, text_token_ids, \
    trainable_parameters


def _sample_responses(model, tokenizer, prompt: torch.Tensor, n: int, max_new: int, seed: int,
                      temperature: float, min_new: int = 1) -> list:
    """N responses sampled from ``model`` after ``prompt`` (cut after EOS, which is kept)."""
    dev = device_of(model)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos_set = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev]), torch.no_grad():
        torch.manual_seed(seed)
        ids = prompt[None].to(dev)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                             min_new_tokens=max(0, min(min_new, max_new)),
                             num_return_sequences=n, pad_token_id=next(iter(eos_set), 0))
    responses = []
    for row in out[:, prompt.numel():].cpu():
        r = row.tolist()
        cut = next((j + 1 for j, t in enumerate(r) if t in eos_set), len(r))
        responses.append(torch.tensor(r[:cut] or r[:1], dtype=torch.long))
    return responses


def _time_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Median wall seconds of ``fa`` and ``fb``, run alternately (so load from other processes hits both alike)
    after one warm-up each."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fa(), fb()
    ta, tb = [], []
    for _ in range(max(1, repeats)):
        for f, ts in ((fa, ta), (fb, tb)):
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            ts.append(time.perf_counter() - t0)
    return sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2]


def run_demo(model, tokenizer, opt, cfg: DualKVConfig, console=None) -> dict:
    """The ``kvtransform optimize transform=dualkv`` demo: a real GRPO-like batch on this machine.

    A real prompt from the shipped text (``kvtransform/data/prompts.txt``), ``cfg.demo.num_responses`` responses
    sampled from the model itself, random advantages; checks exactness (per-response log-probs and every parameter
    gradient) against the original model on the replicated batch, times forward+backward of the packed module and of
    the original on the right-padded replicated batch, and reports the token ratio ρ = Σ_i(P+R_i)/(P+ΣR).

    Returns:
        dict with ``P``, ``R`` (lengths), ``rho``, ``rho_padded`` (N·(P+max R)/(P+ΣR)), exactness errors,
        ``packed_ms``/``replicated_ms`` (median fwd+bwd), ``speedup``, and the demo's own wall time in seconds:
        ``sample_s`` (sampling the responses), ``check_s`` (exactness check), ``time_s`` (the timed fwd+bwd runs),
        ``demo_s`` (all of it; also ``opt.report.timings["demo"]``).
    """
    t_start = time.perf_counter()
    d = cfg.demo
    vocab = model.config.vocab_size
    lines = [ln for ln in sample_text().splitlines() if ln.strip()]
    if tokenizer is not None:
        line = lines[d.prompt_index % len(lines)]
        prompt = torch.tensor(tokenizer(line, add_special_tokens=False)["input_ids"], dtype=torch.long)
    else:
        prompt = text_token_ids(None, vocab, 48, generator=torch.Generator().manual_seed(d.seed))
    responses = _sample_responses(model, tokenizer, prompt, d.num_responses, d.max_new_tokens, d.seed,
                                  d.temperature, d.min_new_tokens)
    t_sampled = time.perf_counter()
    batch = pack_shared_prefix(prompt, responses, vocab_size=vocab, device=device_of(model))
    adv = torch.randn(len(responses), generator=torch.Generator().manual_seed(d.seed))
    exact = check_exactness(model, opt, batch, adv, backward=True, padded=True)
    t_checked = time.perf_counter()
    dev = device_of(model)
    advd = adv.to(dev)
    ps = [p for _, p in trainable_parameters(model)]

    def packed_step():
        lps = batch.response_logprobs(opt(batch))
        torch.autograd.grad(sum(advd[i] * lp.sum() for i, lp in enumerate(lps)), ps, allow_unused=True)

    def replicated_step():
        lps = replicated_logprobs(model, batch, padded=True)
        torch.autograd.grad(sum(advd[i] * lp.sum() for i, lp in enumerate(lps)), ps, allow_unused=True)

    tp, tr = _time_pair(packed_step, replicated_step, d.repeats)
    t_end = time.perf_counter()
    p, rs = prompt.numel(), batch.response_lengths
    res = dict(P=p, R=rs, N=len(rs), T=batch.num_tokens, rho=batch.token_ratio,
               rho_padded=len(rs) * (p + max(rs)) / batch.num_tokens, **exact,
               packed_ms=1e3 * tp, replicated_ms=1e3 * tr, sample_s=t_sampled - t_start,
               check_s=t_checked - t_sampled, time_s=t_end - t_checked, demo_s=t_end - t_start)
    res["speedup"] = res["replicated_ms"] / res["packed_ms"]
    if console is not None:
        from rich.table import Table

        t = Table(title="DualKV demo: real GRPO-like batch (responses sampled from the model)", title_justify="left")
        t.add_column("")
        t.add_column("value")
        text = tokenizer.decode(prompt) if tokenizer is not None else f"{p} random tokens"
        t.add_row("prompt", (text[:90] + "…") if len(text) > 90 else text)
        t.add_row("P, N, R_i", f"P={p}, N={len(rs)}, R={rs}")
        t.add_row("packed tokens T = P+ΣR", f"{batch.num_tokens}  (replicated {batch.replicated_tokens}, padded "
                                             f"{len(rs) * (p + max(rs))})")
        t.add_row("token ratio ρ = Σ(P+R_i)/(P+ΣR)", f"{res['rho']:.2f}  (vs padded: {res['rho_padded']:.2f})")
        t.add_row("log-prob max rel error", f"{res['logprobs_rel']:.2e} (abs {res['logprobs_abs']:.2e})")
        t.add_row("gradient rel error, all params (L2)", f"{res['grad_global_rel']:.2e}  ({res['num_params']} "
                                                         f"params)")
        t.add_row("gradient rel error, worst param (max)", f"{res['grad_rel']:.2e}  ({res['grad_worst']})")
        t.add_row("fwd+bwd packed (DualKV)", f"{res['packed_ms']:.1f} ms")
        t.add_row("fwd+bwd original, padded replicated", f"{res['replicated_ms']:.1f} ms")
        t.add_row("speedup", f"{res['speedup']:.2f}×  (medians of {d.repeats}, interleaved, {dev})")
        t.add_row("demo wall time", f"{res['demo_s']:.1f} s  (sampling {res['sample_s']:.1f} s, exactness check "
                                    f"{res['check_s']:.1f} s, timed fwd+bwd {res['time_s']:.1f} s)")
        console.print(t)
    opt.report.timings["demo_packed_fwd_bwd_ms"] = round(res["packed_ms"], 2)
    opt.report.timings["demo_replicated_fwd_bwd_ms"] = round(res["replicated_ms"], 2)
    opt.report.timings["demo"] = round(res["demo_s"], 3)
    return res
