"""DualKV transform (arXiv 2605.15422): pass, packing API, exact log-probs and gradients vs the replicated batch.

Exactness: per-response log-probs and the gradient of every parameter of ``Σ_i advantage_i · Σ_j logprob_ij`` from
the transformed module on the packed batch equal those of the *original* model run on the N separate sequences
``prompt + response_i``; random advantages, random real-token responses, several groups of different prompt length.
"""
from __future__ import annotations

import pytest
import torch

import kvtransform as kvt
from kvtransform.config import DualKVConfig, VerifyConfig
from kvtransform.packing import PackedBatch
from kvtransform.transforms.dualkv import DualKVModule
from kvtransform.verify import check_exactness, replicated_logprobs
from kvtransform.models import TINY_FAMILIES, tiny_model

FAST = DualKVConfig(verify=VerifyConfig(enabled=False))


def _rand_groups(vocab, spec, gen=None):
    return [(torch.randint(0, vocab, (p,), generator=gen), [torch.randint(0, vocab, (r,), generator=gen) for r in rs])
            for p, rs in spec]


# ------------------------------------------------------------------------------------------------ packing API
def test_pack_shared_prefix_layout_and_positions():
    b = kvt.pack_shared_prefix([5, 6, 7], [[8, 9], torch.tensor([10]), [11, 12, 13]])
    assert isinstance(b, PackedBatch)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5]]
    assert b.input_ids.dtype == torch.long and b.position_ids.shape == (1, 9)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 6, 9] and b.cu_seqlens.dtype == torch.int32
    assert b.segment_prefix.tolist() == [-1, 0, 0, 0]
    assert b.num_responses == 3 and b.response_lengths == [2, 1, 3]
    assert b.token_ratio == pytest.approx((5 + 4 + 6) / 9)
    b.validate(vocab_size=14)
    with pytest.raises(ValueError, match="token id 13 .* outside the vocabulary"):
        b.validate(vocab_size=13)
    b.position_ids[0, 4] = 7
    with pytest.raises(ValueError, match="position_ids do not match the layout"):
        b.validate()


def test_pack_groups_heterogeneous():
    b = kvt.pack_shared_prefix_groups([([1, 2], [[3], [4, 5]]), (torch.tensor([6, 7, 8]), [torch.tensor([9, 9])])])
    assert b.position_ids.tolist() == [[0, 1, 2, 2, 3, 0, 1, 2, 3, 4]]
    assert b.cu_seqlens.tolist() == [0, 2, 3, 5, 8, 10]
    assert b.segment_prefix.tolist() == [-1, 0, 0, -1, 3]
    assert [s.tolist() for s in b.replicated_sequences()] == [[1, 2, 3], [1, 2, 4, 5], [6, 7, 8, 9, 9]]


def test_response_logprobs_indexing():
    # logits that put all mass where we can read it back: row t predicts token (t * 7) % V
    b = kvt.pack_shared_prefix_groups([([1, 2, 3], [[4, 5], [6]]), ([7], [[8, 9, 10]])])
    t, v = b.num_tokens, 16
    logits = torch.randn(1, t, v, dtype=torch.float64)
    lps = b.response_logprobs(logits)
    assert [x.shape for x in lps] == [(2,), (1,), (3,)]
    ref = torch.log_softmax(logits[0], -1)
    # response 0 of group 0 at [3, 5): first token from row 2 (last prompt), then row 3
    assert torch.allclose(lps[0], torch.stack([ref[2, 4], ref[3, 5]]))
    assert torch.allclose(lps[1], ref[2, 6][None])               # response 1 at [5, 6): row 2 again
    assert torch.allclose(lps[2], torch.stack([ref[6, 8], ref[7, 9], ref[8, 10]]))  # group 1: prompt at 6


@pytest.mark.parametrize("bad, match", [
    (lambda: kvt.pack_shared_prefix([], [[1]]), "prompt is empty"),
    (lambda: kvt.pack_shared_prefix(torch.tensor([], dtype=torch.long), [[1]]), "prompt is empty"),
    (lambda: kvt.pack_shared_prefix([1], [[2], []]), "response 1 is empty"),
    (lambda: kvt.pack_shared_prefix([1], []), "no responses"),
    (lambda: kvt.pack_shared_prefix([1, -3], [[2]]), "id -3"),
    (lambda: kvt.pack_shared_prefix([1, 2], [[2, 99]], vocab_size=50), "id 99.*outside the vocabulary"),
    (lambda: kvt.pack_shared_prefix([1.5], [[2]]), "not an integer"),
    (lambda: kvt.pack_shared_prefix(torch.tensor([1.0]), [[2]]), "integer token ids"),
    (lambda: kvt.pack_shared_prefix(torch.ones(2, 3, dtype=torch.long), [[2]]), "1-D"),
    (lambda: kvt.pack_shared_prefix_groups([]), "non-empty"),
    (lambda: kvt.pack_shared_prefix([True, 2], [[2]]), "element 0 is True, not an integer"),
    (lambda: kvt.pack_shared_prefix(["a"], [[2]]), "element 0 is 'a', not an integer"),
    (lambda: kvt.pack_shared_prefix([torch.tensor(1.0)], [[2]]), "not an integer"),
    (lambda: kvt.pack_shared_prefix([torch.tensor(True)], [[2]]), "not an integer"),
    (lambda: kvt.pack_shared_prefix([1, 2], [[3]], vocab_size=3.5), "vocab_size must be a positive integer"),
    (lambda: kvt.pack_shared_prefix([1, 2], [[3]], vocab_size=-1), "vocab_size must be a positive integer"),
    (lambda: kvt.pack_shared_prefix([1, 2], [[3]], device="meta"), "holds no data"),
    (lambda: kvt.pack_shared_prefix([1, 2], [[3]], device="bogus"), "must be a torch device"),
    (lambda: kvt.pack_shared_prefix([1, 2], [[3]]).to("meta"), "holds no data"),
    (lambda: kvt.pack_trajectories([[1, 2], [1, 3]]).to("meta"), "holds no data"),
    (lambda: kvt.pack_shared_prefix({100, 1, 50}, [[3]]), r"prompt is a set \(unordered\)"),  # was reordered
    (lambda: kvt.pack_shared_prefix({1: 2}, [[3]]), r"prompt is a dict \(unordered\)"),
    (lambda: kvt.pack_shared_prefix([1, 2], {(3,), (4,)}), "responses must be a list of token-id sequences"),
    (lambda: kvt.pack_trajectories([{1, 2, 3}]), r"trajectory 0 is a set \(unordered\)"),
])
def test_pack_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_pack_accepts_numpy_ids():
    np = pytest.importorskip("numpy")
    p, r = torch.tensor([103, 5, 6]), torch.tensor([7, 8])
    b = kvt.pack_shared_prefix(p.numpy(), [r.numpy(), [np.int64(3), np.int32(4)], list(r.numpy()),
                                          r.numpy().astype(np.uint16)])
    assert b.input_ids.tolist() == [[103, 5, 6, 7, 8, 3, 4, 7, 8, 7, 8]] and b.input_ids.dtype == torch.long
    assert b.response_lengths == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="NumPy dtype float64"):
        kvt.pack_shared_prefix(np.array([1.0, 2.0]), [[2]])
    with pytest.raises(ValueError, match="NumPy dtype bool"):
        kvt.pack_shared_prefix(np.array([True]), [[2]])
    with pytest.raises(ValueError, match=r"1-D.*shape \(1, 2\)"):
        kvt.pack_shared_prefix(np.array([[1, 2]]), [[2]])
    with pytest.raises(ValueError, match="not an integer"):
        kvt.pack_shared_prefix([np.float64(1.0)], [[2]])
    with pytest.raises(ValueError, match="not an integer"):
        kvt.pack_shared_prefix([np.bool_(True)], [[2]])
    with pytest.raises(ValueError, match=r"id 99.*outside the vocabulary"):
        kvt.pack_shared_prefix(np.array([1, 99]), [[2]], vocab_size=50)


def test_pack_accepts_response_rows_and_a_generator_of_groups():
    """As pack_trajectories: the rows of a 2-D tensor (as of a 2-D NumPy array) are the responses, and a generator of
    groups is materialised (both were refused)."""
    pytest.importorskip("numpy")
    want = kvt.pack_shared_prefix([1, 2], [[3, 4], [5, 6]]).input_ids
    rows = torch.tensor([[3, 4], [5, 6]])
    for responses in (rows, rows.numpy()):
        assert torch.equal(kvt.pack_shared_prefix([1, 2], responses).input_ids, want)
    got = kvt.pack_shared_prefix_groups(((p, [r]) for p, r in (([1], [2]), ([3], [4, 5]))))
    assert got.input_ids.tolist() == [[1, 2, 3, 4, 5]] and got.response_lengths == [1, 2]


def test_response_logprobs_needs_float_logits():
    b = kvt.pack_shared_prefix([1, 2], [[3, 4]])
    for bad in (torch.zeros(1, 4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.int32),
                torch.zeros(1, 4, 8, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"floating-point tensor.*got dtype"):
            b.response_logprobs(bad)
    for ok in (torch.zeros(1, 4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)):
        assert [x.shape for x in b.response_logprobs(ok)] == [(2,)]


def test_response_logprobs_bad_logits():
    b = kvt.pack_shared_prefix([1, 2], [[3, 4]])
    with pytest.raises(ValueError, match="4 tokens"):
        b.response_logprobs(torch.zeros(1, 5, 8))
    with pytest.raises(ValueError, match="shape"):
        b.response_logprobs(torch.zeros(4))
    with pytest.raises(ValueError, match="vocabulary of 3"):
        b.response_logprobs(torch.zeros(1, 4, 3))


# ------------------------------------------------------------------------------------------------ transform
@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama")
    return model, kvt.transform(model, "dualkv", progress=False)


def test_under_autocast_is_one_line(llama):
    """The captured program runs in the model's dtype: under ``torch.autocast`` it is refused in one line naming
    the two ways (cast the model first, or the HF integration), not a dtype clash inside the op."""
    batch = kvt.pack_shared_prefix(list(range(5, 15)), [[50, 51], [60]])
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"enable\(model, 'dualkv'\)") as e:
        llama[1](batch)
    assert "\n" not in str(e.value)


def test_pass_report_and_parameters(llama):
    model, opt = llama
    assert isinstance(opt, DualKVModule)
    rep = opt.report
    rec = rep.pass_record("dualkv")
    n_layers = model.config.num_hidden_layers
    assert rec.matched == rec.rewritten == n_layers and not rec.skipped
    assert rep.pass_record("cleanup").nodes_removed > n_layers  # the causal-mask construction is gone
    assert "0 (T,T) tensors left" in rec.notes[-1]
    assert [s.status for s in rep.sites] == ["dualkv"] * n_layers
    assert {s.mask_kind for s in rep.sites} == {"causal"}
    targets = [n.target for n in opt.core.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.kvt.dualkv_attention.default) == n_layers
    assert torch.ops.kvt.attention.default not in targets
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    # the module trains the model's own Parameters
    mp = {id(p) for p in model.parameters()}
    assert all(id(p) in mp for p in opt.parameters()) and len(list(opt.parameters())) > 0
    assert rep.verification.passed is True and rep.verification.max_rel_error < 1e-5


def test_optimizer_on_model_parameters_trains_module(llama):
    model, opt = llama
    model = tiny_model("llama")
    opt = kvt.transform(model, FAST, progress=False)
    b = kvt.pack_shared_prefix(torch.randint(0, 128, (9,)), [torch.randint(0, 128, (n,)) for n in (4, 6)])
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = b.response_logprobs(opt(b))
    loss = -sum(x.sum() for x in before)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    sgd.step()
    after = b.response_logprobs(opt(b))
    assert sum(x.sum() for x in after) > sum(x.sum() for x in before)


def test_replaced_parameters_are_refused_not_trained_stale():
    """After load_state_dict(assign=True) the captured program would go on with the old Parameters (0.26 off the
    model's log-probs, no gradient reaching the model): refused by name, in the DualKV and canonical modules; an
    in-place load passes and is followed."""
    model = tiny_model("llama")
    opt = kvt.transform(model, FAST, progress=False)
    canonical = kvt.transform(model, kvt.CanonicalConfig(verify=VerifyConfig(enabled=False)), progress=False)
    b = kvt.pack_shared_prefix([5, 6, 7], [[8, 9], [10]])
    other = tiny_model("llama", seed=3).state_dict()
    model.load_state_dict(other)  # in place: followed
    torch.testing.assert_close(b.response_logprobs(opt(b))[0], replicated_logprobs(model, b)[0], atol=1e-5,
                               rtol=1e-5)
    model.load_state_dict(other, assign=True)
    with pytest.raises(ValueError, match="was replaced after the transform"):
        opt(b)
    with pytest.raises(ValueError, match="was replaced after the transform"):
        canonical(torch.tensor([[5, 6, 7]]))


def test_longrope_batches_are_refused_where_trajectories_would_share_frequencies(tmp_path):
    """LongRoPE (Phi-3-128k) picks its long factors for a whole call from its largest position: a packed batch
    mixing trajectories on both sides of the limit (5.5 off the separate log-probs) is refused by the module and by
    its reloaded artifact; batches on one side stay exact."""
    model = tiny_model("phi3", max_position_embeddings=256, original_max_position_embeddings=64,
                       initializer_range=0.2, rope_parameters={
                           "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                           "long_factor": [4.0] * 8, "original_max_position_embeddings": 64})
    opt = kvt.transform(model, FAST, progress=False)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(2, 128, (120,), generator=g).tolist()
    with torch.no_grad():
        for seqs in ([base[:40], base[:30] + [5, 6]], [base[:110], base[:100] + [5, 6]]):
            tree = kvt.pack_trajectories(seqs)
            for got, s in zip(tree.trajectory_logprobs(opt(tree)), seqs):
                want = model(torch.tensor([s])).logits[0, :-1].log_softmax(-1).gather(1, torch.tensor(s[1:])[:, None])
                torch.testing.assert_close(got, want[:, 0], atol=1e-5, rtol=1e-5)
    mixed = kvt.pack_trajectories([base[:110], base[:30], base[:30] + [5, 6]])  # one ends inside the tree
    with pytest.raises(ValueError, match="LongRoPE .* trajectories of 30 and 110"):
        opt(mixed)
    loaded = kvt.load(opt.save(tmp_path / "art", progress=False))
    with pytest.raises(ValueError, match="LongRoPE"):
        loaded(mixed)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_exact_logprobs_and_grads_tiny(family, attn):
    model = tiny_model(family, attn_implementation=attn)
    opt = kvt.transform(model, FAST, progress=False)
    vocab = model.config.vocab_size
    b = kvt.pack_shared_prefix_groups(_rand_groups(vocab, [(13, [5, 1, 17]), (3, [1, 4]), (1, [2])]))
    adv = torch.randn(b.num_responses)
    res = check_exactness(model, opt, b, adv)
    assert res["logprobs_rel"] <= 1e-5, res
    assert res["grad_rel"] <= 1e-5, res            # per parameter: max abs error / max |ref| (2 layers)
    assert res["grad_global_rel"] <= 1e-5, res


def test_module_input_forms_and_layout_errors(llama):
    model, opt = llama
    b = kvt.pack_shared_prefix_groups(_rand_groups(128, [(6, [3, 2]), (4, [5])]))
    ref = opt(b)
    assert ref.shape == (1, b.num_tokens, 128)
    same = opt(b.input_ids, cu_seqlens=b.cu_seqlens, segment_prefix=b.segment_prefix)
    assert torch.equal(ref, same)
    assert torch.equal(ref, opt(b.input_ids, b.layout))
    assert torch.equal(ref, opt(input_ids=b.input_ids[0], position_ids=b.position_ids, cu_seqlens=b.cu_seqlens,
                                segment_prefix=b.segment_prefix))
    for dtype in (torch.int16, torch.int32, torch.uint8):  # any integer ids (int16 reached the embedding as is)
        assert torch.equal(ref, opt(b.input_ids.to(dtype), b.layout))
    with pytest.raises(ValueError, match="core_inputs takes a PackedBatch .* got TreeBatch: call the module"):
        opt.core_inputs(kvt.pack_trajectories([[1, 2, 3], [1, 2, 4, 5]]))  # (was an AttributeError)
    with pytest.raises(ValueError, match="without a layout"):
        opt(torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="layout mismatch"):
        opt(b.input_ids[:, :-1], b.layout)
    with pytest.raises(ValueError, match="position_ids do not match the layout"):
        opt(b.input_ids, position_ids=torch.arange(b.num_tokens), cu_seqlens=b.cu_seqlens,
            segment_prefix=b.segment_prefix)
    with pytest.raises(ValueError, match="invalid packed layout"):
        opt(b.input_ids, cu_seqlens=torch.tensor([0, 6, 6, 11, 20], dtype=torch.int32),
            segment_prefix=b.segment_prefix)
    with pytest.raises(ValueError, match="int32"):
        opt(b.input_ids, cu_seqlens=b.cu_seqlens.long(), segment_prefix=b.segment_prefix)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        opt(kvt.pack_shared_prefix([1, 2], [[3, 128]]))
    tampered = PackedBatch(b.input_ids, b.position_ids, kvt.DualKVLayout.from_lengths([(5, [4, 2]), (4, [5])]),
                           b.groups)
    with pytest.raises(ValueError, match="position_ids do not match the layout"):
        opt(tampered)


def test_sliding_window_becomes_the_ops_window():
    """Mistral with a window of 8: every site becomes ``kvt.dualkv_attention(..., window=8)`` (and the tree
    program's ``kvt.prefix_tree_attention`` keeps it); the gate, on, compares log-probs and gradients of both
    programs with the replicated batch on sequences longer than the window."""
    opt = kvt.transform(tiny_model("mistral", sliding_window=8), DualKVConfig(), progress=False)
    assert opt.report.verification.passed and [s.window for s in opt.report.sites] == [8, 8]
    for prog, op in ((opt.core.gm, torch.ops.kvt.dualkv_attention.default),
                     (opt.tree_core, torch.ops.kvt.prefix_tree_attention.default)):
        assert [n.kwargs.get("window") for n in prog.graph.nodes if n.target is op] == [8, 8]


def test_save_load_roundtrip(llama, tmp_path):
    _, opt = llama
    opt.save(tmp_path / "a")
    opt2 = kvt.load(tmp_path / "a")
    assert isinstance(opt2, DualKVModule) and opt2.vocab_size == 128
    b = kvt.pack_shared_prefix_groups(_rand_groups(128, [(7, [2, 9, 1]), (2, [3])]))
    assert torch.allclose(opt(b), opt2(b), atol=1e-6, rtol=0)


def test_gate_rejects_wrong_module(llama, monkeypatch):
    """The gate compares against the replicated batch: a packed module that lets responses see each other fails."""
    from kvtransform.verify import VerificationError, verify_packed
    from kvtransform.report import Report

    model, opt = llama

    class Leaky(torch.nn.Module):  # plain causal attention over the whole packed axis (what a missing rewrite does)
        def forward(self, input_ids, position_ids, cu_seqlens, segment_prefix):
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         attention_mask=torch.ones_like(input_ids)).logits

    bad = DualKVModule(Leaky(), DualKVConfig(), Report())
    with pytest.raises(VerificationError):
        verify_packed(model, bad, DualKVConfig(), None, Report(), progress=False)
    # The numerics rule (float64 reference) fails it too, and holds for the real packed module on the same batch.
    from kvtransform.verify import check_numerics_rule

    b = kvt.pack_shared_prefix_groups(_rand_groups(128, [(7, [2, 9, 1]), (2, [3])]))
    res = check_numerics_rule(model, bad, b, floor=1e-4)
    assert not res["passed"] and res["worst"][1] > 1e-2, res["worst"]
    assert check_numerics_rule(model, opt, b, floor=1e-4)["passed"]
    # equal rewards (zero advantages): every gradient of ours and of the original is exactly 0; one run named as a
    # string. A small floor: with none, fp32 rounding alone can put our log-probs a hair past twice the original's
    # error (seed 1083431023: 9.87e-8 against 2 x 4.81e-8)
    res = check_numerics_rule(model, opt, b, torch.zeros(b.num_responses), floor=1e-6, original_runs="padded")
    assert res["passed"] and all(r[1] == 0.0 == r[2] for r in res["rows"][1:])   # gradients: exactly 0
    for kw, msg in ((dict(advantages=torch.zeros(b.num_responses + 1)), r"advantages must have shape \(4,\)"),
                    (dict(original_runs=()), "original_runs"), (dict(original_runs=("both",)), "original_runs"),
                    (dict(floor=-1.0), "floor")):
        with pytest.raises(ValueError, match=msg):
            check_numerics_rule(model, opt, b, **kw)


def test_checks_name_a_module_of_another_model_and_take_advantages_as_numbers():
    """check_exactness / check_numerics_rule: a module transformed from another model (or a copy) is named in one
    line (its gradients compared as zeros: grad_rel 1.0 with no hint); advantages as a list work (a raw
    AttributeError), wrong shapes or NaN are named in check_exactness too (an IndexError, or silently the first N);
    a frozen model is named there (grad()'s empty-inputs RuntimeError), and the DualKV transform of a frozen
    reference model verifies its log-probs only, said in the report (it raised that RuntimeError)."""
    import copy

    from kvtransform.verify import check_exactness, check_numerics_rule

    model = kvt.tiny_model("llama")
    opt = kvt.transform(model, "dualkv", progress=False)
    b = kvt.pack_shared_prefix([1, 2, 3, 4], [[5, 6], [7, 8, 9]])
    assert check_exactness(model, opt, b, advantages=[1.0, -1.0])["grad_global_rel"] < 1e-5
    for check in (check_exactness, check_numerics_rule):
        with pytest.raises(ValueError, match="carry no gradient to the model's parameters: pass the model it was"):
            check(copy.deepcopy(model), opt, b)
    for adv, msg in (([1.0, -1.0, 5.0], r"shape \(2,\)"), (torch.tensor([[1.0, -1.0]]), r"shape \(2,\)"),
                     ([float("nan"), 1.0], "finite"), (["a", "b"], "must be 2 numbers")):
        with pytest.raises(ValueError, match=msg):
            check_exactness(model, opt, b, advantages=adv)
    frozen = kvt.tiny_model("llama").requires_grad_(False)
    ref = kvt.transform(frozen, "dualkv", progress=False)
    assert any("frozen reference model" in n for p in ref.report.passes for n in p.notes)
    with pytest.raises(ValueError, match="no parameter of the model requires grad"):
        check_exactness(frozen, ref, b)
    assert check_exactness(frozen, ref, b, backward=False)["logprobs_rel"] < 1e-5


def test_checks_turn_gradients_on_and_name_a_batch_that_is_not_packed():
    """Under a caller's torch.no_grad() the checks (and the DualKV transform's gate) said "pass the model it was
    transformed from ..." or raised autograd's "does not require grad"; they turn gradients on themselves now, name
    torch.inference_mode() (which cannot be left from inside), and name a batch that is not a packed batch (a list
    of ids raised an AttributeError)."""
    from kvtransform.verify import check_exactness, check_numerics_rule

    model = kvt.tiny_model("llama")
    b = kvt.pack_shared_prefix([1, 2, 3, 4], [[5, 6], [7, 8, 9]])
    with torch.no_grad():
        opt = kvt.transform(model, "dualkv", progress=False)
        assert check_numerics_rule(model, opt, b)["passed"]
        assert check_exactness(model, opt, b)["grad_global_rel"] < 1e-5
    with torch.no_grad():
        check_exactness(model, opt, b)
        assert not torch.is_grad_enabled()
    with torch.inference_mode():
        for call in (lambda: check_exactness(model, opt, b), lambda: kvt.transform(model, "dualkv", progress=False)):
            with pytest.raises(ValueError, match="torch.inference_mode\\(\\) forbids: call it"):
                call()
    for check in (check_exactness, check_numerics_rule):
        with pytest.raises(TypeError, match="batch must be a PackedBatch .* got list"):
            check(model, opt, [[1, 2, 3]])


def test_gate_names_the_gradient_tolerance_when_the_gradient_fails():
    """A failing gradient check names its own tolerance and key, not the log-prob tolerance; float64's default
    gradient tolerance holds for a float64 HF model (whose norms run in float32: ~5e-8 between packed and replicated
    gradients, log-probs equal to ~2e-16)."""
    from kvtransform.verify import VerificationError

    model = kvt.tiny_model("llama").double()
    kvt.transform(model, "dualkv", progress=False)
    cfg = DualKVConfig(verify_grad_tolerance=1e-12, verify=kvt.VerifyConfig(tolerance=1e-6))
    with pytest.raises(VerificationError, match=r"> tolerance=1e-12 \(case grad, all .* raise "
                                                 r"transform\.verify_grad_tolerance;") as e:
        kvt.transform(model, cfg, progress=False)
    assert "informational" not in str(e.value)


# ------------------------------------------------------------------------------------------------ real SmolLM2
def _real_batch(tok, vocab, spec, gen):
    from kvtransform.verify import text_token_ids

    ids = text_token_ids(tok, vocab, 600)

    def piece(n):
        s = int(torch.randint(0, ids.numel() - n, (1,), generator=gen))
        return ids[s:s + n]

    return kvt.pack_shared_prefix_groups([(piece(p), [piece(r) for r in rs]) for p, rs in spec], vocab_size=vocab)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-dualkv")  # one worker transforms SmolLM2 once (conftest's session fixture)
def test_exact_real_smollm2(smollm2_dualkv):
    """The numerics rule on every tensor (log-probs and each of the 30-layer model's parameter gradients): the packed
    fp32 module's error against a float64 run of the original is at most 2x the original fp32 model's own error (the
    larger of its two usual runs: N sequences, one padded batch) plus a floor of 1e-4 of max|x64|.

    Why that floor: the attention op itself is within ~1e-6 of float64 here; the gradient errors (1e-6..1e-3 per
    tensor, for the original and for us alike) are fp32 rounding amplified through 30 layers, so per tensor the two
    runs' errors scatter independently and their ratio reaches ~3.6x on small tensors (early q/k projections, norm
    weights) where the original is lucky; a fixed tolerance between the two fp32 runs failed CI the same way. Over 70
    random batches the worst err/(2 err_orig + floor) was 1.61 at floor 1e-5, 1.10 at 5e-5 and 0.78 at 1e-4. A wrong
    mask gives errors above 1e-2 (test_gate_rejects_wrong_module)."""
    from kvtransform.verify import check_numerics_rule

    model, tok, opt = smollm2_dualkv
    assert opt.report.verification.passed
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    # two prompt groups, three responses in one of them, a one-token response (one batch: a run costs ~70 s)
    b = _real_batch(tok, model.config.vocab_size, [(17, [6, 1, 9]), (5, [3])], gen)
    adv = torch.randn(b.num_responses, generator=gen)
    res = check_numerics_rule(model, opt, b, adv, floor=1e-4)
    assert res["passed"], [r for r in res["rows"] if not r[1] <= r[3]][:5]
    assert len(res["rows"]) == 1 + len(list(model.parameters()))
    assert res["rows"][0][0] == "logprobs" and res["rows"][0][1] < 1e-5, res["rows"][0]
    # The whole gradient (all parameters as one vector, ~2e-5 for both runs) obeys the same form.
    assert res["grad_global_rel_opt"] <= 2 * res["grad_global_rel_original"] + 1e-5, res["worst"]


def test_train_mode_dropout_is_refused_not_dropped():
    """The packed capture runs in eval mode, so a train-mode model with dropout would train without it, silently
    (enable() refuses the same model at its packed forward): refused in one line; model.eval() passes."""
    model = tiny_model("llama", attention_dropout=0.5).train()
    with pytest.raises(ValueError, match=r"train mode with dropout 0.5 .* call model.eval\(\)"):
        kvt.transform(model, FAST, progress=False)
    dk = kvt.transform(model.eval(), FAST, progress=False)
    b = kvt.pack_shared_prefix([1, 2, 3], [[4, 5], [6]])
    dk(b)
    model.train()  # after the transform (as its message advises): the module would train without dropout, silently
    with pytest.raises(ValueError, match=r"train mode with dropout 0.5 .* call model.eval\(\) before calling the DualKV"):
        dk(b)


def test_train_and_eval_record_the_mode(tmp_path):
    """dk.train() / dk.eval() (what a trainer or a container module calls) raised torch.export's "Calling train() is
    not supported yet" for a reloaded program; they record the mode, and the module computes the same either way."""
    model = tiny_model("llama")
    dk = kvt.transform(model, FAST, progress=False)
    dk.save(tmp_path / "dk")
    b = kvt.pack_shared_prefix([1, 2, 3], [[4, 5], [6]])
    for m in (dk, kvt.load(tmp_path / "dk")):
        want = m(b)
        assert torch.nn.ModuleDict({"m": m}).train().training and m.training
        assert not m.eval().training
        torch.testing.assert_close(m(b), want, rtol=0, atol=0)
