"""FSDP2 training of the DualKV module: the per-layer split computes exactly what the flat graph computes, and one
step on two gloo processes (fully_shard per decoder layer + root, activation checkpointing, balanced groups in
micro-batches) gives the loss and every parameter gradient of the single-process run on the same global batch."""
import math
import time

import pytest
import torch

import kvtransform as kvt
from kvtransform.distributed import (full_gradients, micro_batch_loss, original_parameter_name, shard_dualkv,
                                     split_decoder_layers, token_level_loss)

VOCAB = 128


def _groups(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(2, 12, (1,), generator=g))
        rs = [int(r) for r in torch.randint(1, 9, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)]
        out.append((torch.randint(3, VOCAB, (p,), generator=g), [torch.randint(3, VOCAB, (r,), generator=g)
                                                                for r in rs]))
    return out


@pytest.fixture(scope="module")
def tiny_opt():
    model = kvt.tiny_model("qwen3", num_hidden_layers=3)
    return model, kvt.transform(model, "dualkv")


def test_split_is_exact_and_keeps_parameters(tiny_opt):
    model, opt = tiny_opt
    batch = kvt.pack_shared_prefix_groups(_groups(int(torch.randint(0, 1 << 30, (1,)))))
    params = [p for _, p in model.named_parameters()]
    ref = opt(batch)
    g_ref = torch.autograd.grad(ref.square().sum(), params)
    split = split_decoder_layers(opt.core.gm)
    assert len(split.layers) == 3 and isinstance(split.layers, torch.nn.ModuleList)
    # each layer holds its own weights, the very Parameter objects of the model, under the model's names
    names = {n for n, _ in split.layers[1].named_parameters()}
    assert names == {n for n, _ in model.named_parameters() if n.startswith("model.layers.1.")}
    assert {id(p) for p in split.parameters()} == {id(p) for p in params}
    assert {original_parameter_name("core.gm." + n) for n, _ in split.named_parameters()} == \
        {n for n, _ in model.named_parameters()}
    out = split(batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.segment_prefix)
    assert torch.equal(out, ref)
    g = torch.autograd.grad(out.square().sum(), params)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))


def test_shard_dualkv_errors(tiny_opt):
    model, opt = tiny_opt
    with pytest.raises(ValueError, match="needs the module returned by kvt.transform"):
        shard_dualkv(model)
    with pytest.raises(ValueError, match=r"captured in torch.float32.*model.to\(torch.bfloat16\) before kvt.transform"):
        shard_dualkv(opt, mesh=object(), param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"compute in torch.float64 but the graph was captured in torch.float32"):
        shard_dualkv(opt, mesh=object(), master_dtype=torch.float64)
    # advantages are checked per group / tree (the right total alone would put them on the wrong sequences)
    t = torch.tensor
    for items, adv, kw in (([[t([5, 6, 7]), t([5, 6, 8])], [t([9, 10, 11])]], [torch.ones(1), torch.ones(2)],
                            dict(trees=True)),
                           ([(t([5, 6]), [t([7]), t([8])])], [t(1.0)], {})):
        with pytest.raises(ValueError, match=r"(tree|group) 0 has 2 .* pass a 1-D tensor of 2 values") as e:
            micro_batch_loss(opt, items, adv, 10, 1, **kw)
        assert "\n" not in str(e.value)


def _worker(rank, world_size, opt, groups, plan, adv, global_tokens, store, out, trees=False):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        shard_dualkv(opt, checkpoint=True)
        assert len(opt.core.gm.layers) == 3 and all(type(m).__name__.startswith("FSDP") for m in opt.core.gm.layers)
        for write, path in ((opt.save, store.parent / f"artifact{rank}"), (opt.export_onnx, store.parent / "m.onnx")):
            try:  # a shard is a slice of every weight: refused in one line, nothing written (raw torch errors before)
                write(path)
                raise AssertionError(f"{write.__name__} of a sharded module was accepted")
            except ValueError as e:
                assert "is sharded (shard_dualkv: FSDP2)" in str(e) and not path.exists(), e
        loss_sum = torch.zeros(())
        for mb in plan.indices[rank]:  # gradient accumulation over this rank's micro-batches (some may be empty)
            loss = micro_batch_loss(opt, [groups[i] for i in mb], [adv[i] for i in mb], global_tokens, world_size,
                                    trees=trees)
            loss.backward()
            loss_sum += loss.detach()
        grads = full_gradients(opt)
        dist.all_reduce(loss_sum)
        if rank == 0:
            torch.save({"loss": float(loss_sum) / world_size, "grads": grads}, out)
    finally:
        dist.destroy_process_group()



def _two_ranks(tmp_path, opt, groups, plan, adv, global_tokens, trees=False) -> dict:
    """Run :func:`_worker` on two forked gloo ranks; rank 0's ``{"loss", "grads"}``."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    # fork: the children inherit the transformed module (no re-import, no re-capture); each shards its own copy
    ctx = mp.start_processes(_worker, args=(2, opt, groups, plan, adv, global_tokens, tmp_path / "store", out, trees),
                             nprocs=2, join=False, start_method="fork")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two FSDP2 ranks did not finish within 120 s")
    return torch.load(out)


def _assert_equals_one_process(res: dict, loss: torch.Tensor, model, adv: list) -> tuple:
    """The two ranks' loss and every parameter gradient equal the one-process ``loss``'s (relative error <= 1e-5);
    returns (worst relative gradient error, the one-process gradients).

    The loss is a mean of signed advantage x log-prob terms, so its total can cancel to near zero while fp32
    summation order still errs relative to the terms' size: the loss's error is measured against that size
    (mean |advantage| x ln(VOCAB), the log-prob scale of a random model), not against the total."""
    params = dict(model.named_parameters())
    g_ref = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    term_scale = float(torch.cat([a.reshape(-1) for a in adv]).abs().mean()) * math.log(VOCAB)
    assert abs(res["loss"] - float(loss.detach())) <= 1e-5 * term_scale, (res["loss"], float(loss), term_scale)
    assert set(res["grads"]) == set(g_ref)
    worst = max(float((res["grads"][n] - g).abs().max() / g.abs().max()) for n, g in g_ref.items())
    assert worst <= 1e-5, worst
    return worst, g_ref


def test_fsdp2_two_gloo_ranks_equal_single_process_gradients(tmp_path):
    """fp32 on CPU: loss and every gradient equal the single-process step (relative error <= 1e-5; the two differ
    only in summation order: micro-batches, the gloo reduction, per-rank packing)."""
    t0 = time.perf_counter()
    model = kvt.tiny_model("qwen3", num_hidden_layers=3, seed=int(torch.randint(0, 1000, (1,))))
    opt = kvt.transform(model, "dualkv")
    seed = int(torch.randint(0, 1 << 30, (1,)))
    groups = _groups(seed, n=7)
    adv = [torch.randn(len(rs)) for _, rs in groups]
    sizes = [p.numel() + sum(r.numel() for r in rs) for p, rs in groups]
    plan = kvt.balance_groups(groups, 2, max_tokens=max(max(sizes), sum(sizes) // 4))
    assert plan.num_micro_batches >= 2
    # rank 1's last micro-batch moves to rank 0's new last one: rank 1 then runs fillers while rank 0 computes
    plan.indices[0].append(plan.indices[1][-1])
    plan.indices[1][-1:] = [[], []]
    global_tokens = sum(r.numel() for _, rs in groups for r in rs)
    res = _two_ranks(tmp_path, opt, groups, plan, adv, global_tokens)

    batch = kvt.pack_shared_prefix_groups(groups)  # the global batch in one process, no sharding
    loss = token_level_loss(batch.response_logprobs(opt(batch)), torch.cat(adv), global_tokens, 1)
    worst, g_ref = _assert_equals_one_process(res, loss, model, adv)
    print(f"fsdp2 gloo x2: loss {res['loss']:.6f} vs {float(loss.detach()):.6f}, worst per-parameter relative gradient "
          f"error {worst:.2e} over {len(g_ref)} parameters, {plan.num_micro_batches} micro-batches/rank, "
          f"{time.perf_counter() - t0:.1f} s")


def _trees(seed, n=6):
    """``n`` prefix trees of 1-4 trajectories: a root prompt, then branches at random depths (up to 3 levels)."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, VOCAB, (k,), generator=g).tolist()

    out = []
    for _ in range(n):
        root = ids(int(torch.randint(2, 10, (1,), generator=g)))
        trajs = [root + ids(int(torch.randint(1, 7, (1,), generator=g)))]
        for _ in range(int(torch.randint(0, 4, (1,), generator=g))):
            base = trajs[int(torch.randint(0, len(trajs), (1,), generator=g))]
            cut = int(torch.randint(len(root), len(base) + 1, (1,), generator=g))
            trajs.append(base[:cut] + ids(int(torch.randint(1, 6, (1,), generator=g))))
        out.append([torch.tensor(t) for t in trajs])
    return out


def test_fsdp2_two_gloo_ranks_prefix_trees_equal_single_process_gradients(tmp_path):
    """Prefix-tree batches under ``shard_dualkv``: trees balanced over two gloo ranks by ``kvt.balance_groups(...,
    trees=True)`` (a tree never split), each rank's micro-batches packed with ``kvt.pack_trajectories`` and run
    through the tree program over the sharded layers: loss and every gradient equal the single-process step on all
    trees (relative error <= 1e-5). The tree program used to keep the model's unsharded parameters, so the sharded
    ones got no gradient at all."""
    model = kvt.tiny_model("qwen3", num_hidden_layers=3, seed=int(torch.randint(0, 1000, (1,))))
    opt = kvt.transform(model, "dualkv")
    trees = _trees(int(torch.randint(0, 1 << 30, (1,))))
    adv = [torch.randn(len(t)) for t in trees]
    plan = kvt.balance_groups(trees, 2, max_tokens=max(sum(len(x) for x in t) for t in trees), trees=True)
    global_tokens = sum(len(x) - 1 for t in trees for x in t)
    res = _two_ranks(tmp_path, opt, trees, plan, adv, global_tokens, trees=True)

    loss = micro_batch_loss(opt, trees, adv, global_tokens, 1, trees=True)  # all trees in one process, unsharded
    _assert_equals_one_process(res, loss, model, adv)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--trees"]], ids=["groups", "trees"])
def test_example_check_grads_on_cpu(mode):
    """examples/fsdp2_dualkv.py --device cpu --tiny --check-grads under torchrun (2 gloo ranks) passes its table,
    with prompt groups and with agentic prefix trees (``--trees``)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={29561 + len(mode)}", str(root / "examples" / "fsdp2_dualkv.py"), "--device",
                        "cpu", "--tiny", "--check-grads", *mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "gradient check: PASS" in r.stdout and " nan " not in r.stdout  # (an elided row printed nan once)


def test_advantages_and_loss_refuse_what_would_be_silently_wrong():
    """Equal rewards give 0 advantages at eps=0 too (was NaN); NaN rewards, a negative eps, a global token count below
    this rank's own tokens (an 8x loss), non-integer counts and 2-D advantages are refused in one line."""
    from kvtransform.distributed import group_advantages

    assert group_advantages(torch.tensor([1.0, 1.0, 1.0]), eps=0).tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(group_advantages(torch.tensor([0.0, 2.0]), eps=0), torch.tensor([-0.7071, 0.7071]), atol=1e-4)
    for rewards, eps, msg in ((torch.tensor([1.0, float("nan")]), 1e-6, "rewards must be finite"),
                              (torch.tensor([1.0, 2.0]), -1.0, "eps must be a finite number >= 0")):
        with pytest.raises(ValueError, match=msg):
            group_advantages(rewards, eps=eps)
    lps, adv = [torch.randn(5), torch.randn(3)], torch.tensor([1.0, -1.0])
    assert torch.isfinite(token_level_loss(lps, adv, 8))
    for kw, msg in ((dict(global_tokens=1), "below this rank's own 8 response tokens"),
                    (dict(global_tokens=8.7), "global_tokens must be an integer >= 1"),
                    (dict(global_tokens=8, world_size=1.5), "world_size must be an integer >= 1")):
        with pytest.raises(ValueError, match=msg):
            token_level_loss(lps, adv, **kw)
    with pytest.raises(ValueError, match="advantages must be a 1-D tensor"):
        token_level_loss(lps, adv[None], 8)
    with pytest.raises(ValueError, match="advantages must be finite"):
        token_level_loss(lps, torch.tensor([1.0, float("nan")]), 8)
    with pytest.raises(ValueError, match=r"logprobs\[0\] must be a 1-D tensor .*got \(5, 2\)"):
        token_level_loss([torch.randn(5, 2), torch.randn(3)], adv, 13)
    # NumPy scalars as eps; float64 rewards normalised in float64 (float32 first rounded 1e9 + 1, 2, 3 to equal)
    import numpy as np

    assert group_advantages(torch.tensor([0.0, 2.0]), eps=np.float32(1e-6)).dtype == torch.float32
    big = group_advantages(torch.tensor([1e9 + 1, 1e9 + 2, 1e9 + 3], dtype=torch.float64))
    assert torch.allclose(big, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5)
    with pytest.raises(ValueError, match="rewards must be a non-empty 1-D real tensor"):
        group_advantages(torch.tensor([1 + 1j, 2 + 0j]))


def test_split_names_a_tied_embedding_as_hugging_face_does():
    """A tied embedding / LM head is one Parameter the captured graph may read under the head's name: the split
    (what shard_dualkv runs) names it model.embed_tokens.weight, as the model's named_parameters() does, so
    full_gradients keys it so (it said lm_head.weight)."""
    from kvtransform.distributed import full_gradients

    model = kvt.tiny_model("llama", num_hidden_layers=2, tie_word_embeddings=True)
    opt = kvt.transform(model, "dualkv", progress=False)
    opt.core.gm = split_decoder_layers(opt.core.gm)
    batch = kvt.pack_shared_prefix([5, 6, 7], [[8, 9], [10]])
    sum(lp.sum() for lp in batch.response_logprobs(opt(batch))).backward()
    grads = full_gradients(opt)
    assert set(grads) == {n for n, _ in model.named_parameters()}
    assert torch.equal(grads["model.embed_tokens.weight"], model.model.embed_tokens.weight.grad)
