"""Prefix-tree batches through the two frontends, exact against the unpacked model.

``kvt.transform(model, "dualkv")`` (its prefix-tree program, ``passes/prefix_tree.py``) and
``kvt.integrations.transformers.enable(model, "dualkv")`` (``prefix_tree_layout=``): every trajectory's log-probs and
every parameter gradient of a loss over trajectories (advantages, loss masks) obey the numerics rule against the
original model run on each trajectory separately (and as one padded batch), float64 reference
(:func:`kvtransform.verify.check_numerics_rule`). Fast tests on a tiny random Llama (both frontends); the ``slow`` one
on SmolLM2-135M through the transform (the suite's time budget keeps the real-model HF-integration run out).
"""
from __future__ import annotations

import os

import pytest
import torch

import kvtransform as kvt
from kvtransform.config import DualKVConfig
from kvtransform.integrations.transformers import packed_inputs
from kvtransform.models import tiny_model
from kvtransform.report import Report
from kvtransform.transforms.dualkv import DualKVModule
from kvtransform.verify import VerificationError, check_numerics_rule, verify_packed

# A tree: [(node length, [children])]; trajectories are the root->leaf paths. Loss masks: odd depths (assistant
# turns) on, even depths (system/task prompt, user or tool turns) off.
CASES = {
    "depth2+depth3": ([(11, [(7, []), (9, [])]), (9, [(5, [(3, []), (7, [])]), (9, [])])], 3, 2),
    "depth4": ([(9, [(5, [(5, [(3, []), (5, [])]), (3, [])]), (7, [])])], 4, 1),
    "disjoint": ([(19, []), (17, [])], 1, 2),
    "chain": ([(23, [])], 1, 1),
    # trees of depth 2, 3 and 4 and a trajectory sharing nothing, all in one batch (the real-model case)
    "depths2-4+unshared": ([(11, [(7, []), (9, [])]), (9, [(5, [(3, []), (7, [])]), (9, [])]),
                            (9, [(5, [(5, [(3, []), (5, [])]), (3, [])]), (7, [])]), (19, [])], 4, 4),
}


def build_tree(spec, piece):
    """``(trajectories, loss masks)`` for a tree spec; ``piece(n)`` gives n token ids. Siblings start with different
    tokens, so the packed trie has exactly the spec's shape."""
    seqs, masks = [], []

    def walk(nodes, prefix, mask, depth):
        firsts = set()
        for n, kids in nodes:
            ids = piece(n)
            while int(ids[0]) in firsts:
                ids = piece(n)
            firsts.add(int(ids[0]))
            here = torch.cat([prefix, ids])
            m = torch.cat([mask, torch.full((n,), depth % 2 == 1)])
            if kids:
                walk(kids, here, m, depth + 1)
            else:
                seqs.append(here)
                masks.append(m)

    walk(spec, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool), 0)
    return seqs, masks


def case_batch(name, piece):
    spec, depth, trees = CASES[name]
    seqs, masks = build_tree(spec, piece)
    batch = kvt.pack_trajectories(seqs, loss_masks=masks)
    assert (batch.layout.depth, batch.layout.num_trees) == (depth, trees)
    return batch


# On SmolLM2 each check costs ~8 s fixed (float64 copy, 272 gradients in float64 for four runs) plus ~2.3 s per
# trajectory on one core: one batch holds every depth and an unshared trajectory (a one-node tree); the separate
# cases run on the tiny model.
SLOW_CASES = ["depths2-4+unshared"]


def hf_logits(model):
    return lambda b: model(**packed_inputs(b)).logits


# ------------------------------------------------------------------------------------------------ tiny Llama (fast)
@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama")
    return model, kvt.transform(model, "dualkv", progress=False)   # the gate checks both programs


def _rand_piece(vocab):
    return lambda n: torch.randint(0, vocab, (n,))


def test_transform_has_a_verified_tree_program(tiny):
    model, opt = tiny
    n_layers = model.config.num_hidden_layers
    rec = opt.report.pass_record("prefix_tree")
    assert rec.matched == rec.rewritten == n_layers and not rec.skipped
    tree_ops = [n.target for n in opt.tree_core.graph.nodes if n.op == "call_function"]
    assert tree_ops.count(torch.ops.kvt.prefix_tree_attention.default) == n_layers
    assert torch.ops.kvt.dualkv_attention.default not in tree_ops
    one_level = [n.target for n in opt.core.gm.graph.nodes if n.op == "call_function"]   # unchanged
    assert one_level.count(torch.ops.kvt.dualkv_attention.default) == n_layers
    assert torch.ops.kvt.prefix_tree_attention.default not in one_level
    assert [s.status for s in opt.report.sites] == ["dualkv"] * n_layers
    names = [c["name"] for c in opt.report.verification.cases]
    assert "tree logprobs" in names and opt.report.verification.passed
    mp = {id(p) for p in model.parameters()}
    assert all(id(p) in mp for p in opt.tree_core.parameters())


@pytest.mark.parametrize("frontend", ["transform", "hf"])
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_tree_equals_separate_runs(tiny, frontend, case):
    model, opt = tiny
    if frontend == "hf":
        model = tiny_model("llama")
        run = hf_logits(kvt.integrations.transformers.enable(model, "dualkv"))
    else:
        run = opt
    batch = case_batch(case, _rand_piece(model.config.vocab_size))
    res = check_numerics_rule(model, run, batch, floor=1e-5)
    assert res["passed"], [r for r in res["rows"] if not r[1] <= r[3]][:5]


def test_module_input_forms_and_errors(tiny):
    model, opt = tiny
    batch = case_batch("depth4", _rand_piece(128))
    ref = opt(batch)
    assert ref.shape == (1, batch.num_tokens, 128)
    assert torch.equal(ref, opt(batch.input_ids, batch.layout))
    assert torch.equal(ref, opt(input_ids=batch.input_ids[0], layout=batch.layout, position_ids=batch.position_ids))
    assert torch.equal(ref, opt(**packed_inputs(batch)))   # the HF frontend's keywords: the same call
    with pytest.raises(ValueError, match="use_cache=True: a packed call has no KV cache"):
        opt(**{**packed_inputs(batch), "use_cache": True})
    with pytest.raises(ValueError, match=r"it takes no attention_mask=, labels= \(those are for a Hugging Face"):
        opt(**{**packed_inputs(batch), "attention_mask": torch.ones_like(batch.input_ids)}, labels=batch.input_ids)
    assert torch.equal(ref, opt(**{**packed_inputs(batch), "attention_mask": None}))  # no mask: as packed_inputs
    with pytest.raises(ValueError, match="pass the layout once"):
        opt(batch.input_ids, batch.layout, prefix_tree_layout=batch.layout, position_ids=batch.position_ids)
    with pytest.raises(ValueError, match="position_ids do not match the layout"):
        opt(batch.input_ids, batch.layout, position_ids=torch.arange(batch.num_tokens))
    with pytest.raises(ValueError, match="layout mismatch"):
        opt(batch.input_ids[:, :-1], batch.layout)
    with pytest.raises(ValueError, match="not both"):
        opt(batch, batch.layout)
    with pytest.raises(ValueError, match="DualKVLayout or a PrefixTreeLayout"):
        opt(batch.input_ids, layout=batch.layout.lengths)


def test_hf_refusals_are_named():
    model = kvt.integrations.transformers.enable(tiny_model("llama"), "dualkv")
    batch = case_batch("depth2+depth3", _rand_piece(128))
    one = kvt.pack_shared_prefix([1, 2, 3], [[4, 5], [6]])
    with pytest.raises(ValueError, match="not both"):
        model(**packed_inputs(batch), cu_seqlens=one.cu_seqlens, segment_prefix=one.segment_prefix)
    with pytest.raises(ValueError, match="must be a PrefixTreeLayout"):
        model(batch.input_ids, position_ids=batch.position_ids, prefix_tree_layout=batch.layout.kernel_tensors())
    past = model(batch.input_ids[:, :3], use_cache=True).past_key_values   # no layout: SDPA, fills a cache
    with pytest.raises(ValueError, match="without a KV cache"):
        model(batch.input_ids, position_ids=batch.position_ids + 3, prefix_tree_layout=batch.layout,
              past_key_values=past, use_cache=True)
    with pytest.raises(ValueError, match="PackedBatch .* or a TreeBatch"):
        packed_inputs(batch.input_ids)
    for drop in (lambda kw: kw.pop("prefix_tree_layout"), lambda kw: kw.update(prefix_tree_layout=None)):
        kw = packed_inputs(batch)   # the layout dropped, the mask marker kept: named, not the stock model's error
        drop(kw)
        with pytest.raises(ValueError, match=r"attention_mask but not its layout .* pass all of model\(\*\*packed"):
            model(**kw)
    with pytest.raises(ValueError, match="cu_seqlens and segment_prefix must be int32 tensors .* got list"):
        model(**{**packed_inputs(one), "cu_seqlens": one.cu_seqlens.tolist()})
    model = kvt.integrations.transformers.enable(tiny_model("llama", attention_dropout=0.1), "dualkv").train()
    with pytest.raises(ValueError, match="attention dropout"):
        model(**packed_inputs(batch))


def test_one_level_tree_runs_the_dualkv_program(tiny):
    """A tree one level deep (prompts and their responses) runs the DualKV program in both frontends, with the
    same logits as the same batch packed by pack_shared_prefix_groups; the tree program is not called."""
    model, opt = tiny
    piece = _rand_piece(model.config.vocab_size)
    p1, p2 = [4] + piece(8).tolist(), [5] + piece(5).tolist()
    r = [piece(n).tolist() for n in (4, 7, 5)]
    groups = [(p1, [[1] + r[0], [2] + r[1]]), (p2, [[3] + r[2]])]   # distinct first tokens: a clean one-level trie
    tree = kvt.pack_trajectories([p + x for p, xs in groups for x in xs])
    assert tree.layout.as_dualkv() is not None and tree.layout.depth == 2
    packed = kvt.pack_shared_prefix_groups(groups)
    opt.__dict__["_tree_core_saved"], opt.__dict__["_tree_core"] = opt.__dict__["_tree_core"], _Boom()
    try:
        with torch.no_grad():
            assert torch.allclose(opt(tree), opt(packed), atol=1e-5, rtol=0)  # a lone trajectory is one segment
    finally:
        opt.__dict__["_tree_core"] = opt.__dict__.pop("_tree_core_saved")
    hf = kvt.integrations.transformers.enable(tiny_model("llama"), "dualkv")
    calls = []
    real = torch.ops.kvt.prefix_tree_attention
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        import kvtransform.ops.prefix_tree as opmod

        mp.setattr(opmod, "prefix_tree_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        hf(tree.input_ids, position_ids=tree.position_ids, prefix_tree_layout=tree.layout, use_cache=False)
    assert calls == []


@pytest.mark.parametrize("frontend", ["transform", "hf"])
@pytest.mark.parametrize("shape", ["one level", "deep"])
def test_a_batch_scored_under_inference_mode_still_trains(tiny, frontend, shape):
    """Old-policy / reference log-probs under torch.inference_mode(), then the policy's with grad on the same batch
    (a GRPO step): the batch's cached indices and one-level layout are normal tensors, so the second pass can be
    saved for backward (they were inference tensors: "Inference tensors cannot be saved for backward")."""
    model, opt = tiny
    run = opt if frontend == "transform" else hf_logits(
        kvt.integrations.transformers.enable(tiny_model("llama"), "dualkv"))
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3, 7]] if shape == "one level" else \
        [[1, 2, 3, 4, 8], [1, 2, 3, 4, 9], [1, 2, 5]]
    batch = kvt.pack_trajectories(seqs)
    with torch.inference_mode():
        old = [x.clone() for x in batch.trajectory_logprobs(run(batch))]
    new = batch.trajectory_logprobs(run(batch))
    sum(x.sum() for x in new).backward()
    assert all(torch.allclose(a, b.detach(), atol=1e-6) for a, b in zip(old, new))


@pytest.mark.parametrize("frontend", ["transform", "hf"])
@pytest.mark.parametrize("packing", ["tree", "one level", "shared prefix"])
def test_a_batch_packed_under_inference_mode_trains(tiny, frontend, packing):
    """Batches packed during a rollout (under torch.inference_mode()) and trained on afterwards: the packers and
    layout constructors return normal tensors, so ids, positions and layout can be saved for backward (they were
    inference tensors: "Inference tensors cannot be saved for backward"). Same log-probs as a batch packed outside."""
    model, opt = tiny
    run = opt if frontend == "transform" else hf_logits(
        kvt.integrations.transformers.enable(tiny_model("llama"), "dualkv"))

    def pack():
        if packing == "shared prefix":
            return kvt.pack_shared_prefix(torch.tensor([1, 2, 3]), [torch.tensor([4, 5]), torch.tensor([6])])
        return kvt.pack_trajectories([[1, 2, 3, 4, 8], [1, 2, 3, 4, 9], [1, 2, 5]] if packing == "tree" else
                                     [[1, 2, 3, 4], [1, 2, 3, 5, 6]])

    def logprobs(batch):
        out = run(batch)
        return batch.response_logprobs(out) if packing == "shared prefix" else batch.trajectory_logprobs(out)

    with torch.inference_mode():
        batch = pack()
    assert not any(t.is_inference() for t in (batch.input_ids, batch.position_ids, batch.layout.cu_seqlens))
    got = logprobs(batch)
    sum(x.sum() for x in got).backward()
    want = logprobs(pack())
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA and compiled kernels: TRITON_INTERPRET=0 python -m pytest -m gpu")
def test_a_batch_moved_to_the_gpu_under_inference_mode_trains():
    """``batch.to("cuda")`` inside torch.inference_mode() (a rollout worker moving its batches) gives normal tensors
    (they were inference tensors, which the backward cannot save), and the moved batch trains."""
    model = kvt.integrations.transformers.enable(tiny_model("llama"), "dualkv").cuda()
    tree = kvt.pack_trajectories([[1, 2, 3, 4, 8], [1, 2, 3, 4, 9], [1, 2, 5]])
    one = kvt.pack_shared_prefix(torch.tensor([1, 2, 3]), [torch.tensor([4, 5]), torch.tensor([6])])
    with torch.inference_mode():
        moved = [tree.to("cuda"), one.to("cuda")]
    for batch in moved:
        tensors = [batch.input_ids, batch.position_ids, batch.layout.cu_seqlens]
        assert all(t.is_cuda and not t.is_inference() for t in tensors)
        out = model(**packed_inputs(batch)).logits
        lps = batch.trajectory_logprobs(out) if batch is moved[0] else batch.response_logprobs(out)
        sum(x.sum() for x in lps).backward()


def test_layouts_built_under_inference_mode_are_saved_for_backward():
    """The ops save the layout for backward: layouts built under inference mode (from lengths, parents or an
    inference-mode tensor) hold normal int32 tensors; int64 offsets given to the DualKVLayout constructor are
    stored as int32."""
    with torch.inference_mode():
        tree = kvt.PrefixTreeLayout.from_parents([3, 2], [-1, 0])
        one = kvt.DualKVLayout.from_lengths([(3, [2])])
        cu, sp = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([-1, 0], dtype=torch.int32)
    from_inference = kvt.DualKVLayout.from_tensors(cu, sp)
    direct = kvt.DualKVLayout(torch.tensor([0, 3, 5]), torch.tensor([-1, 0]))
    assert direct.cu_seqlens.dtype == direct.segment_prefix.dtype == torch.int32
    direct.validate(5)
    for layout, op in ((tree, kvt.prefix_tree_attention), (one, kvt.dualkv_attention),
                       (from_inference, kvt.dualkv_attention), (direct, kvt.dualkv_attention)):
        q = torch.randn(5, 4, 8, requires_grad=True)
        op(q, torch.randn(5, 2, 8), torch.randn(5, 2, 8), layout).sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


class _Boom(torch.nn.Module):
    def forward(self, *args):
        raise AssertionError("the tree program ran on a one-level tree")


def test_tree_program_is_not_a_second_owner_of_the_parameters(tiny):
    """parameters()/state_dict() (and so FSDP2's fully_shard) see each parameter once: the tree program shares
    core's parameters without being a registered submodule."""
    _, opt = tiny
    assert opt.tree_core is not None
    names = [n for n, _ in opt.named_parameters(remove_duplicate=False)]
    assert names and not any(n.startswith("tree_core") for n in names)
    assert len({id(p) for p in opt.parameters()}) == len(names)
    assert not any(k.startswith("tree_core") for k in opt.state_dict())


def test_saved_artifact_runs_tree_batches(tiny, tmp_path):
    """The artifact holds the one-level program; a loaded module derives the tree program on its first tree batch."""
    _, opt = tiny
    opt.save(tmp_path / "a")
    opt2 = kvt.load(tmp_path / "a")
    assert isinstance(opt2, DualKVModule) and opt2.__dict__.get("_tree_core") is None
    batch = case_batch("depth2+depth3", _rand_piece(128))
    assert torch.allclose(opt(batch), opt2(batch), atol=1e-6, rtol=0)
    one = kvt.pack_shared_prefix([1, 2, 3], [[4, 5], [6]])
    assert torch.allclose(opt(one), opt2(one), atol=1e-6, rtol=0)


def test_gate_refuses_a_wrong_tree_program(tiny):
    """The one-level program is right, the tree program lets siblings see each other: the gate refuses it."""
    model, opt = tiny

    class Leaky(torch.nn.Module):  # plain causal attention over the whole packed axis
        def forward(self, input_ids, position_ids, *layout):
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         attention_mask=torch.ones_like(input_ids)).logits

    bad = DualKVModule(opt.core, DualKVConfig(), Report(), tree_core=Leaky())
    with pytest.raises(VerificationError, match="tree"):
        verify_packed(model, bad, DualKVConfig(), None, Report(), progress=False)


# ------------------------------------------------------------------------------------------------ SmolLM2 (slow)
@pytest.fixture(scope="module")
def smollm2(smollm2_dualkv):
    model, tok, _ = smollm2_dualkv
    from kvtransform.verify import text_token_ids

    ids = text_token_ids(tok, model.config.vocab_size, 600)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))

    def piece(n):
        s = int(torch.randint(0, ids.numel() - n, (1,), generator=gen))
        return ids[s:s + n]

    return model, piece, gen


def _check_real(model, run, batch, gen):
    """The numerics rule with test_dualkv_transform.py::test_exact_real_smollm2's floor (1e-4 of max|x64|; its
    docstring says why: fp32 rounding through 30 layers scatters the original's and our per-tensor errors alike)."""
    adv = torch.randn(batch.num_trajectories, generator=gen)
    res = check_numerics_rule(model, run, batch, adv, floor=1e-4)
    assert res["passed"], [r for r in res["rows"] if not r[1] <= r[3]][:5]
    assert res["rows"][0][0] == "logprobs" and res["rows"][0][1] < 1e-5, res["rows"][0]
    assert res["grad_global_rel_opt"] <= 2 * res["grad_global_rel_original"] + 1e-5, res["worst"]


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-dualkv")  # the worker that transformed SmolLM2 for test_dualkv_transform.py
@pytest.mark.parametrize("case", SLOW_CASES)
def test_real_smollm2_transform(smollm2, smollm2_dualkv, case):
    """The transform's prefix-tree program (conftest's ``smollm2_dualkv``: its gate checked both programs; the rule
    below is stricter)."""
    model, piece, gen = smollm2
    _check_real(model, smollm2_dualkv[2], case_batch(case, piece), gen)

