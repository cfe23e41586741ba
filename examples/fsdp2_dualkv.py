"""GRPO-style steps of a DualKV-packed Qwen3-8B-shaped policy under FSDP2, against the padded replicated baseline.

Shared-prefix packed training (DualKV, arXiv 2605.15422): each prompt's N responses are packed ``[P][R_1..R_N]``,
prompt groups are balanced over ranks and micro-batches with ``kvt.balance_groups``, and the DualKV module is sharded
with ``torch.distributed.fsdp.fully_shard`` per decoder layer and at the root (bf16 compute, fp32 master weights and
gradient reduction, activation checkpointing per layer). The loss is GRPO's group-normalised advantage times the
token log-probability, normalised per token over the global batch. The baseline is the same model, sharded the same
way, on the same groups as right-padded ``(N, max_len)`` batches (what a trainer without packing runs).

    # 2 GPUs (H200): 36 layers, random bf16 weights
    torchrun --nproc_per_node=2 examples/fsdp2_dualkv.py
    # gradient check: FSDP step-1 gradients vs a single-GPU run of the same global batch (numerics rule)
    torchrun --nproc_per_node=2 examples/fsdp2_dualkv.py --check-grads --layers 4
    # CPU, gloo, tiny model
    torchrun --nproc_per_node=2 examples/fsdp2_dualkv.py --device cpu --tiny [--check-grads]
    # agentic prefix trees (a shared prompt, then turns branching 2 x 2 x 2): against the flattened padded baseline
    torchrun --nproc_per_node=2 examples/fsdp2_dualkv.py --trees [--fanout 2,2,2] [--check-grads --layers 4]

With ``--trees`` each "group" is a prefix tree (``kvt.bench.tree_shapes.agentic_tree``: a ``--prompt-len`` root,
then ``len(fanout)`` levels of turns of ``[R/4, R]`` tokens; Tree Training, arXiv 2511.00413), balanced whole over
ranks (``kvt.balance_groups(..., trees=True)``), packed with ``kvt.pack_trajectories`` and run through the tree
program over the sharded layers; every token after a trajectory's first is trained. The baseline runs each
trajectory as its own right-padded row.

Printed per method: step time, tokens/s per GPU (tokens the method computes: packed or padded), replicated tokens/s
per GPU (``Σ_i (P + R_i)``, the same work for both methods), MFU = model FLOPs / step time / peak, peak memory.
Model FLOPs: ``6 · matmul params · tokens`` (decoder layers and LM head; the embedding lookup is not a matmul) plus
attention forward+backward on the (query, key) pairs the method computes (``kvtransform.bench.flops``); the
recomputation of activation checkpointing is not counted. Peak: 989 TFLOP/s (H200 SXM bf16 dense, no sparsity).

Numerics rule (--check-grads): for every parameter, ``max|g − g64| / max|g64|`` of the FSDP run is at most 2x that
of the original model run in the compute dtype on one device on the replicated batch, plus a floor (1e-3 for bf16,
1e-5 for fp32; ``g64``: the original model in float64 on the replicated batch).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import kvtransform as kvt
from kvtransform.bench.flops import attention_flops, layer_matmul_params
from kvtransform.distributed import (all_reduce_int, full_gradients, group_advantages, micro_batch_loss,
                                     shard_dualkv, token_level_loss)
from kvtransform.verify import replicated_logprobs

H200_BF16_DENSE_TFLOPS = 989.0

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen3 (hidden 64, 2 layers, vocab 512) for CPU runs")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 36; 4 with --check-grads)")
    ap.add_argument("--steps", type=int, default=3, help="optimiser steps per method (the first is warm-up)")
    ap.add_argument("--groups-per-rank", type=int, default=2, help="prompt groups per rank per step (on average)")
    ap.add_argument("--num-responses", type=int, default=8, help="responses per prompt (GRPO group size)")
    ap.add_argument("--prompt-len", type=int, default=2048, help="longest prompt (tokens; lengths in [P/2, P])")
    ap.add_argument("--response-len", type=int, default=512, help="longest response (tokens; in [R/4, R])")
    ap.add_argument("--max-tokens", type=int, default=8192, help="packed tokens per micro-batch")
    ap.add_argument("--trees", action="store_true", help="agentic prefix trees instead of one-level prompt groups")
    ap.add_argument("--fanout", default="2,2,2", help="--trees: children per node at each turn level")
    ap.add_argument("--no-checkpoint", action="store_true", help="no activation checkpointing")
    ap.add_argument("--no-baseline", action="store_true", help="skip the padded replicated baseline")
    ap.add_argument("--no-verify", action="store_true", help="skip the transform's exactness gate")
    ap.add_argument("--check-grads", action="store_true",
                    help="compare step-1 gradients with a single-device run of the same global batch and exit")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        a.fanout = [int(x) for x in a.fanout.split(",")]
    except ValueError:
        ap.error(f"--fanout must be comma-separated integers, e.g. 2,2,2; got {a.fanout!r}")
    if a.trees and (not a.fanout or min(a.fanout) < 1):
        ap.error(f"--fanout needs at least one level of >= 1 children; got {a.fanout}")
    if a.layers is None:
        a.layers = 4 if a.check_grads else (TINY if a.tiny else QWEN3_8B)["num_hidden_layers"]
    if a.tiny:
        a.prompt_len, a.response_len = min(a.prompt_len, 24), min(a.response_len, 8)
        a.num_responses, a.max_tokens = min(a.num_responses, 4), min(a.max_tokens, 96)
    elif a.check_grads:  # the float64 reference runs on one GPU: keep the batch modest
        a.prompt_len, a.response_len = min(a.prompt_len, 512), min(a.response_len, 128)
        a.num_responses = min(a.num_responses, 4)
    if a.trees:  # a tree is never split: a micro-batch must hold the largest one
        largest, nodes = a.prompt_len, 1
        for f in a.fanout:
            nodes *= f
            largest += nodes * a.response_len
        if a.max_tokens < largest:
            print(f"--max-tokens {a.max_tokens} -> {largest}: the largest possible tree ({a.prompt_len} + turns of "
                  f"<= {a.response_len} tokens, fanout {a.fanout})", flush=True)
            a.max_tokens = largest
    return a


def log(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def build_model(args, device, dtype):
    """A randomly initialised Qwen3 with the 8B (or tiny) shape; every rank gets rank 0's weights."""
    import transformers

    cfg = transformers.Qwen3Config(**{**(TINY if args.tiny else QWEN3_8B), "num_hidden_layers": args.layers})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(cfg).to(dtype)
    if dist.is_initialized():
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, 0)
    return model.eval()


def make_step_trees(args, step, vocab):
    """``--trees``: the global batch of one step (identical on every rank): trees (lists of trajectories), one
    advantage per trajectory."""
    from kvtransform.bench.tree_shapes import agentic_tree, leaves

    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    ws = dist.get_world_size() if dist.is_initialized() else 1
    trees, advs = [], []
    for i in range(args.groups_per_rank * ws):
        p = int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=g))
        lay = agentic_tree(p, args.fanout, (max(1, args.response_len // 4), args.response_len),
                           seed=args.seed * 1000003 + step * 1009 + i)
        ids = torch.randint(3, vocab, (lay.total_tokens,), generator=g)
        trajs = [ids[lay.path_index(n).cpu()] for n in leaves(lay)]
        trees.append(trajs)
        rewards = torch.tensor([float((t % 2 == 0).float().mean()) for t in trajs])
        advs.append(group_advantages(rewards))
    return trees, advs


def pack(items, trees: bool):
    """One micro-batch's groups (``pack_shared_prefix_groups``) or trees (``pack_trajectories``)."""
    if trees:
        return kvt.pack_trajectories([t for tree in items for t in tree])
    return kvt.pack_shared_prefix_groups(items)


def trained_tokens(items, trees: bool) -> int:
    """Tokens the loss trains: response tokens of groups, tokens after the first of every trajectory."""
    if trees:
        return sum(t.numel() - 1 for tree in items for t in tree)
    return sum(r.numel() for _, rs in items for r in rs)


def make_step_groups(args, step, vocab):
    """The global batch of one step (identical on every rank): groups, per-group advantages (``--trees``:
    :func:`make_step_trees`)."""
    if args.trees:
        return make_step_trees(args, step, vocab)
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    ws = dist.get_world_size() if dist.is_initialized() else 1
    groups, advs = [], []
    for _ in range(args.groups_per_rank * ws):
        p = int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,), generator=g))
        rs = [int(r) for r in torch.randint(max(1, args.response_len // 4), args.response_len + 1,
                                            (args.num_responses,), generator=g)]
        responses = [torch.randint(3, vocab, (r,), generator=g) for r in rs]
        groups.append((torch.randint(3, vocab, (p,), generator=g), responses))
        # a synthetic verifiable reward: the share of even token ids in the response
        rewards = torch.tensor([float((r % 2 == 0).float().mean()) for r in responses])
        advs.append(group_advantages(rewards))
    return groups, advs


def model_flops(cfg, tokens: int, pairs: int) -> float:
    per_layer = 6.0 * layer_matmul_params(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.head_dim, cfg.intermediate_size) * tokens
    attn = attention_flops(pairs, cfg.num_attention_heads, cfg.head_dim) + \
        attention_flops(pairs, cfg.num_attention_heads, cfg.head_dim, backward=True)
    return cfg.num_hidden_layers * (per_layer + attn) + 6.0 * cfg.hidden_size * cfg.vocab_size * tokens


def work_of(groups_mb, padded: bool, trees: bool = False):
    """(tokens computed, attention pairs computed, replicated tokens) of one micro-batch (replicated: every
    sequence, or trajectory, on its own)."""
    if not groups_mb:
        return 2, 3, 0
    if trees:
        seqs = [t.numel() for tree in groups_mb for t in tree]
    else:
        seqs = [p.numel() + r.numel() for p, rs in groups_mb for r in rs]
    if padded:
        s = max(seqs)
        return len(seqs) * s, len(seqs) * s * (s + 1) // 2, sum(seqs)
    layout = pack(groups_mb, trees).layout
    return layout.total_tokens, layout.visible_pairs(), sum(seqs)


def padded_loss(model, groups_mb, advs_mb, global_tokens, ws, trees: bool = False):
    if not groups_mb:
        ids = torch.tensor([[1, 2]], device=next(model.parameters()).device)
        return model(input_ids=ids, use_cache=False).logits.float().sum() * 0.0
    batch = pack(groups_mb, trees)
    return token_level_loss(replicated_logprobs(model, batch, padded=True), torch.cat(advs_mb), global_tokens, ws)


def shard_hf_model(model, mesh, mp, checkpoint):
    """The baseline: the Hugging Face model sharded the standard FSDP2 way (per decoder layer, then the root)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    layers = model.model.layers
    for i in range(len(layers)):
        if checkpoint:
            layers[i] = checkpoint_wrapper(layers[i])
        fully_shard(layers[i], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def run_steps(name, module, loss_fn, args, cfg, device, padded, ws, rank, capture_grads=False):
    optim = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.0)
    times, stats = [], []
    grads = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(1, args.steps + 1):
        groups, advs = make_step_groups(args, step, cfg.vocab_size)
        plan = kvt.balance_groups(groups, ws, max_tokens=args.max_tokens, trees=args.trees)
        global_tokens = trained_tokens(groups, args.trees)
        if step == 1:
            log(f"[{name}] step 1 plan: {plan.summary()}")
        tok = pairs = rep = 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for mb in plan.indices[rank]:
            gmb, amb = [groups[i] for i in mb], [advs[i] for i in mb]
            loss = loss_fn(module, gmb, amb, global_tokens, ws, trees=args.trees)
            loss.backward()
            t, p, r = work_of(gmb, padded, args.trees)
            tok, pairs, rep = tok + t, pairs + p, rep + r
        if capture_grads and step == 1:
            grads = {k: v.float().cpu() for k, v in full_gradients(module).items()}
            return grads, plan
        optim.step()
        optim.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
        stats.append((all_reduce_int(tok), all_reduce_int(pairs), all_reduce_int(rep)))
        log(f"[{name}] step {step}: {times[-1]:.3f} s, loss(last micro-batch, rank 0) {float(loss.detach()):.4f}")
    keep = slice(1, None) if len(times) > 1 else slice(0, None)
    t = sum(times[keep]) / len(times[keep])
    tok, pairs, rep = (sum(s[i] for s in stats[keep]) / len(stats[keep]) for i in range(3))
    flops = model_flops(cfg, int(tok), int(pairs))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    res = dict(method=name, step_s=t, tokens_per_gpu_s=tok / ws / t, replicated_tokens_per_gpu_s=rep / ws / t,
               mfu=flops / ws / t / (H200_BF16_DENSE_TFLOPS * 1e12), peak_gib=peak, tokens=tok, rep=rep)
    del optim
    return res, None


def check_grads(args, device, ws, rank, mesh, mp):
    """FSDP step-1 gradients vs the single-device original model (compute dtype and float64), numerics rule."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args, device, dtype)
    snapshot = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if rank == 0 else None
    cfg = model.config
    opt = kvt.transform(model, kvt.DualKVConfig(verify=kvt.VerifyConfig(enabled=not args.no_verify)),
                        progress=False)
    del model
    shard_dualkv(opt, mesh, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                 master_dtype=torch.float32, checkpoint=not args.no_checkpoint)
    grads, _ = run_steps("dualkv+fsdp2", opt, micro_batch_loss, args, cfg, device, False, ws, rank,
                         capture_grads=True)
    del opt
    gc.collect()
    ok = torch.tensor([1], device=device)
    if rank == 0:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        groups, advs = make_step_groups(args, 1, cfg.vocab_size)
        batch = pack(groups, args.trees)
        global_tokens = trained_tokens(groups, args.trees)
        ref = {}
        for tag, dt in (("orig", dtype), ("fp64", torch.float64)):
            import transformers

            with torch.device(device):
                m = transformers.Qwen3ForCausalLM(cfg).to(dt)
            m.load_state_dict({k: v.to(dt) for k, v in snapshot.items()})
            loss = token_level_loss(replicated_logprobs(m, batch, padded=True), torch.cat(advs), global_tokens, 1)
            names, params = zip(*m.named_parameters())
            ref[tag] = {n: g.double().cpu() for n, g in zip(names, torch.autograd.grad(loss, params))}
            del m, loss
            gc.collect()
        floor = 1e-3 if dtype == torch.bfloat16 else 1e-5
        rows, failed = [], 0
        for n, g64 in ref["fp64"].items():
            scale = float(g64.abs().max()) or 1.0
            ours = float((grads[n].double() - g64).abs().max()) / scale
            orig = float((ref["orig"][n] - g64).abs().max()) / scale
            limit = 2 * orig + floor
            rows.append((n, ours, orig, limit, ours <= limit))
            failed += ours > limit
        print(f"\ngradient check ({'bf16 compute, fp32 master/reduce' if dtype == torch.bfloat16 else 'fp32'}; "
              f"{ws} ranks vs one device; {len(rows)} parameters; error = max|g - g64| / max|g64|; "
              f"limit = 2 x original + {floor:g})")
        print(f"{'parameter':58s} {'fsdp2+dualkv':>12s} {'original':>10s} {'limit':>10s}  result")
        for n, ours, orig, limit, p in sorted(rows, key=lambda r: -r[1] / r[3])[:12]:  # the closest to the limit
            print(f"{n:58s} {ours:12.3e} {orig:10.3e} {limit:10.3e}  {'pass' if p else 'FAIL'}")
        if len(rows) > 12:
            print(f"... {len(rows) - 12} more, further below their limits")
        print(f"gradient check: {'PASS' if failed == 0 else 'FAIL'} ({len(rows) - failed}/{len(rows)} parameters "
              f"within the numerics rule)", flush=True)
        ok[0] = int(failed == 0)
    dist.broadcast(ok, 0)
    return bool(ok[0])


def main(argv=None):
    args = parse_args(argv)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda but no GPU is visible; use --device cpu --tiny")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // ws))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh(device.type, (ws,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else \
        MixedPrecisionPolicy()
    log(f"fsdp2_dualkv: {ws} ranks ({device.type}), {'tiny' if args.tiny else 'Qwen3-8B-shaped'} model, "
        f"{args.layers} layers, torch {torch.__version__}")
    try:
        if args.check_grads:
            ok = check_grads(args, device, ws, rank, mesh, mp)
            return 0 if ok else 1
        dtype = torch.bfloat16 if cuda else torch.float32
        results = []
        t0 = time.perf_counter()
        model = build_model(args, device, dtype)
        cfg = model.config
        nparams = sum(p.numel() for p in model.parameters())
        log(f"model: {nparams / 1e9:.3g} B parameters, built in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        opt = kvt.transform(model, kvt.DualKVConfig(verify=kvt.VerifyConfig(enabled=not args.no_verify)),
                            progress=False)
        log(f"dualkv transform (capture, passes, exactness gate): {time.perf_counter() - t0:.1f} s; "
            f"verification {opt.report.verification.passed if opt.report.verification else 'off'}")
        del model
        shard_dualkv(opt, mesh, param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype,
                     master_dtype=torch.float32, checkpoint=not args.no_checkpoint)
        gc.collect()
        res, _ = run_steps("dualkv+fsdp2", opt, micro_batch_loss, args, cfg, device, False, ws, rank)
        results.append(res)
        del opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if not args.no_baseline:
            base = build_model(args, device, dtype)
            with torch.no_grad():
                for p in base.parameters():
                    p.data = p.data.float()
            shard_hf_model(base, mesh, mp, not args.no_checkpoint)
            res, _ = run_steps("padded+fsdp2", base, padded_loss, args, cfg, device, True, ws, rank)
            results.append(res)
            del base
        log(f"\n{'method':14s} {'step s':>8s} {'tok/s/GPU':>11s} {'repl tok/s/GPU':>15s} {'MFU':>7s} "
            f"{'peak GiB':>9s} {'tokens/step':>12s}")
        gpu = device.type == "cuda"  # (on a CPU the MFU against an H200 and the CUDA peak memory mean nothing: "-")
        for r in results:
            mfu, peak = (f"{100 * r['mfu']:6.1f}%", f"{r['peak_gib']:9.1f}") if gpu else (f"{'-':>7s}", f"{'-':>9s}")
            log(f"{r['method']:14s} {r['step_s']:8.3f} {r['tokens_per_gpu_s']:11.0f} "
                f"{r['replicated_tokens_per_gpu_s']:15.0f} {mfu} {peak} {int(r['tokens']):12d}")
        if len(results) == 2:
            log(f"speed-up (same global batch, step time): {results[1]['step_s'] / results[0]['step_s']:.2f}x"
                + (f"; MFU against {H200_BF16_DENSE_TFLOPS:g} TFLOP/s (H200 bf16 dense)" if gpu else ""))
        return 0
    finally:
        # Leave together: a rank that exits while another still runs (rank 0's single-device reference) can take
        # the process group's transport down under it (seen on gloo as an abort at exit).
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    rc = main()
    # Skip the interpreter's teardown: with the gloo group already destroyed, a rank sometimes still aborted at
    # exit ("terminate called without an active exception", SIGABRT, after a passing gradient check; seen once in a
    # CI-like run on 2 CPU cores) from a native thread destroyed during static destruction. Everything is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc or 0)
