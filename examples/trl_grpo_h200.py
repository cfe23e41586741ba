"""One GRPO step at an 8B shape on one GPU, split into rollout / log-prob passes / update, for three set-ups timed in
one run through the code paths ``kvtransform.integrations.trl.GRPOTrainer`` calls (TRL itself needs ``datasets`` /
``pyarrow``, which a GPU machine without network may lack; only TRL's fused log-prob kernel is used here, from the
``trl`` wheel installed with ``--no-deps``):

* ``stock``: HF ``generate`` (what TRL's ``_generate_single_turn`` calls), unpacked padded log-prob passes;
* ``dense``: our CUDA-graph dense runtime (``SpeContextConfig(head="dense")``, a vLLM-class decoder), unpacked passes;
* ``ours``: SpeContext rollouts (``rollout_head``, ``rollout_budget``, with per-token sampling log-probs) and packed
  shared-prefix passes (``kvtransform.integrations.trl_packing``, ``kvt.integrations.transformers.enable``).

    python3 -P examples/trl_grpo_h200.py --completion 4096                    # Llama-3-8B shape, random bf16 weights
    python3 -P examples/trl_grpo_h200.py --completion 16384 --layers 8        # a quick try at 16K
    python3 -P examples/trl_grpo_h200.py --completion 16384 --parts rollout --rollout-batch 32   # 32 layers: two
    python3 -P examples/trl_grpo_h200.py --completion 16384 --parts passes    # runs of < 10 minutes each

Rollout (per set-up): one packed/batched prefill of the ``prompts × generations`` prompts, plus ``completion``
decode steps estimated from ``--probe`` timed steps at the mean context (for the runtime: the difference of a
``probe + 4``-token and a 4-token call, so the once-per-call graph capture is counted once, not per step) (prompt + completion / 2), in row chunks of
``--rollout-batch`` (dense decode cost grows linearly with the context, so the mean context gives the integral;
sparse decode is nearly flat): a full 16K generation of 64 rows does not fit a 10-minute command. Log-prob passes:
the old-policy and reference passes (no grad; the reference has the policy's shape, so the policy is run twice).
Update: the policy pass with gradients (gradient checkpointing per layer), a GRPO-like token loss, backward, an SGD
step (AdamW's 8B fp32 states would not fit beside the activations; the step's share is small either way). Log-probs
of every pass go through TRL's ``ChunkedLogProbFunction`` (the kernel of TRL's fused LM head). Prints one table;
``--csv`` writes it.
"""
from __future__ import annotations

import argparse
import time

import torch


def build_model(a):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                      vocab_size=a.vocab, max_position_embeddings=a.prompt + a.completion + a.probe + 64,
                      rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if DEV == "cuda" else torch.float32)
    for p in model.parameters():  # small random weights: a stable softmax without a trained model's scale
        p.data.normal_(0, 0.02)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model.eval()


DEV = "cuda"


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def cuda_time(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t, out


def rollout_hf(model, a, prompts):
    """Seconds of HF ``generate`` over all rows: prefill of the prompts + ``completion`` steps at the mean context."""
    total = 0.0
    mid = a.prompt + a.completion // 2
    for rows in torch.split(prompts, a.rollout_batch):
        ctx = torch.randint(1, a.vocab, (rows.shape[0], mid), device=DEV)
        gen = dict(do_sample=True, temperature=1.0, top_k=0, eos_token_id=None, pad_token_id=0)
        t_pre, _ = cuda_time(lambda: model.generate(rows, max_new_tokens=1, **gen))
        t1, _ = cuda_time(lambda: model.generate(ctx, max_new_tokens=1, **gen))
        tk, _ = cuda_time(lambda: model.generate(ctx, max_new_tokens=a.probe + 1, **gen))
        total += t_pre + a.completion * (tk - t1) / a.probe
        print(f"[stock] {rows.shape[0]} rows: prefill {t_pre:.2f} s, decode step {(tk - t1) / a.probe * 1e3:.2f} ms at "
              f"context {mid}", flush=True)
    return total


def rollout_sp(sp, a, prompts, logprobs: bool):
    """The same for a SpeContext module (its stats separate prefill and decode steps)."""
    total = 0.0
    mid = a.prompt + a.completion // 2
    for rows in torch.split(prompts, a.rollout_batch):
        ctx = torch.randint(1, a.vocab, (rows.shape[0], mid), device=DEV)
        kw = dict(do_sample=True, temperature=1.0, eos_token_id=None, seed=0, return_dict_in_generate=True,
                  output_logprobs=logprobs, progress=False)
        for n in (4, a.probe + 4):  # warm-up at both timed lengths (Triton compiles and autotunes per cache size)
            sp.generate(ctx, max_new_tokens=n, **kw)
        pre = sp.generate(rows, max_new_tokens=1, **kw).stats
        # each generate call captures its CUDA graph and refreshes the fused weights once (≈ 0.5 s at 8B, paid once
        # per rollout of thousands of steps): the difference of two runs is the steady decode step
        short = sp.generate(ctx, max_new_tokens=4, **kw).stats
        st = sp.generate(ctx, max_new_tokens=a.probe + 4, **kw).stats
        step_s = (st.decode_s - short.decode_s) / max(st.decode_steps - short.decode_steps, 1)
        if step_s <= 0:
            raise RuntimeError(f"decode step timed at {step_s * 1e3:.2f} ms: the {a.probe + 4}-token call was not "
                               f"slower than the 4-token one (an uncompiled shape?); raise --probe")
        total += pre.prefill_s + short.decode_s + (a.completion - 4) * step_s
        print(f"[{'ours' if logprobs else 'dense'}] {rows.shape[0]} rows: prefill {pre.prefill_s:.2f} s, decode step "
              f"{step_s * 1e3:.2f} ms at context {mid} (one call's capture + first steps {short.decode_s:.2f} s)",
              flush=True)
    return total


def grpo_batch(a):
    """``(input_ids, attention_mask)`` ``(B, P + C)`` as TRL builds them: ``generations`` copies of each prompt,
    completions of random lengths in [C/2, C] (right padded)."""
    b = a.prompts * a.generations
    prompts = torch.randint(1, a.vocab, (a.prompts, a.prompt), device=DEV).repeat_interleave(a.generations, 0)
    comp = torch.randint(1, a.vocab, (b, a.completion), device=DEV)
    lens = torch.randint(a.completion // 2, a.completion + 1, (b,), device=DEV)
    cmask = (torch.arange(a.completion, device=DEV)[None] < lens[:, None]).long()
    return torch.cat([prompts, comp * cmask], 1), torch.cat([torch.ones_like(prompts), cmask], 1)


def head_logps(model, hidden, labels):
    """Per-position log-probs of ``labels`` (-100: none) with TRL's fused-head kernel (without trl: the same math in
    chunks of 8192 positions, ``log_softmax`` in fp32); ``(1, T)``/``(b, T)``."""
    mask = labels != -100
    w = model.get_output_embeddings().weight
    h, y = hidden[mask], labels[mask]
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        lp = torch.cat([torch.log_softmax((h[i:i + 8192] @ w.T).float(), -1).gather(1, y[i:i + 8192, None])[:, 0]
                        for i in range(0, h.shape[0], 8192)])
    else:
        lp = ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 32768, None, 1.0, ("log_probs",))[0]
    return hidden.new_zeros(mask.shape, dtype=lp.dtype).masked_scatter(mask, lp)


def unpacked_pass(model, ids, mask, c, rows_per_chunk, grad):
    """TRL's pass: padded rows in chunks; returns (B, C) log-probs (with ``grad``: backward of a token loss)."""
    out = []
    for i in range(0, ids.shape[0], rows_per_chunk):
        x, m = ids[i:i + rows_per_chunk], mask[i:i + rows_per_chunk]
        labels = x.masked_fill(m == 0, -100)
        labels[:, :-c] = -100
        with torch.set_grad_enabled(grad):
            h = model.model(input_ids=x, attention_mask=m, use_cache=False).last_hidden_state[:, :-1]
            lp = head_logps(model, h, labels[:, 1:])[:, -c:]
            if grad:
                (-(lp * m[:, -c:]).sum() / m[:, -c:].sum()).backward()
        out.append(lp.detach())
    return torch.cat(out)


def packed_pass(model, ids, mask, c, rows_per_chunk, grad):
    """Ours: the trainer's packing (whole prompt groups per chunk) through the model's own forward."""
    from kvtransform.integrations.transformers import packed_inputs
    from kvtransform.integrations.trl_packing import pack_chunk, plan_packing, scatter_back

    plan, why = plan_packing(ids, mask, c, rows_per_chunk)
    assert plan is not None, why
    vals = []
    for chunk in plan.chunks:
        batch, labels, rows, cols, src = pack_chunk(plan, chunk, ids.device)
        with torch.set_grad_enabled(grad):
            kw = packed_inputs(batch)
            h = model.model(input_ids=kw["input_ids"], position_ids=kw["position_ids"], cu_seqlens=kw["cu_seqlens"],
                            segment_prefix=kw["segment_prefix"], use_cache=False).last_hidden_state
            lp = head_logps(model, h, labels)
            if grad:
                (-lp.sum() / (labels != -100).sum()).backward()
        vals.append((lp.detach(), rows, cols, src))
    return scatter_back(vals, plan, vals[0][0].dtype, ids.device)


def passes(model, a, packed: bool):
    """(log-prob passes s, update s, old-pass log-probs) of one step."""
    ids, mask = grpo_batch(a)
    run = packed_pass if packed else unpacked_pass
    t_lp, lp = cuda_time(lambda: [run(model, ids, mask, a.completion, a.pass_batch, False) for _ in range(2)][0])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()

    def update():
        run(model, ids, mask, a.completion, a.train_batch, True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t_up, _ = cuda_time(update)
    model.eval()
    model.gradient_checkpointing_disable()
    return t_lp, t_up, lp


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="stock,dense,ours")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--completion", type=int, default=4096)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--head", default="self", help="SpeContext head of 'ours' (random weights: a trained head "
                                                  "would not fit them)")
    p.add_argument("--probe", type=int, default=32, help="decode steps timed per row chunk")
    p.add_argument("--rollout-batch", type=int, default=16, help="rows decoded together")
    p.add_argument("--pass-batch", type=int, default=8, help="rows per no-grad log-prob chunk (TRL's batch_size)")
    p.add_argument("--train-batch", type=int, default=8, help="rows per policy micro-batch")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--parts", choices=("all", "rollout", "passes"), default="all",
                   help="time the rollouts only, or the log-prob passes and update only (the two fit separate "
                        "10-minute runs at 32 layers and 16K completions)")
    p.add_argument("--compile", action="store_true", help="dense and ours: the decode programs through "
                   "torch.compile (GRPOConfig.rollout_compile; one compile per cache-length bucket, paid in the "
                   "warm-up)")
    p.add_argument("--csv", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (use tiny sizes)")
    a = p.parse_args()
    global DEV
    DEV = a.device
    import kvtransform as kvt
    from kvtransform.integrations.transformers import disable, enable

    model = build_model(a)
    prompts = torch.randint(1, a.vocab, (a.prompts, a.prompt), device=DEV).repeat_interleave(a.generations, 0)
    rows, lp_ref, unpacked = [], None, None
    nan = float("nan")
    for setup in a.setups.split(","):
        if a.parts == "passes":
            t_roll = nan
        elif setup == "stock":
            t_roll = rollout_hf(model, a, prompts)
        else:
            head = "dense" if setup == "dense" else a.head
            t0 = time.perf_counter()
            sp = kvt.transform(model, kvt.SpeContextConfig(budget=a.budget, head=head, compile=a.compile),
                               progress=False)
            print(f"[{setup}] SpeContext transform (once per training run): {time.perf_counter() - t0:.0f} s",
                  flush=True)
            t_roll = rollout_sp(sp, a, prompts, logprobs=setup == "ours")
            del sp
        packed = setup == "ours"
        if packed:
            enable(model, "dualkv")
        torch.manual_seed(1)  # the same synthetic batch for every set-up
        if a.parts == "rollout":
            t_lp = t_up = nan
            lp = torch.zeros(1)
        elif not packed and unpacked is not None:  # stock and dense run the same unpacked passes: timed once
            t_lp, t_up, lp = unpacked
        else:
            t_lp, t_up, lp = passes(model, a, packed)
            unpacked = unpacked if packed else (t_lp, t_up, lp)
        if packed:
            disable(model)
        if lp_ref is None:
            lp_ref = lp
        diff = float((lp.float() - lp_ref.float()).abs().max())
        rows.append((setup, t_roll, t_lp, t_up, sum(x for x in (t_roll, t_lp, t_up) if x == x), diff))
        print(f"[{setup}] rollout {t_roll:.1f} s, log-prob passes {t_lp:.1f} s, update {t_up:.1f} s; old log-probs "
              f"max|diff| vs {rows[0][0]} {diff:.3g}", flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    base = {r[0]: r for r in rows}.get("dense", rows[0])
    print(f"\n{a.prompts} prompts x {a.generations}, prompt {a.prompt}, completion {a.completion}, "
          f"{a.layers} layers, budget {a.budget} ({a.head}); "
          f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}")
    print(f"{'setup':<6} {'rollout s':>10} {'logprob s':>10} {'update s':>9} {'step s':>8} {'vs ' + base[0]:>9}")
    for r in rows:
        print(f"{r[0]:<6} {r[1]:>10.1f} {r[2]:>10.1f} {r[3]:>9.1f} {r[4]:>8.1f} {base[4] / r[4]:>8.2f}x")
    if a.csv:
        with open(a.csv, "w") as f:
            f.write("setup,rollout_s,logprob_s,update_s,step_s,old_logprob_maxdiff\n")
            f.writelines(",".join(str(x) for x in r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
