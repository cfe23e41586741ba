"""A GRPO-style policy-gradient step on SmolLM2-135M with DualKV packed batches, checked against the unpacked path.

For each prompt, sample a group of G responses; reward them; advantages are group-normalised
(``A_i = (r_i - mean_g) / (std_g + eps)``, GRPO); the loss is token-level (every response token weighted equally:
``-Σ_i Σ_t A_i log π(y_it) / Σ_i |y_i|``). The packed batch ``[P][R_1]..[R_G]`` (DualKV, arXiv 2605.15422) goes
through the model's own forward after ``kvt.integrations.transformers.enable(model, "dualkv")``; each step also
runs the unpacked path (every response as ``prompt + response`` in one right-padded batch, plain SDPA) and prints
the loss and gradient differences before the optimiser steps on the packed gradients.

    python examples/grpo_step.py [--steps 3] [--group 4] [--max-new-tokens 24]
"""
from __future__ import annotations

import argparse
import math
import time

import torch

import kvtransform as kvt
from kvtransform.verify import replicated_logprobs

PROMPTS = ["Write one sentence about the sea:", "List three colours of the rainbow:"]


def sample_groups(model, tok, prompts, group: int, max_new_tokens: int, gen: torch.Generator):
    """``[(prompt ids (P,), [response ids (R_i,) x group])]``: responses cut after the first EOS."""
    groups = []
    for text in prompts:
        p = tok(text, return_tensors="pt")["input_ids"]
        torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
        with torch.no_grad():
            out = model.generate(p, do_sample=True, top_p=0.95, max_new_tokens=max_new_tokens,
                                 num_return_sequences=group, pad_token_id=tok.eos_token_id)
        rs = []
        for row in out[:, p.shape[1]:]:
            eos = (row == tok.eos_token_id).nonzero()
            rs.append(row[: int(eos[0]) + 1] if len(eos) else row)
        groups.append((p[0], rs))
    return groups


def reward(tok, response: torch.Tensor) -> float:
    """Toy reward: close to 12 words, ends with a full stop."""
    text = tok.decode(response, skip_special_tokens=True).strip()
    return -abs(len(text.split()) - 12) / 12 + (1.0 if text.endswith(".") else 0.0)


def group_advantages(rewards: list[list[float]]) -> torch.Tensor:
    """GRPO advantages, normalised within each prompt's group (``kvtransform.distributed.group_advantages``: zeros
    for a group of one response or of equal rewards); flat ``(N,)`` in packing order."""
    from kvtransform.distributed import group_advantages as normalised

    return torch.cat([normalised(torch.tensor(r, dtype=torch.float32)) for r in rewards])


def worse(a: float, b: float) -> float:
    """The larger of two errors; NaN wins (a NaN step is a mismatch, never hidden by a later finite one)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def token_level_loss(logprobs: list[torch.Tensor], adv: torch.Tensor) -> torch.Tensor:
    n_tok = sum(lp.numel() for lp in logprobs)
    return -sum(a * lp.sum() for a, lp in zip(adv, logprobs)) / n_tok


def grads_of(model, loss) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(loss, params, allow_unused=True), params)]


def add_threads_option(ap: argparse.ArgumentParser) -> None:
    """``--threads auto|N`` (``kvtransform generate``'s rule: auto is 1 thread on a CPU-only machine of at most 4
    cores, where more OpenMP threads spin on the sampling loop's small ops, 4-6x slower on 2 cores)."""
    ap.add_argument("--threads", default="auto", type=lambda s: s if s == "auto" else int(s),
                    help="torch CPU threads: auto (1 on a small CPU-only machine) or N")


def set_threads(threads) -> None:
    from kvtransform.cli.generate import check_threads, choose_threads

    check_threads(threads)  # one line naming the range (torch.set_num_threads(0) is a traceback)
    torch.set_num_threads(choose_threads(threads)[0])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group", type=int, default=4, help="responses sampled per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    add_threads_option(ap)
    args = ap.parse_args(argv)
    if args.group < 1 or args.steps < 1 or args.max_new_tokens < 1:
        ap.error("--group, --steps and --max-new-tokens must be >= 1")
    set_threads(args.threads)
    t_start = time.perf_counter()
    model, tok = kvt.load_model("smollm2-135m")
    kvt.integrations.transformers.enable(model, "dualkv")  # calls without a layout (generate) still run SDPA
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)
    worst = {"loss_rel": 0.0, "grad_rel": 0.0}
    for step in range(args.steps):
        model.eval()  # sampling
        groups = sample_groups(model, tok, PROMPTS, args.group, args.max_new_tokens, gen)
        rewards = [[reward(tok, r) for r in rs] for _, rs in groups]
        adv = group_advantages(rewards)
        batch = kvt.pack_shared_prefix_groups(groups)
        model.train()  # SmolLM2 has no dropout: train() changes nothing numerically

        t0 = time.perf_counter()
        logits = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                       segment_prefix=batch.segment_prefix, use_cache=False).logits
        lps = batch.response_logprobs(logits)
        loss = token_level_loss(lps, adv)
        g_packed = grads_of(model, loss)
        t1 = time.perf_counter()
        loss_ref = token_level_loss(replicated_logprobs(model, batch, padded=True), adv)
        g_ref = grads_of(model, loss_ref)
        t2 = time.perf_counter()

        d2 = sum(float(((a - b).double() ** 2).sum()) for a, b in zip(g_packed, g_ref))
        r2 = sum(float((b.double() ** 2).sum()) for b in g_ref)
        grad_rel = math.sqrt(d2 / r2) if r2 > 0 else math.sqrt(d2)  # (all advantages 0: both gradients are 0)
        # relative to the loss's own scale Σ|A_i log π| / n (the group-normalised loss itself can be ~0)
        scale = float(token_level_loss([lp.detach().abs() for lp in lps], adv.abs()).abs())
        loss_rel = abs(float(loss.detach()) - float(loss_ref.detach())) / max(scale, 1e-12)
        worst = {"loss_rel": worse(worst["loss_rel"], loss_rel), "grad_rel": worse(worst["grad_rel"], grad_rel)}
        print(f"step {step}: {batch.num_responses} responses, {batch.num_tokens} packed tokens vs "
              f"{batch.replicated_tokens} replicated (ρ={batch.token_ratio:.2f}); mean reward "
              f"{sum(map(sum, rewards)) / batch.num_responses:+.3f}")
        print(f"  loss packed {loss.item():+.6f}  unpacked {loss_ref.item():+.6f}  (diff / loss scale {loss_rel:.2e}); "
              f"gradients ‖g_packed − g_unpacked‖/‖g_unpacked‖ = {grad_rel:.2e}; fwd+bwd packed {t1 - t0:.2f} s, "
              f"unpacked (padded) {t2 - t1:.2f} s" + (" (step 0 includes the packed path's one-time setup)"
                                                     if step == 0 else ""))
        for p, g in zip((p for p in model.parameters() if p.requires_grad), g_packed):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    total = time.perf_counter() - t_start
    ok = worst["loss_rel"] < 1e-4 and worst["grad_rel"] < 1e-4
    print(f"{'OK' if ok else 'MISMATCH'}: packed == unpacked within 1e-4 over {args.steps} steps (worst loss rel "
          f"{worst['loss_rel']:.1e}, gradient rel {worst['grad_rel']:.1e}); total {total:.1f} s")
    if not ok:
        raise SystemExit(1)
    return {**worst, "total_s": total}


if __name__ == "__main__":
    main()
