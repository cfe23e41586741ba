"""A complete GRPO run with TRL on SmolLM2-135M on a CPU: the stock ``trl.GRPOTrainer`` against
``kvtransform.integrations.trl.GRPOTrainer`` (shared-prefix log-prob passes + SpeContext rollouts), per-step times.

    python examples/trl_grpo.py                       # 3 steps each: stock, then ours; a table of per-step times
    python examples/trl_grpo.py --check               # plus one step on fixed completions: shared_prefix vs stock
    python examples/trl_grpo.py --setups stock,packed,ours --steps 2 --completion 64 --budget 64

Prompts are passages of real English (Python's own documentation, ``pydoc_data/topics.py``), the reward is how
much of the passage's true continuation a completion's words cover (a small, real-text reward). Per step it prints
the rollout time, the log-prob passes outside the loss (old policy / reference: TRL's ``_get_per_token_logps...``
under ``no_grad``), the update (the rest of the step: the policy's log-prob pass, loss, backward, optimizer) and
TRL's own metrics (reward; for ours the importance-sampling ratios of the rollout/training mismatch correction).
``--check`` runs one step on the same fixed completions with the stock trainer, ours (``shared_prefix=True``) and
the stock trainer in float64, and prints the largest loss / log-prob / gradient differences and the numerics rule
(``err(ours) <= 2 err(stock) + 1e-4`` against float64, as ``kvtransform.verify.check_numerics_rule``; TRL's fused LM
head works in float32 even for a float64 model). ``docs/TRL.md`` explains the options and what was measured: on a
CPU the ops run their plain-PyTorch references, so ours is not faster there by design; the speedups are a GPU
matter (``examples/trl_grpo_h200.py``). On a quiet 2-core CPU the defaults take ~100 s (185 s at a load average of 2-3); under more load, minutes (2 steps
each with ``--check``: ~22 min at a load average of ~10).
"""
from __future__ import annotations

import argparse
import copy
import re
import statistics
import time
from collections import defaultdict

import torch


def passages(n: int, prompt_chars: int = 240, ref_chars: int = 320) -> list:
    """``n`` (prompt, reference continuation) pairs of prose from ``pydoc_data/topics.py``."""
    from kvtransform.textdata import read_text

    out = []
    for para in re.split(r"\n\s*\n", read_text("pydoc_data/topics.py")):
        text = " ".join(para.split())
        letters = sum(c.isalpha() or c == " " for c in text)
        if len(text) < prompt_chars + ref_chars or letters < 0.9 * len(text):
            continue
        cut = text.rfind(" ", 0, prompt_chars)
        out.append((text[:cut], text[cut:cut + ref_chars]))
        if len(out) == n:
            break
    return out


def _words(s: str) -> set:
    return {w for w in re.findall(r"[a-z]+", s.lower()) if len(w) > 2}


def coverage_reward(completions, reference, **kw):
    """Fraction of the reference continuation's words (3+ letters) a completion uses, minus its repeated words."""
    out = []
    for c, ref in zip(completions, reference):
        words = re.findall(r"[a-z]+", c.lower())
        rep = 1 - len(set(words)) / max(1, len(words))
        out.append(len(_words(c) & _words(ref)) / max(1, len(_words(ref))) - 0.2 * rep)
    return out


class StepTimer:
    """Per optimizer step: rollout seconds (``_generate_single_turn``), log-prob passes outside the loss (calls of
    ``_get_per_token_logps_and_entropies`` without grad) and the whole step (``training_step``)."""

    def __init__(self, trainer):
        self.rows, self.cur = [], defaultdict(float)
        for name, key in (("_generate_single_turn", "rollout"), ("_get_per_token_logps_and_entropies", "logprob"),
                          ("training_step", "step")):
            self._wrap(trainer, name, key)

    def _wrap(self, trainer, name, key):
        fn = getattr(trainer, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if key != "logprob" or not torch.is_grad_enabled():
                    self.cur[key] += time.perf_counter() - t
                if key == "step":
                    c = self.cur
                    self.rows.append({"rollout": c["rollout"], "logprob": c["logprob"],
                                      "update": c["step"] - c["rollout"] - c["logprob"]})
                    self.cur = defaultdict(float)

        setattr(trainer, name, timed)


def make_trainer(setup: str, model, tok, data, a, **extra):
    from datasets import Dataset
    import trl

    from kvtransform.integrations.trl import GRPOConfig, GRPOTrainer

    common = dict(output_dir="/tmp/kvt_trl_grpo", per_device_train_batch_size=a.prompts * a.generations,
                  num_generations=a.generations, max_completion_length=a.completion, max_steps=a.steps,
                  learning_rate=a.lr, use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none",
                  logging_steps=1, save_strategy="no", seed=0, temperature=a.temperature, **extra)
    if setup == "stock":
        args, cls = trl.GRPOConfig(**common), trl.GRPOTrainer
    else:
        ours = dict(shared_prefix=True) if setup == "packed" else dict(
            shared_prefix=True, rollout="specontext", rollout_budget=a.budget, rollout_head=a.head,
            vllm_importance_sampling_mode="token_truncate")  # per-token weights: docs/ROLLOUT_MISMATCH.md
        args, cls = GRPOConfig(**common, **ours), GRPOTrainer
    ds = Dataset.from_dict({"prompt": [p for p, _ in data], "reference": [r for _, r in data]})
    return cls(model=model, reward_funcs=coverage_reward, args=args, train_dataset=ds, processing_class=tok)


def run(setup, model, tok, data, a):
    t = time.perf_counter()
    tr = make_trainer(setup, model, tok, data, a)
    build = time.perf_counter() - t
    timer = StepTimer(tr)
    logs = []
    tr.add_callback(_Logs(logs))
    tr.train()
    print(f"\n== {setup}: trainer built in {build:.1f} s")
    print(f"{'step':>4} {'rollout s':>10} {'logprob s':>10} {'update s':>9} {'reward':>8} {'IS ratio mean/min/max':>24}")
    for i, (row, lg) in enumerate(zip(timer.rows, logs)):
        isr = "/".join(f"{lg[k]:.3f}" for k in ("sampling/importance_sampling_ratio/mean",
                                               "sampling/importance_sampling_ratio/min",
                                               "sampling/importance_sampling_ratio/max") if k in lg) or "-"
        print(f"{i + 1:>4} {row['rollout']:>10.2f} {row['logprob']:>10.2f} {row['update']:>9.2f} "
              f"{lg.get('reward', float('nan')):>8.3f} {isr:>24}")
    if any(r["logprob"] > 0 for r in timer.rows):
        print("  (logprob s: the no-grad old-policy pass TRL runs to weigh sampled tokens by the importance-sampling "
              "correction; with HF rollouts and one update per generation the stock trainer skips it)")
    return timer.rows


class _Logs:
    """A TrainerCallback collecting each step's logged metrics."""

    def __new__(cls, store):
        from transformers import TrainerCallback

        class C(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "reward" in logs:
                    store.append(dict(logs))

        return C()


def check(model_path, tok, data, a):
    """One step on fixed completions: stock fp32, ours (shared_prefix) fp32, stock fp64; the differences."""
    def fixed(self, prompt_ids, images, mm, n, has_tool_images=False):
        g = torch.Generator().manual_seed(1)
        text = tok(" ".join(r for _, r in data))["input_ids"]
        out = []
        for i in range(len(prompt_ids)):
            k = int(torch.randint(a.completion // 2, a.completion + 1, (), generator=g))
            s = int(torch.randint(0, len(text) - k, (), generator=g))
            out.append(text[s:s + k] + ([tok.eos_token_id] if i % 2 else []))
        return out, None

    def step(setup, dtype):
        torch.manual_seed(0)
        tr = make_trainer(setup, model_path, tok, data, a, beta=0.05, num_iterations=2,
                          model_init_kwargs={"dtype": dtype})
        tr._generate_single_turn = fixed.__get__(tr)
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1
        inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
        t = time.perf_counter()
        loss = tr.compute_loss(tr.model, inputs)
        loss.backward()
        dt = time.perf_counter() - t
        grads = {n: p.grad.double() for n, p in tr.model.named_parameters() if p.grad is not None}
        return loss.detach().double(), inputs, grads, dt

    runs = {k: step(s, d) for k, s, d in (("stock", "stock", torch.float32), ("ours", "packed", torch.float32),
                                           ("fp64", "stock", torch.float64))}

    def rel(x, r):
        return float((x.double() - r.double()).abs().max() / r.double().abs().max().clamp(min=1e-30))

    o, s, r = runs["ours"], runs["stock"], runs["fp64"]
    print(f"\n== check: one step on fixed completions ({len(o[2])} parameter tensors)")
    print(f"loss: ours {o[0].item():.8f}  stock {s[0].item():.8f}  |diff| {abs(o[0] - s[0]).item():.3e}")
    worst, ok = 0.0, True
    for k in ("old_per_token_logps", "ref_per_token_logps"):
        print(f"{k}: max|ours - stock| {(o[1][k] - s[1][k]).abs().max().item():.3e}  rel err vs fp64: ours "
              f"{rel(o[1][k], r[1][k]):.2e} stock {rel(s[1][k], r[1][k]):.2e}")
        ok &= rel(o[1][k], r[1][k]) <= 2 * rel(s[1][k], r[1][k]) + 1e-4
    for n in o[2]:
        worst = max(worst, (o[2][n] - s[2][n]).abs().max().item())
        ok &= rel(o[2][n], r[2][n]) <= 2 * rel(s[2][n], r[2][n]) + 1e-4
    ok &= rel(o[0], r[0]) <= 2 * rel(s[0], r[0]) + 1e-4
    print(f"gradients: max|ours - stock| {worst:.3e}; numerics rule (2x stock's error vs fp64 + 1e-4): "
          f"{'holds' if ok else 'FAILS'}; loss+backward {o[3]:.2f} s ours vs {s[3]:.2f} s stock")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="stock,ours", help="comma list of stock, packed (shared_prefix only), ours")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--completion", type=int, default=48, help="max_completion_length (tokens)")
    p.add_argument("--budget", type=int, default=64, help="SpeContext rollout budget (tokens per KV head)")
    p.add_argument("--head", default="auto", help="SpeContext retrieval head")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--check", action="store_true", help="also the one-step check against the stock trainer")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import kvtransform as kvt
    from kvtransform.models import cache_dir

    model, tok = kvt.load_model("smollm2-135m")
    data = passages(a.prompts)
    print(f"SmolLM2-135M fp32, {a.prompts} prompts x {a.generations} completions of <= {a.completion} tokens, "
          f"{a.steps} steps, rollout budget {a.budget}; prompt tokens: {[len(tok(q)['input_ids']) for q, _ in data]}")
    ok = check(str(cache_dir() / "smollm2-135m"), tok, data, a) if a.check else True
    rows = {s: run(s, copy.deepcopy(model), tok, data, a) for s in a.setups.split(",")}
    if "stock" in rows and len(rows) > 1:
        print("\nmedian per step (s): " + "; ".join(
            f"{s}: rollout {statistics.median(r['rollout'] for r in v):.2f}, logprob "
            f"{statistics.median(r['logprob'] for r in v):.2f}, update {statistics.median(r['update'] for r in v):.2f}"
            for s, v in rows.items()))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
