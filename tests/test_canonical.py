"""Spine: capture → canonical attention pass → verification → save/load, on tiny random configs of the Llama,
Qwen2, Qwen3 and Mistral families (sdpa and eager; Gemma 2/3, gpt-oss, Qwen3-MoE, Phi-3: tests/test_families.py)
and on the real SmolLM2-135M."""
import json

import pytest
import torch

import kvtransform as kvt
from kvtransform.capture import capture
from kvtransform.passes.attention import classify_mask, find_attention
from kvtransform.passes.manager import PassContext
from kvtransform.verify import VerificationError
from kvtransform.report import Report

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
IMPLS = ["sdpa", "eager"]


def _batch(vocab, b=3, s=23, pad=(0, 5, 11)):
    ids = torch.randint(0, vocab, (b, s))
    am = torch.ones(b, s, dtype=torch.long)
    for r, p in enumerate(pad[:b]):
        am[r, :p] = 0
    return ids, am


def _attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.kvt.attention.default]


@pytest.fixture(scope="module", params=[(f, i) for f in FAMILIES for i in IMPLS], ids=lambda p: f"{p[0]}-{p[1]}")
def transformed(request):
    fam, impl = request.param
    model = kvt.tiny_model(fam, attn_implementation=impl, num_hidden_layers=2)
    opt = kvt.transform(model, "canonical", progress=False)
    return model, opt


def test_every_site_canonical(transformed):
    model, opt = transformed
    cfg = model.config
    r = opt.report
    assert len(r.sites) == cfg.num_hidden_layers
    assert r.count("canonical") == cfg.num_hidden_layers
    assert [s.layer for s in r.sites] == list(range(cfg.num_hidden_layers))
    for s in r.sites:
        assert (s.q_heads, s.kv_heads, s.head_dim) == (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                        cfg.hidden_size // cfg.num_attention_heads or cfg.head_dim)
        assert s.mask_kind == "causal+padding"
    gm = opt.core.gm
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    assert torch.ops.aten.softmax.int not in targets
    nodes = _attention_nodes(gm)
    assert len(nodes) == cfg.num_hidden_layers
    for n in nodes:  # GQA visible: K/V keep H_kv heads; causal flag on, no materialised mask
        q, k, v, attn_mask, key_padding, scale, causal = n.args
        assert k.meta["val"].shape[1] == cfg.num_key_value_heads
        assert attn_mask is None and key_padding is not None and causal is True
    # the (B, 1, S, S) mask construction is gone
    assert not [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
                and n.meta["val"].dtype == torch.bool and n.meta["val"].dim() == 4]
    assert r.pass_record("cleanup").nodes_removed > 0


def test_equal_to_original_left_padded(transformed):
    model, opt = transformed
    ids, am = _batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am, use_cache=False).logits
        out = opt(ids, am)
    keep = am.bool()
    assert out.shape == ref.shape
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-5, atol=1e-5)
    v = opt.report.verification
    assert v.passed is True and v.max_rel_error <= 1e-4 and len(v.cases) >= 2


def test_gradients_equal_and_parameters_shared(transformed):
    model, opt = transformed
    assert all(a is b for a, b in zip(opt.parameters(), model.parameters()))
    ids, am = _batch(model.config.vocab_size, b=2, s=9, pad=(0, 3))
    keep = am.bool()
    model.zero_grad()
    opt(ids, am)[keep].square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(input_ids=ids, attention_mask=am, use_cache=False).logits[keep].square().mean().backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    model.zero_grad()


def test_sliding_window_mask_becomes_the_window_argument():
    model = kvt.tiny_model("mistral", attn_implementation="sdpa", sliding_window=6)
    opt = kvt.transform(model, "canonical", progress=False)
    assert {s.mask_kind for s in opt.report.sites} == {"sliding_window"}
    assert {s.window for s in opt.report.sites} == {6}
    for n in _attention_nodes(opt.core.gm):
        # the proven mask is dropped: causal within the window, padding as key_padding
        assert n.args[3] is None and n.args[4] is not None and n.args[6] is True and n.kwargs["window"] == 6
    ids, am = _batch(model.config.vocab_size, s=19)
    with torch.no_grad():
        torch.testing.assert_close(opt(ids, am)[am.bool()],
                                   model(input_ids=ids, attention_mask=am, use_cache=False).logits[am.bool()],
                                   rtol=1e-5, atol=1e-5)


def test_mask_proof_rejects_a_non_causal_mask():
    """A mask node that is not causal must not be classified causal (so it would never be dropped)."""
    model = kvt.tiny_model("llama")
    cap = capture(model)
    gm = cap.graph_module
    ctx = PassContext(Report(), model.config, cap.max_seq_len)
    m = find_attention(gm)[0]
    assert classify_mask(gm, m.mask, False, ctx, {}) == "causal+padding"
    # graft a transposed mask (anti-causal) in front of the first site and classify it
    with gm.graph.inserting_before(m.out):
        bad = gm.graph.call_function(torch.ops.aten.transpose.int, (m.mask, 2, 3))
    assert classify_mask(gm, bad, False, ctx, {}) == "custom"


def test_inspect_reports_sites_without_rewriting():
    model = kvt.tiny_model("qwen2", attn_implementation="eager", num_hidden_layers=3)
    r = kvt.inspect(model, progress=False)
    assert [s.status for s in r.sites] == ["found"] * 3 and [s.kind for s in r.sites] == ["eager"] * 3



def test_any_integer_dtype_of_input_ids_runs():
    """int16 / uint8 / int32 ids give the int64 logits (int16 reached the embedding as is: a torch error)."""
    opt = kvt.transform(kvt.tiny_model("llama"), "canonical", progress=False)
    ids = torch.randint(3, 100, (2, 8))
    want = opt(ids)
    assert all(torch.equal(opt(ids.to(d)), want) for d in (torch.int16, torch.uint8, torch.int32))


def test_inspect_refuses_what_is_not_a_causal_lm_in_one_line():
    """As transform(): a layer or a (model, tokenizer) pair is named, not an AttributeError from inside capture."""
    model = kvt.tiny_model("llama")
    for bad, err in ((torch.nn.Linear(2, 2), ValueError), ((model, None), TypeError)):
        with pytest.raises(err) as e:
            kvt.inspect(bad, progress=False)
        assert "\n" not in str(e.value) and "causal" in str(e.value)

def test_training_dropout_site_is_skipped_and_reported():
    model = kvt.tiny_model("llama", attn_implementation="eager", attention_dropout=0.5)
    model.train()
    from kvtransform.passes.attention import AttentionPass
    from kvtransform.passes.manager import run_passes
    cap = capture(model)  # capture puts the model in eval mode: dropout becomes inactive, site is rewritable
    ctx = PassContext(Report(), model.config, cap.max_seq_len)
    run_passes(cap.graph_module, [AttentionPass(ctx)])
    assert ctx.report.count("canonical") == model.config.num_hidden_layers
    assert model.training  # capture restores the mode


def test_verification_gate_refuses(tmp_path):
    model = kvt.tiny_model("llama")
    cfg = kvt.CanonicalConfig()
    cfg.verify.tolerance = 1e-30  # fp32 differences (~1e-7) exceed this: the gate must refuse
    with pytest.raises(VerificationError, match="Nothing was written"):
        kvt.transform(model, cfg, progress=False)


def test_save_load_roundtrip(tmp_path):
    model = kvt.tiny_model("qwen3")
    opt = kvt.transform(model, "canonical", progress=False)
    out = tmp_path / "art"
    opt.save(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "graph.py", "meta.json", "model.pt2",
                                                     "report.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directories left
    d = json.loads((out / "report.json").read_text())
    assert {"passes", "sites", "verification"} <= set(d)
    assert set(d["verification"]) >= {"max_abs_error", "max_rel_error", "tolerance", "passed"}
    assert {"name", "matched", "rewritten", "skipped"} <= set(d["passes"][0])
    assert {"layer", "kind", "q_heads", "kv_heads", "head_dim", "mask_kind", "status"} <= set(d["sites"][0])
    assert "kvt.attention" in (out / "graph.py").read_text()
    loaded = kvt.load(out)
    assert loaded.config == opt.config and loaded.report.to_dict() == opt.report.to_dict()
    ids, am = _batch(model.config.vocab_size, s=31)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, am)[am.bool()], opt(ids, am)[am.bool()], rtol=0, atol=0)
    with pytest.raises(FileExistsError, match="overwrite"):
        opt.save(out)
    opt.save(out, overwrite=True)
    assert kvt.load(out) is not None
    with pytest.raises(FileNotFoundError, match="not a kvtransform artifact"):
        kvt.load(tmp_path)


def test_config_errors():
    model = kvt.tiny_model("llama")
    with pytest.raises(ValueError, match="unknown transform"):
        kvt.transform(model, "flashy", progress=False)
    for typo, want in (("dualk", "dualkv"), ("dual_kv", "dualkv"), ("Canonical", "canonical"),
                       ("speccontext", "specontext")):
        with pytest.raises(ValueError, match=f"unknown transform '{typo}': did you mean '{want}'"):
            kvt.transform(model, typo, progress=False)
    for demo, msg in (({"num_responses": 0}, "demo.num_responses must be an integer >= 1; got 0"),
                      ({"temperature": 1e-300}, "demo.temperature must be a number from 0.001 to 1000"),
                      ({"seed": 2 ** 70}, "demo.seed must be an integer from 0 to 2\\*\\*63 - 1")):
        with pytest.raises(ValueError, match=msg):
            kvt.transform(model, {"name": "dualkv", "demo": demo}, progress=False)
    with pytest.raises(ValueError, match="unknown transform"):  # not a TypeError (unhashable)
        kvt.transform(model, {"name": ["dualkv"]}, progress=False)
    with pytest.raises(ValueError, match="Valid keys"):
        kvt.transform(model, {"name": "canonical", "verfy": {}}, progress=False)


def test_bert_is_refused():
    from transformers import BertConfig, BertForMaskedLM
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64)).eval()
    with pytest.raises(ValueError, match="causal"):
        kvt.transform(bert, "canonical", progress=False)


@pytest.mark.parametrize("bad, match", [
    ({"lengths": []}, "verify.lengths is empty"),
    ({"lengths": [1]}, "lengths must be integers >= 2"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"tolerance": -1.0}, "tolerance must be a finite number > 0"),
    ({"tolerance": float("nan")}, "tolerance must be a finite number > 0"),
])
def test_verify_config_rejects_values_the_gate_cannot_run(bad, match):
    with pytest.raises(ValueError, match=match):
        kvt.transform(kvt.tiny_model("llama"), {"name": "canonical", "verify": bad}, progress=False)


def test_verify_lengths_beyond_the_model_are_clamped_and_reported():
    model = kvt.tiny_model("qwen3", max_position_embeddings=32)
    opt = kvt.transform(model, "canonical", progress=False)  # default lengths include 37 > 32
    assert [c["shape"][1] for c in opt.report.verification.cases] == [9, 9, 32, 32]
    assert any("verified at 32" in n for n in opt.report.pass_record("attention").notes)


def test_module_input_validation():
    model = kvt.tiny_model("llama", max_position_embeddings=32)
    opt = kvt.transform(model, "canonical", progress=False)
    ids = torch.randint(0, 100, (2, 5))
    cases = [
        ((torch.randint(0, 100, (2, 40)),), "1 <= seq <= 32"),
        ((torch.tensor([[1, 2, 500]]),), "outside the vocabulary"),
        ((torch.ones(1, 4),), "integer tensor"),
        ((torch.ones(0, 5, dtype=torch.long),), "batch >= 1"),
        ((ids, torch.ones(2, 3, dtype=torch.long)), "attention_mask must be 0/1"),
        ((ids, torch.full((2, 5), 0.5)), "attention_mask must be 0/1"),
        ((kvt.pack_shared_prefix([1, 2, 3], [[4, 5]]),), "dualkv"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            opt(*args)


def test_train_mode_model_is_verified_in_eval_semantics():
    """...and says so (a warning and a note of the attention pass): the program applies no dropout."""
    model = kvt.tiny_model("llama", attention_dropout=0.5).train()
    with pytest.warns(UserWarning, match=r"train mode with dropout 0.5 .*applies no dropout"):
        opt = kvt.transform(model, "canonical", progress=False)
    assert opt.report.verification.passed and model.training
    assert any("applies no dropout" in n for n in opt.report.pass_record("attention").notes)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvt.transform(model.eval(), "canonical", progress=False)  # eval mode: nothing to say


def test_plain_module_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="causal"):
        kvt.transform(torch.nn.Linear(2, 2), progress=False)
