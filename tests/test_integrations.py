"""kvt.integrations.transformers: DualKV through a Hugging Face model's own forward (AttentionInterface)."""
import copy
import io

import pytest
import torch

import kvtransform as kvt
from kvtransform.verify import check_exactness

GROUPS = [([1, 2, 3, 4, 5, 6], [[7, 8], [9, 10, 11]]), ([3, 4], [[5], [6, 7, 8]])]


def _packed_logits(model):
    return lambda b: model(b.input_ids, position_ids=b.position_ids, cu_seqlens=b.cu_seqlens,
                           segment_prefix=b.segment_prefix, use_cache=False).logits


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_forward_equals_unpacked_original(family):
    """Log-probs and every parameter gradient of the enabled model on the packed batch equal the model run on the
    replicated sequences, under the numerics rule against float64 (``kvtransform.verify.check_numerics_rule``: a
    fixed tolerance between two fp32 runs flakes, the embedding gradient alone differs by ~1.4e-6)."""
    from kvtransform.verify import check_numerics_rule

    model = kvt.tiny_model(family)
    kvt.integrations.transformers.enable(model, "dualkv")
    assert model.config._attn_implementation == "kvt_dualkv"
    batch = kvt.pack_shared_prefix_groups(GROUPS)
    res = check_numerics_rule(model, _packed_logits(model), batch, floor=1e-5)
    assert res["passed"], [r for r in res["rows"] if not r[1] <= r[3]][:5]


def test_float64_model_takes_trees_of_every_depth():
    """A float64 model (CPU) runs one-level trees and lone trajectories too (the DualKV kernels take no float64, so
    they stay on the tree op), with the separate sequences' log-probs."""
    from kvtransform.integrations.transformers import packed_inputs

    original = kvt.tiny_model("llama").double()
    model = kvt.integrations.transformers.enable(copy.deepcopy(original), "dualkv")
    for trajectories in ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [[1, 2, 3, 4], [1, 2, 3, 5]], [[1, 2, 3]]):
        tree = kvt.pack_trajectories(trajectories)
        with torch.no_grad():
            got = tree.trajectory_logprobs(model(**packed_inputs(tree)).logits)
            for seq, lp in zip(trajectories, got):
                logits = original(torch.tensor([seq])).logits[0, :-1]
                want = logits.log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
                torch.testing.assert_close(lp, want, atol=1e-12, rtol=1e-10)


def test_without_layout_falls_back_to_causal_sdpa():
    """A plain (padded) batch and generation through the enabled model equal the original: the registered mask
    function keeps the causal and padding mask."""
    original = kvt.tiny_model("llama")
    model = kvt.integrations.transformers.enable(copy.deepcopy(original), "dualkv")
    ids = torch.randint(0, original.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :2] = 0
    with torch.no_grad():
        got, want = model(ids, attention_mask=am).logits, original(ids, attention_mask=am).logits
        assert torch.allclose(got[am.bool()], want[am.bool()], atol=1e-5)
        g1 = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        g2 = original.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(g1, g2)
    kvt.integrations.transformers.disable(model)
    assert model.config._attn_implementation == original.config._attn_implementation


def test_refusals_are_named():
    model = kvt.integrations.transformers.enable(kvt.tiny_model("llama"), "dualkv")
    batch = kvt.pack_shared_prefix_groups(GROUPS)
    with pytest.raises(ValueError, match="both cu_seqlens and segment_prefix"):
        model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens, use_cache=False)
    with pytest.raises(ValueError, match="supports 'dualkv'"):
        kvt.integrations.transformers.enable(model, "specontext")
    bad = batch.cu_seqlens.clone()
    bad[-1] += 1
    with pytest.raises(ValueError, match="sum to T"):
        model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=bad, segment_prefix=batch.segment_prefix,
              use_cache=False)


@pytest.mark.slow
def test_real_model_packed_equals_unpacked():
    model, tok = kvt.load_model("smollm2-135m")
    kvt.integrations.transformers.enable(model, "dualkv")
    ids = tok("Shared prompts are packed once; responses attend to the prompt and to themselves.",
              return_tensors="pt")["input_ids"][0]
    batch = kvt.pack_shared_prefix_groups([(ids[:10], [ids[10:14], ids[14:]])])
    res = check_exactness(model, _packed_logits(model), batch)  # the replicated path: same model, SDPA fallback
    assert res["logprobs_rel"] < 1e-4 and res["grad_global_rel"] < 1e-4


def test_packed_calls_are_checked_before_the_model_runs():
    """A packed call without its position_ids (transformers would number the packed axis 0..T-1: a silently wrong
    answer), with ids outside the vocabulary, a KV cache or a mask with zeros is refused in one line; a packed call never leaves a
    KV cache behind (it would mix every branch's K/V); disable() removes the check."""
    from kvtransform.integrations.transformers import packed_inputs

    model = kvt.integrations.transformers.enable(kvt.tiny_model("llama"), "dualkv")
    tree = kvt.pack_trajectories([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 9], [1, 11]])
    packed = kvt.pack_shared_prefix_groups(GROUPS)
    for batch in (tree, packed):
        kw = packed_inputs(batch)
        with pytest.raises(ValueError, match="position_ids=batch.position_ids"):
            model(**{k: v for k, v in kw.items() if k != "position_ids"})
        with pytest.raises(ValueError, match="integer positions"):
            model(**{**kw, "position_ids": kw["position_ids"].float()})
        bad_ids = kw["input_ids"].clone()
        bad_ids[0, -1] = model.config.vocab_size
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model(**{**kw, "input_ids": bad_ids})
        with pytest.raises(ValueError, match="packed input_ids on the meta device hold no token ids"):
            model(**{**kw, "input_ids": kw["input_ids"].to("meta")})  # (torch's meta errors before)
        with torch.no_grad():
            out = model(**{**kw, "use_cache": True})
            ones = model(**{**kw, "attention_mask": torch.ones_like(kw["input_ids"])})  # a tokenizer's mask: unused
        assert out.past_key_values is None and torch.equal(ones.logits, out.logits)
        hole = torch.ones_like(kw["input_ids"])
        hole[0, 2] = 0
        with pytest.raises(ValueError, match="attention_mask must be all ones"):  # padding it would not honour
            model(**{**kw, "attention_mask": hole})
        t = kw["input_ids"].shape[1]
        for shape in ((1, t + 3), (1, 1, t, t)):  # a mask of another batch, a 4-D mask: not silently ignored
            with pytest.raises(ValueError, match=r"attention_mask must be \(1, T\)"):
                model(**{**kw, "attention_mask": torch.ones(shape, dtype=torch.long)})
        with pytest.raises(ValueError, match="cannot take labels="):  # shifted across branches: no one's loss
            model(**kw, labels=kw["input_ids"])
        with pytest.raises(ValueError, match="no attention weights: drop output_attentions"):
            model(**kw, output_attentions=True)
    with pytest.raises(ValueError, match="without a KV cache: drop past_key_values"):
        model(**packed_inputs(tree), past_key_values=out.past_key_values or object())
    with pytest.raises(ValueError, match="without a KV cache: drop cache"):  # the argument's newer name
        model(**packed_inputs(tree), cache=object())
    # a tree batch's positions without its layout (the README once showed only the shared-prefix arguments)
    with pytest.raises(ValueError, match="position_ids fall back to 5 at token 6 without a packed layout"):
        model(tree.input_ids, position_ids=tree.position_ids, use_cache=False)
    for none in ({"prefix_tree_layout": None}, {"cu_seqlens": None, "segment_prefix": None}):  # (`x if tree else None`)
        with pytest.raises(ValueError, match="position_ids fall back to 5 at token 6 without a packed layout"):
            model(tree.input_ids, position_ids=tree.position_ids, use_cache=False, **none)
    with torch.no_grad():  # positions that restart at 0 (transformers' own packing) and left padding pass
        model(torch.tensor([[1, 2, 3, 4]]), position_ids=torch.tensor([[0, 1, 0, 1]]))
        model(torch.tensor([[0, 0, 3, 4]]), attention_mask=torch.tensor([[0, 0, 1, 1]]),
              position_ids=torch.tensor([[1, 1, 0, 1]]))
    # the backbone called directly is checked too; positional arguments count as given; one check per call
    import kvtransform.packing as packing

    kw = packed_inputs(tree)
    with pytest.raises(ValueError, match="position_ids=batch.position_ids"):
        model.model(kw["input_ids"], prefix_tree_layout=tree.layout)
    with pytest.raises(ValueError, match="without a KV cache: drop past_key_values"):
        model.model(**kw, past_key_values=object())
    calls = []
    real = packing.check_packed
    packing.check_packed = lambda *a: (calls.append(1), real(*a))[1]
    try:
        with torch.no_grad():
            want = model(**kw).logits
            got = model(kw["input_ids"], None, kw["position_ids"], prefix_tree_layout=tree.layout).logits
    finally:
        packing.check_packed = real
    # one check per forward (the backbone's hook reuses its top model's), and every forward checks: the same
    # tensors could have been refilled in place without a version bump (a collator writing through numpy)
    assert torch.equal(got, want) and len(calls) == 2
    pos = kw["position_ids"]
    before = pos.clone()
    pos.numpy()[0, -1] = 0  # no version bump: a check keyed on the tensor's version would miss it
    with pytest.raises(ValueError):
        model(**kw)
    pos.copy_(before)
    # without a layout, the positions are read once per forward too (the backbone's hook reuses the top's check)
    import kvtransform.integrations.packed_call as hf

    reads = []
    real_drop = hf._position_drop
    hf._position_drop = lambda *a: (reads.append(1), real_drop(*a))[1]
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4]]), position_ids=torch.tensor([[0, 1, 0, 1]]))
    finally:
        hf._position_drop = real_drop
    assert len(reads) == 1
    # a tokenizer's all-ones attention_mask does not hide a tree's positions passed without the layout
    with pytest.raises(ValueError, match="position_ids fall back to 5 at token 6 without a packed layout"):
        model(tree.input_ids, position_ids=tree.position_ids, attention_mask=torch.ones_like(tree.input_ids),
              use_cache=False)
    # a second model with a smaller vocabulary checks the same batch again
    small_cfg = copy.deepcopy(model.config)
    small_cfg.vocab_size = 3
    small = kvt.integrations.transformers.enable(type(model)(small_cfg), "dualkv")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small(**kw)
    kvt.integrations.transformers.disable(model)
    assert not model._forward_hooks and len(model._forward_pre_hooks) == len(model.model._forward_pre_hooks) == 1
    with pytest.raises(ValueError, match=r"packed attention is disabled .*: call kvt\.integrations\.transformers\."
                                         r"enable\(model, 'dualkv'\)"):  # its own attention would ignore the layout
        model(**packed_inputs(tree))
    with pytest.raises(ValueError, match="packed attention is disabled"):
        model.model(**packed_inputs(packed))
    with torch.no_grad():
        model(kw["input_ids"])  # an unpacked call runs
    kvt.integrations.transformers.enable(model, "dualkv")  # the guard goes with enable(), the checks come back
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    with torch.no_grad():
        model(**packed_inputs(tree))
    kvt.integrations.transformers.disable(model)


def test_transform_of_an_enabled_model_captures_its_own_attention():
    """kvt.transform / kvt.inspect of a model under enable() (the TRL trainer's policy when it re-transforms for
    rollouts) capture the model's own attention, then leave it enabled; a disabled model keeps its guard."""
    from kvtransform.integrations.transformers import packed_inputs

    model = kvt.integrations.transformers.enable(kvt.tiny_model("llama"), "dualkv")
    sp = kvt.transform(model, kvt.SpeContextConfig(budget=8), progress=False)
    assert sp.report.verification.passed and len(kvt.inspect(model, progress=False).sites) == 2
    assert model.config._attn_implementation == "kvt_dualkv" and len(model._forward_pre_hooks) == 1
    tree = kvt.pack_trajectories([[1, 2, 3, 4], [1, 2, 5]])
    with torch.no_grad():
        model(**packed_inputs(tree))
    kvt.integrations.transformers.disable(model)
    kvt.transform(model, "canonical", progress=False)
    with pytest.raises(ValueError, match="packed attention is disabled"):
        model(**packed_inputs(tree))


def _separate_logprobs(model, seqs):
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0, :-1].log_softmax(-1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
                for s in seqs]


def test_layout_is_refused_whenever_the_model_attends_without_it():
    """A model never enabled (every family, sdpa and eager), a second disable() (which keeps the guard), and an
    attention implementation set after enable() (which would ignore the layout) are refused in one line: all were
    silent wrong answers (0.063 off the separate log-probs). packed_inputs' attention_mask marker is what a model
    never enabled trips over; it copies, pickles and looks like a plain object to hasattr (accelerate's device
    placement probes it)."""
    import pickle

    from kvtransform.integrations.transformers import disable, enable, packed_inputs
    from kvtransform.packing import PackedLayoutMask, UnpackedModelError
    from kvtransform.tiny_models import TINY_FAMILIES

    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12], [5, 6, 13]]
    tree = kvt.pack_trajectories(seqs)
    packed = kvt.pack_shared_prefix([5, 6, 7], [[8, 9], [10]])
    for family in TINY_FAMILIES:
        for impl in ("sdpa", "eager"):
            stock = kvt.tiny_model(family, attn_implementation=impl)
            for batch in (tree, packed):
                with pytest.raises(ValueError, match=r"call kvt.integrations.transformers.enable\(model, 'dualkv'\) "
                                                     r"before model\(\*\*packed_inputs\(batch\)\)") as e:
                    stock(**packed_inputs(batch))
                assert "\n" not in str(e.value) and isinstance(e.value, UnpackedModelError), family
    marker = packed_inputs(tree)["attention_mask"]
    assert isinstance(copy.deepcopy(marker), PackedLayoutMask) and isinstance(pickle.loads(pickle.dumps(marker)),
                                                                              PackedLayoutMask)
    assert not hasattr(marker, "to") and not hasattr(marker, "ndim")
    with pytest.raises(UnpackedModelError):
        bool(marker)
    buf = io.BytesIO()  # a saved packed_inputs dict loads with torch.load's default weights_only=True
    torch.save(packed_inputs(packed), buf)
    buf.seek(0)
    assert isinstance(torch.load(buf)["attention_mask"], PackedLayoutMask)
    enabled = enable(kvt.tiny_model("llama"), "dualkv")
    with pytest.raises(UnpackedModelError, match=r"call the model itself \(its .forward skips the checks\)"):
        enabled.model.forward(**packed_inputs(packed))  # no hook runs: the checks and the marker's drop skipped
    model = enable(kvt.tiny_model("llama"), "dualkv")
    disable(disable(model))
    with pytest.raises(ValueError, match="packed attention is disabled"):
        model(**packed_inputs(tree))
    enable(model, "dualkv")
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attention implementation is 'sdpa', set after"):
        model(**packed_inputs(tree))
    enable(model, "dualkv")
    with torch.no_grad():
        got = tree.trajectory_logprobs(model(**packed_inputs(tree)).logits)
    for a, b in zip(got, _separate_logprobs(kvt.tiny_model("llama"), seqs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_disable_on_a_wrapper_switches_back_the_model_enabled_inside():
    """enable() on a PEFT model's base, disable() on the wrapper: the base gets its attention back and the wrapper
    refuses packed batches (a raw AttributeError before: the wrapper forwarded getattr to the base's attribute)."""
    peft = pytest.importorskip("peft")
    from kvtransform.integrations.transformers import disable, enable, packed_inputs

    base = kvt.tiny_model("llama")
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    enable(wrapped.get_base_model(), "dualkv")
    disable(wrapped)
    assert base.config._attn_implementation == "sdpa" and "_kvt_previous_attn" not in base.__dict__
    with pytest.raises(ValueError, match="packed attention is disabled"):
        wrapped(**packed_inputs(kvt.pack_shared_prefix([5, 6, 7], [[8, 9], [10]])))
    enable(wrapped, "dualkv")  # and back: the wrapper's own enable() works after it
    with torch.no_grad():
        wrapped(**packed_inputs(kvt.pack_shared_prefix([5, 6, 7], [[8, 9], [10]])))


def test_enabled_model_runs_under_inference_mode():
    """Inference tensors keep no version counter: packed and plain calls of an enabled model under
    torch.inference_mode() run (they crashed in the call checks) and give the separate log-probs."""
    from kvtransform.integrations.transformers import enable, packed_inputs

    model = enable(kvt.tiny_model("llama"), "dualkv")
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8], [1, 2, 9]]
    want = _separate_logprobs(kvt.tiny_model("llama"), seqs)
    with torch.inference_mode():
        for batch in (kvt.pack_trajectories(seqs), kvt.pack_trajectories(seqs[:2])):
            got = batch.trajectory_logprobs(model(**packed_inputs(batch)).logits)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        model(torch.tensor([[1, 2, 3]]), position_ids=torch.tensor([[0, 1, 2]]))


def test_length_dependent_rope_is_refused_where_trajectories_would_share_frequencies():
    """transformers picks dynamic-NTK / LongRoPE frequencies from a call's largest position, so in a packed batch
    the longest trajectory decides for all (short ones 0.47 / 3.9 off): refused in one line, while a batch the RoPE
    treats alike stays exact."""
    from kvtransform.integrations.transformers import enable, packed_inputs

    g = torch.Generator().manual_seed(0)
    base = torch.randint(2, 128, (60,), generator=g).tolist()
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [3.0] * 8,
                "original_max_position_embeddings": 16}
    for family, kw, ok, bad, match in (
            ("llama", dict(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                         "rope_theta": 10000.0}),
             [base[:14], base[:10] + [5]], [base[:50], base[:10]], "dynamic-NTK RoPE .* at most 16 tokens"),
            ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters=longrope),
             [base[:50], base[:40] + [5, 6]], [base[:50], base[:10]], "LongRoPE .* trajectories of 10 and 50")):
        model = kvt.tiny_model(family, initializer_range=0.2, **kw)
        want = _separate_logprobs(model, ok)
        enable(model, "dualkv")
        with pytest.raises(ValueError, match=match):
            model(**packed_inputs(kvt.pack_trajectories(bad)))
        with torch.no_grad():
            tree = kvt.pack_trajectories(ok)
            for a, b in zip(tree.trajectory_logprobs(model(**packed_inputs(tree)).logits), want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_enable_refuses_layers_that_mix_tokens_outside_attention():
    """Convolution / linear-attention layers (LFM2, MiniMax) and chunked attention (Llama 4) would mix a packed
    batch's sequences (1.98, 0.57, 0.63 off the separate log-probs): refused by name, at enable() and by the DualKV
    transform."""
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  num_key_value_heads=2)
    for cfg, match in ((transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"]), "'conv' layers"),
                       (transformers.MiniMaxConfig(**common, num_local_experts=2,
                                                   layer_types=["linear_attention", "full_attention"]),
                        "'linear_attention' layers")):
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with pytest.raises(ValueError, match=match):
            kvt.integrations.transformers.enable(model, "dualkv")
        with pytest.raises(ValueError, match=match):
            kvt.transform(model, "dualkv", progress=False)
    llama4 = kvt.tiny_model("llama")
    llama4.config.attention_chunk_size = 6
    with pytest.raises(ValueError, match="chunked attention"):
        kvt.integrations.transformers.enable(llama4, "dualkv")


def test_mla_value_head_size_runs_packed():
    """DeepSeek-V2/V3 attention (MLA: value heads 16 wide, query/key heads 24): zero-padded values are exact, so the
    packed log-probs equal the separate ones (it failed inside the op before)."""
    import transformers
    from kvtransform.integrations.transformers import enable, packed_inputs

    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1, moe_intermediate_size=32,
        n_group=1, topk_group=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    seqs = [[5, 6, 7, 8, 9], [5, 6, 9, 3], [5, 6, 9, 4, 4, 2], [7, 7]]
    want = _separate_logprobs(model, seqs)
    enable(model, "dualkv")
    with torch.no_grad():
        for batch in (kvt.pack_trajectories(seqs), kvt.pack_trajectories(seqs[:2])):  # tree, then one level
            for a, b in zip(batch.trajectory_logprobs(model(**packed_inputs(batch)).logits), want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
