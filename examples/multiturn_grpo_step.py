"""One GRPO-style step on multi-turn trajectories packed as a prefix tree, through ``kvt.transform(model, "dualkv")``.

A rollout of an agentic / multi-turn task is a tree: a system prompt and task shared by every trajectory, assistant
turns sampled several ways, a user (or tool) turn after each, and more sampled assistant turns below that. The
trajectories are packed with ``kvt.pack_trajectories`` (every shared prefix stored once, at any depth: Tree
Training, arXiv 2511.00413; DualKV, arXiv 2605.15422, is the one-level case) with loss masks on the assistant turns
only, and run through the transformed module's prefix-tree program. Advantages are group-normalised (GRPO) over the
task's trajectories; the loss is token-level over the masked tokens (``examples/grpo_step.py``'s helpers). The same
step is also run flattened (every trajectory as its own row of a right-padded batch through the original model) to
print the token counts, times and the gradient difference before the optimiser steps on the packed gradients.

    python examples/multiturn_grpo_step.py [--branch 2] [--turn-tokens 12]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import kvtransform as kvt
from kvtransform.verify import replicated_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example also under `python -P` / from elsewhere
from grpo_step import add_threads_option, grads_of, group_advantages, set_threads, token_level_loss  # noqa: E402

SYSTEM_AND_TASK = ("System: You are a careful assistant. Answer in one short sentence.\n"
                   "User: A shop sells apples at 3 coins each. How much do 4 apples cost?\nAssistant:")
FOLLOW_UP = "\nUser: And how much would 7 apples cost?\nAssistant:"


def sample_turns(model, tok, prefix: torch.Tensor, n: int, max_new_tokens: int, seed: int) -> list:
    """``n`` sampled continuations (1-D ids, cut after the first newline or EOS) of ``prefix`` (1-D ids)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prefix[None], do_sample=True, top_p=0.95, max_new_tokens=max_new_tokens,
                             num_return_sequences=n, pad_token_id=tok.eos_token_id)
    stops = {tok.eos_token_id, *tok("\n", add_special_tokens=False)["input_ids"]}
    turns = []
    for row in out[:, prefix.numel():]:
        cut = next((i for i, t in enumerate(row.tolist()) if t in stops), row.numel() - 1)
        turns.append(row[: cut + 1] if cut > 0 else row[:1])
    return turns


def rollout(model, tok, branch: int, turn_tokens: int):
    """Trajectories of a two-turn tree (``branch`` first answers, a follow-up question after each, ``branch``
    second answers below each) and their loss masks (True on assistant tokens)."""
    ids = lambda text: torch.tensor(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    root = ids(SYSTEM_AND_TASK)
    seqs, masks = [], []
    for i, a1 in enumerate(sample_turns(model, tok, root, branch, turn_tokens, seed=1)):
        user = ids(FOLLOW_UP)
        prefix = torch.cat([root, a1, user])
        for a2 in sample_turns(model, tok, prefix, branch, turn_tokens, seed=10 + i):
            seqs.append(torch.cat([prefix, a2]))
            masks.append(torch.cat([torch.full((x.numel(),), assistant) for x, assistant in
                                    ((root, False), (a1, True), (user, False), (a2, True))]))
    return seqs, masks


def reward(tok, seq: torch.Tensor, mask: torch.Tensor) -> float:
    """Toy reward: the assistant turns mention the right totals (12, then 21)."""
    text = tok.decode(seq[mask])
    return float("12" in text) + float("21" in text) - 0.01 * int(mask.sum())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--branch", type=int, default=2, help="samples per assistant turn (trajectories: branch**2)")
    ap.add_argument("--turn-tokens", type=int, default=12, help="max new tokens per assistant turn")
    ap.add_argument("--lr", type=float, default=1e-5)
    add_threads_option(ap)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    t_start = time.perf_counter()
    model, tok = kvt.load_model("smollm2-135m")
    t0 = time.perf_counter()
    opt_module = kvt.transform(model, kvt.DualKVConfig(verify_groups=[[7, [3, 5]]]), tokenizer=tok, progress=False)
    print(f"transform (capture, passes, gate on both programs): {time.perf_counter() - t0:.1f} s")

    model.eval()
    seqs, masks = rollout(model, tok, args.branch, args.turn_tokens)
    batch = kvt.pack_trajectories(seqs, loss_masks=masks)
    adv = group_advantages([[reward(tok, s, m) for s, m in zip(seqs, masks)]])  # one task: one group
    trained = batch.loss_mask_tensors()   # aligned with the log-probs (token t predicted from tokens < t)
    print(f"{batch.num_trajectories} trajectories, tree depth {batch.layout.depth}: {batch.num_tokens} packed tokens "
          f"vs {batch.replicated_tokens} flattened (ratio {batch.token_ratio:.2f}); "
          f"{sum(int(m.sum()) for m in trained)} trained (assistant) tokens")

    model.train()  # SmolLM2 has no dropout: train() changes nothing numerically
    t0 = time.perf_counter()
    lps = batch.trajectory_logprobs(opt_module(batch))
    loss = token_level_loss([lp[m] for lp, m in zip(lps, trained)], adv)
    g_packed = grads_of(model, loss)
    t1 = time.perf_counter()
    ref = replicated_logprobs(model, batch, padded=True)   # the original model, one padded row per trajectory
    loss_ref = token_level_loss([lp[m] for lp, m in zip(ref, trained)], adv)
    g_ref = grads_of(model, loss_ref)
    t2 = time.perf_counter()

    d2 = sum(float(((a - b).double() ** 2).sum()) for a, b in zip(g_packed, g_ref))
    ref2 = sum(float((b.double() ** 2).sum()) for b in g_ref)
    if ref2 == 0:  # every trajectory got the same reward: zero advantages, no learning signal this step
        print("all rewards equal (zero advantages): no gradient this step; compare absolute difference instead")
    grad_rel = math.sqrt(d2 / ref2) if ref2 > 0 else math.sqrt(d2)
    print(f"loss packed {float(loss.detach()):+.6f}  flattened {float(loss_ref.detach()):+.6f}; "
          f"‖g_packed − g_flat‖/‖g_flat‖ = {grad_rel:.2e}")
    print(f"step (fwd+bwd): packed {t1 - t0:.2f} s, flattened (padded) {t2 - t1:.2f} s")
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for p, g in zip((p for p in model.parameters() if p.requires_grad), g_packed):
        p.grad = g
    optim.step()
    total = time.perf_counter() - t_start
    ok = grad_rel < 1e-4
    print(f"{'OK' if ok else 'MISMATCH'}: packed == flattened within 1e-4; total {total:.1f} s")
    if not ok:
        raise SystemExit(1)
    return {"grad_rel": grad_rel, "packed_tokens": batch.num_tokens, "flat_tokens": batch.replicated_tokens,
            "step_s": t1 - t0, "total_s": total}


if __name__ == "__main__":
    main()
