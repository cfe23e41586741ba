"""Gemma 2, Gemma 3, gpt-oss, Qwen3-MoE and Phi-3 (tiny random models, fp32 CPU): DualKV through the HF integration
and the transform (sliding windows, soft-capping, learned sinks, mixture-of-experts, fused QKV), and SpeContext
(exact at a budget covering the context; a window layer never attends outside its window at a small budget)."""
import os

import pytest
import torch

import kvtransform as kvt
from kvtransform.integrations.transformers import packed_inputs
from kvtransform.models import TINY_WINDOW, tiny_model
from kvtransform.verify import check_numerics_rule

ALL = os.environ.get("KVT_ALL_FAMILIES") == "1"

FAMILIES = ("gemma2", "gemma3", "gpt_oss", "qwen3_moe", "phi3")

# prompts and responses longer than the tiny window (8), so responses see only part of their prompt
GROUPS = [([5, 9, 14, 3, 22, 7, 31, 12, 40, 17, 8], [[50, 51, 52, 53, 54, 55], [60, 61]]), ([70, 71, 72], [[80] * 9])]
TRAJECTORIES = [[5, 9, 14, 3, 22, 7, 31, 12, 40, 17, 50, 51], [5, 9, 14, 3, 22, 7, 31, 12, 60, 61, 62, 63, 64],
                [5, 9, 14, 3, 22, 7, 31, 12, 60, 61, 70], [90, 91, 92]]


def _tiny(family, **overrides):
    """The family's tiny model in eager attention; MoE experts on transformers' default ``grouped_mm`` (the numerics
    rule's float64 copy runs them as the per-expert loop, which has a float64 path)."""
    return tiny_model(family, attn_implementation="eager", **overrides)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_integration_logprobs_and_gradients_equal_separate_sequences(family):
    """``enable(model, "dualkv")``: the packed shared-prefix batch (and, for Gemma 2, a depth-3 prefix-tree batch:
    the tree op gets the same keywords) gives the separate sequences' log-probs and every parameter gradient under
    the numerics rule (against float64); a call without a layout (a left-padded batch) equals the original eager
    model (the soft-cap / sink families fall back to the model's own eager attention, which SDPA cannot express)."""
    original, model = _tiny(family), _tiny(family)
    kvt.integrations.transformers.enable(model, "dualkv")
    fn = lambda b: model(**packed_inputs(b)).logits  # noqa: E731
    batches = [kvt.pack_shared_prefix_groups(GROUPS)]
    if family == "gemma2":
        batches.append(kvt.pack_trajectories(TRAJECTORIES))
    for batch in batches:
        res = check_numerics_rule(model, fn, batch, floor=1e-5, original_runs="separate")
        assert res["passed"], (family, type(batch).__name__, [r for r in res["rows"] if not r[1] <= r[3]][:3])
    ids = torch.randint(3, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :5] = 0
    with torch.no_grad():
        got, want = model(ids, attention_mask=am).logits, original(ids, attention_mask=am).logits
        torch.testing.assert_close(got[am.bool()], want[am.bool()], atol=2e-5, rtol=1e-4)
        if family in ("gemma2", "gpt_oss"):  # generation (KV cache, one query token) through the eager fallback
            gen = [m.generate(ids, attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
                   for m in (model, original)]
            assert torch.equal(*gen)


def test_hf_integration_follows_the_softcap_the_model_applies():
    """Gemma 3 keeps ``attn_logit_softcapping`` from its config but never passes it to its attention: the packed
    paths must not soft-cap either (they follow the ``softcap`` keyword), so packed equals separate sequences."""
    model = _tiny("gemma3", attn_logit_softcapping=2.0)
    kvt.integrations.transformers.enable(model, "dualkv")
    fn = lambda b: model(**packed_inputs(b)).logits  # noqa: E731
    for batch in (kvt.pack_shared_prefix_groups(GROUPS), kvt.pack_trajectories(TRAJECTORIES)):
        res = check_numerics_rule(model, fn, batch, floor=1e-5, original_runs="separate")
        assert res["passed"], (type(batch).__name__, [r for r in res["rows"] if not r[1] <= r[3]][:3])


def test_enable_refuses_a_variant_the_op_does_not_take(monkeypatch):
    """An installed op without a variant keyword is refused at enable(), in one line naming it (never dropped)."""
    import kvtransform.ops.dualkv as odk

    def old_op(q, k, v, layout, segment_prefix=None, softmax_scale=None, return_lse=False):
        raise AssertionError("never called")

    monkeypatch.setattr(odk, "dualkv_attention", old_op)
    with pytest.raises(ValueError, match=r"^this model's attention uses window=8, softcap=5.0, which the packed "
                                         r"DualKV attention op \(old_op\) does not support yet$"):
        kvt.integrations.transformers.enable(_tiny("gemma2"), "dualkv")


def test_window_is_over_each_sequences_own_positions():
    """A response token at position P + r sees only the prompt tokens with position > P + r - window: changing a
    prompt token older than that leaves the response's logits unchanged (one sliding layer, so nothing reaches it
    through another layer), while the plain-causal model's logits change."""
    model = _tiny("gemma3", num_hidden_layers=1, layer_types=["sliding_attention"])
    kvt.integrations.transformers.enable(model, "dualkv")
    prompt = list(range(10, 22))  # P = 12
    a = kvt.pack_shared_prefix(prompt, [[40, 41, 42, 43], [50, 51]])
    b = kvt.pack_shared_prefix([99] + prompt[1:], [[40, 41, 42, 43], [50, 51]])
    with torch.no_grad():
        la, lb = model(**packed_inputs(a)).logits[0], model(**packed_inputs(b)).logits[0]
    # response token r (position 12 + r) sees positions > 12 + r - 8 >= 4: prompt token 0 is outside for every r
    torch.testing.assert_close(la[12:], lb[12:], atol=0, rtol=0)
    assert not torch.allclose(la[:TINY_WINDOW], lb[:TINY_WINDOW])  # inside the window it matters


def _opt_in(*families):
    """Parameters for ``families`` that run only with ``KVT_ALL_FAMILIES=1``: a SpeContext transform costs two
    ``torch.export`` captures (~6 s each on 2 cores), and the suite's time budget holds one (gpt-oss: window and
    global layers, sinks, experts); the extended run covers the rest."""
    return [pytest.param(f, marks=() if ALL else pytest.mark.skip(reason="KVT_ALL_FAMILIES=1 runs it"))
            for f in families]


@pytest.mark.parametrize("family", FAMILIES)
def test_dualkv_transform_logprobs_and_gradients_equal_separate_sequences(family):
    """``kvt.transform(model, "dualkv")`` (capture, canonical attention with window / soft-cap / sinks, DualKV pass;
    gpt-oss: mixture-of-experts captured through torch.export): each site reports its variant, and on a packed and
    a prefix-tree batch log-probs and every gradient meet the numerics rule (a stricter check than the transform's
    own gate, which is off here to keep the suite's time)."""
    model = _tiny(family)
    opt = kvt.transform(model, kvt.DualKVConfig(verify=kvt.config.VerifyConfig(enabled=False)), progress=False)
    windows = [s.window for s in opt.report.sites]
    assert all(s.status == "dualkv" for s in opt.report.sites)
    layer_types = getattr(model.config, "layer_types", None) or []
    assert windows == [TINY_WINDOW if "sliding" in str(t) else None for t in layer_types] or not layer_types
    for batch in (kvt.pack_shared_prefix_groups(GROUPS), kvt.pack_trajectories(TRAJECTORIES)):
        res = check_numerics_rule(model, opt, batch, floor=1e-5, original_runs="separate")
        assert res["passed"], (family, type(batch).__name__, [r for r in res["rows"] if not r[1] <= r[3]][:3])


@pytest.fixture(scope="module")
def sp_gpt_oss():
    model = _tiny("gpt_oss")
    return model, _specontext(model)


def _specontext(model):
    # the gate is off (time): the tests compare with HF generate token by token
    cfg = kvt.SpeContextConfig(budget=64, head="oracle", verify=kvt.config.VerifyConfig(enabled=False))
    return kvt.transform(model, cfg, progress=False)


def _check_specontext_exact(model, sp, left_padded):
    assert sp.report.count("sparse_decode") == model.config.num_hidden_layers
    layer_types = getattr(model.config, "layer_types", None) or []
    if layer_types:
        assert [s.window for s in sp.report.sites] == [TINY_WINDOW if "sliding" in str(t) else None
                                                       for t in layer_types]
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 128, (n,), generator=g) for n in (5, 19, 12)]
    ids, am = left_padded(rows)
    out = sp.generate(ids, am, max_new_tokens=8, eos_token_id=None)
    with torch.no_grad():
        for b, r in enumerate(rows):
            want = model.generate(r[None], attention_mask=torch.ones(1, len(r), dtype=torch.long), max_new_tokens=8,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(r):]
            assert torch.equal(out[b, ids.shape[1]:], want), b


def test_specontext_budget_covering_context_equals_hf_generate(sp_gpt_oss, left_padded):
    """SpeContext at a budget >= the context on gpt-oss (window and global layers, sinks, experts): HF
    ``generate``'s greedy tokens for each row of a left-padded batch (window layers attend densely to their window,
    global layers to every token)."""
    _check_specontext_exact(*sp_gpt_oss, left_padded)


@pytest.mark.parametrize("family", _opt_in("gemma2", "gemma3", "qwen3_moe", "phi3"))
def test_specontext_other_families_equal_hf_generate(family, left_padded):
    """As above for the other families (extended set: ``KVT_ALL_FAMILIES=1``)."""
    model = _tiny(family)
    _check_specontext_exact(model, _specontext(model), left_padded)


@pytest.mark.parametrize("budget", [3, 16])
def test_specontext_window_layer_never_attends_outside_its_window(sp_gpt_oss, budget):
    """gpt-oss (layer 0 window 8, layer 1 global): replacing layer 0's cached K/V older than the window by NaN changes
    no decode logit, whatever the selection holds, below the window (budget 3: the selected tokens inside the window)
    and above it (16: dense over the window); the same old positions in the global layer's cache are read (NaN
    logits): the selection serves the global layers, and the retrieval head scores with them."""
    import copy

    model, sp = sp_gpt_oss
    assert sp.head.score_layers == (1,)  # the oracle head scores with the global layer only
    rt = sp.runtime
    lens = (20, 11)
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    cache, _ = rt.prefill(prompts, 24, torch.device("cpu"))
    idx = torch.full((2, model.config.num_key_value_heads, budget), -1, dtype=torch.int32)
    for row, n in enumerate(lens):  # the oldest positions (outside the window) and the newest (inside)
        sel = sorted({*range(min(n, budget - 1)), n - 1})[:budget]
        idx[row, :, :len(sel)] = torch.tensor(sel, dtype=torch.int32)
    tok = torch.tensor([7, 9])
    logits, _ = rt.decode(copy.deepcopy(cache), tok, idx, slot=False)
    poisoned = {}
    for layer in (0, 1):
        c = copy.deepcopy(cache)
        for kv in (c.k, c.v):
            for row, n in enumerate(lens):
                kv[layer, row, :, : n - TINY_WINDOW + 1] = float("nan")  # positions j <= len - window
        poisoned[layer], _ = rt.decode(c, tok, idx, slot=False)
    torch.testing.assert_close(poisoned[0], logits, atol=0, rtol=0)
    assert torch.isnan(poisoned[1]).all()


def test_reloaded_artifacts_keep_window_softcap_and_sinks(tmp_path, sp_gpt_oss):
    """``kvt.load`` of a DualKV artifact (Gemma 2: windows and soft-capping) gives the fresh module's prefix-tree
    log-probs (the tree program is derived from the reloaded graph, whose ``torch.export`` form passes the variant
    arguments by position), and a reloaded SpeContext artifact (gpt-oss) still knows its window layer: the oracle
    head scores with the global layer only and the tokens equal the fresh module's."""
    model = _tiny("gemma2")
    opt = kvt.transform(model, kvt.DualKVConfig(verify=kvt.config.VerifyConfig(enabled=False)), progress=False)
    opt.save(tmp_path / "dualkv", progress=False)
    loaded = kvt.load(tmp_path / "dualkv", progress=False)
    tree = kvt.pack_trajectories(TRAJECTORIES)
    with torch.no_grad():
        want, got = tree.trajectory_logprobs(opt(tree)), tree.trajectory_logprobs(loaded(tree))
    assert all(torch.allclose(g, w, rtol=0, atol=1e-6) for g, w in zip(got, want))
    gpt_oss, sp = sp_gpt_oss
    sp.save(tmp_path / "specontext", progress=False)
    sp2 = kvt.load(tmp_path / "specontext", progress=False)
    assert sp2.head.score_layers == sp.head.score_layers == (1,)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    a, b = (m.generate(ids, max_new_tokens=6, eos_token_id=None) for m in (sp, sp2))
    assert torch.equal(a, b)


@pytest.mark.parametrize("override,match", [(dict(sliding_window=0), "window must be a positive int"),
                                            (dict(attn_logit_softcapping=0.0), "softcap")])
def test_enable_refuses_a_config_window_or_softcap_the_ops_refuse(override, match):
    """A Gemma 2 config with a window of 0 or a soft-cap of 0 is refused at ``enable()`` in one line naming the
    config keys, not at the first packed forward."""
    from kvtransform.integrations.transformers import enable

    with pytest.raises(ValueError, match=match) as e:
        enable(_tiny("gemma2", **override))
    assert "Gemma2ForCausalLM's config (sliding_window / attn_logit_softcapping)" in str(e.value)
    assert "\n" not in str(e.value)


def test_enable_takes_a_gemma3_config_whose_unused_softcap_is_zero():
    """Gemma 3 keeps ``attn_logit_softcapping`` in its config but never applies it: a value the ops would refuse (0)
    does not stop ``enable()``, and the packed log-probs still equal the separate sequences'."""
    from kvtransform.integrations.transformers import enable

    model = _tiny("gemma3", attn_logit_softcapping=0.0)
    seqs = [torch.tensor([5, 9, 13, 2, 7, 11, 3]), torch.tensor([5, 9, 13, 4, 8])]
    with torch.no_grad():
        want = [torch.log_softmax(model(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None])[:, 0]
                for s in seqs]
        enable(model)
        batch = kvt.pack_trajectories(seqs)
        got = batch.trajectory_logprobs(model(**packed_inputs(batch)).logits)
    assert all(torch.allclose(g, w, rtol=0, atol=1e-5) for g, w in zip(got, want))
