"""Regression tests for defects found by trying to break the model-family, TRL and rollout-mismatch features as a
hostile but realistic user would (tiny random models, CPU): mixed-precision autocast through the attention ops and
the HF integration, TRL ``generation_kwargs`` the SpeContext sampler used to drop silently, a ``rollout-mismatch``
output path that failed only after the whole run, ``tiny_model`` overrides no layer reads, and models ``enable``
accepted but the packed ops cannot compute (bidirectional attention, head_dim above 256)."""
import pytest
import torch

import kvtransform as kvt
from kvtransform.ops.attention import attention
from kvtransform.ops.dualkv import dualkv_attention
from kvtransform.ops.prefix_tree import prefix_tree_attention
from kvtransform.tree_layout import PrefixTreeLayout


def _mixed(shape_q, shape_kv):
    """q, k in fp32 and v in bf16: what a fp32-weight model's RoPE and value projection give under bf16 autocast."""
    q, k = torch.randn(shape_q), torch.randn(shape_kv)
    return q, k, torch.randn(shape_kv).bfloat16()


def test_attention_ops_cast_to_the_autocast_dtype_like_sdpa():
    """Under ``torch.autocast`` every attention op casts q, k, v to the autocast dtype (as SDPA does) instead of
    refusing the mixed dtypes; outside autocast mixed or integer dtypes are a one-line ValueError."""
    lay = PrefixTreeLayout.from_parents([5, 3, 2, 4], [-1, 0, 0, -1])
    one = lay.as_dualkv()
    t = lay.total_tokens
    cases = [
        (attention, _mixed((1, 4, 6, 8), (1, 2, 6, 8)), dict(causal=True, window=3)),
        (lambda q, k, v, **kw: dualkv_attention(q, k, v, one.cu_seqlens, one.segment_prefix, **kw),
         _mixed((t, 4, 8), (t, 2, 8)), dict(softcap=3.0, sinks=torch.randn(4))),
        (lambda q, k, v, **kw: prefix_tree_attention(q, k, v, lay, **kw), _mixed((t, 4, 8), (t, 2, 8)),
         dict(window=2)),
    ]
    for op, (q, k, v), kw in cases:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = op(q, k, v, **kw)
        want = op(q.bfloat16().float(), k.bfloat16().float(), v.float(), **kw)  # the bf16-cast inputs, fp32
        assert got.dtype == torch.bfloat16 and (got.double() - want).abs().max() < 3e-2
    q, k, v = cases[0][1]
    for args in ((q, k, v), (q.long(), k.long(), v.long())):
        with pytest.raises(ValueError, match="must share one float dtype") as e:
            attention(*args, causal=True)
        assert "\n" not in str(e.value)


def test_hf_integration_packed_forward_under_autocast():
    """``enable(model, "dualkv")`` on a fp32 model under bf16 autocast (TRL's ``bf16=True`` mixed precision; it
    used to refuse q/k fp32 with v bf16): the packed log-probs are the unpacked sequences' (the model's own eager
    attention, Gemma 2's soft-cap and window) under the same autocast, within bf16 rounding."""
    from kvtransform.integrations.transformers import enable, packed_inputs
    from kvtransform.models import tiny_model

    model = enable(tiny_model("gemma2", attn_implementation="eager"), "dualkv")  # unpacked calls: its own eager
    prompt, resps = list(range(5, 17)), [[50, 51, 52], [60, 61]]
    batch = kvt.pack_shared_prefix(prompt, resps)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = batch.response_logprobs(model(**packed_inputs(batch)).logits.float())
        for r, lp in zip(resps, got):
            lg = model(torch.tensor([prompt + r])).logits.float().log_softmax(-1)[0, len(prompt) - 1:-1]
            want = lg.gather(1, torch.tensor(r)[:, None])[:, 0]
            assert (lp - want).abs().max() < 0.05


def test_canonical_module_under_autocast_is_one_line():
    """A canonical module runs its program in the captured dtype: under ``torch.autocast`` Gemma 2's failed deep
    inside the graph (a metadata assert on a ``.to()``'s input) and Llama's ran with the captured conversions; both
    are now one line naming the fix, and the same module still runs outside autocast."""
    from kvtransform.models import tiny_model

    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    for family in ("gemma2", "llama"):
        opt = kvt.transform(tiny_model(family), "canonical", progress=False)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"model\.to\(") as e:
            opt(ids)
        assert "\n" not in str(e.value)
        assert opt(ids).dtype == torch.float32


def test_trl_refuses_sampling_settings_hidden_in_generation_kwargs(tmp_path):
    """TRL's ``generation_kwargs`` override its generation config: a repetition penalty or min_p given there would
    have been dropped by the SpeContext sampler without a word; now one line, as the top-level fields are. And
    VESPO with a sequence-level importance-sampling mode, which TRL refuses for vLLM rollouts; shared_prefix with
    transformers' continuous batching, which cannot run the packed attention implementation."""
    pytest.importorskip("trl")
    from kvtransform.integrations.trl import GRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2,
                per_device_train_batch_size=2, rollout="specontext", vllm_importance_sampling_mode="token_truncate")
    for gk in ({"repetition_penalty": 1.3}, {"min_p": 0.2}):
        with pytest.raises(ValueError, match="repetition_penalty=1.0 and min_p=None") as e:
            GRPOConfig(**base, generation_kwargs=gk)
        assert "\n" not in str(e.value)
    GRPOConfig(**base, generation_kwargs={"repetition_penalty": 1.0, "min_p": None, "top_k": 5})
    # TRL refuses VESPO with sequence-level weights for vLLM rollouts in a check that runs before use_vllm is set
    with pytest.raises(ValueError, match="loss_type='vespo' needs token-level"):
        GRPOConfig(**{**base, "vllm_importance_sampling_mode": "sequence_mask"}, loss_type="vespo")
    GRPOConfig(**base, loss_type="vespo")
    with pytest.raises(ValueError, match="set use_transformers_continuous_batching=False"):  # was: transformers'
        GRPOConfig(**{**base, "rollout": None}, shared_prefix=True,  # error at the first rollout, naming 'sdpa'
                   use_transformers_continuous_batching=True)


def test_trl_specontext_rollout_follows_generation_kwargs(tmp_path, monkeypatch, caplog):
    """``generation_kwargs={"max_new_tokens": 3}`` reaches the SpeContext sampler (it used to decode
    ``max_completion_length`` tokens regardless); an ``eos_token_id`` there that the sampler would not stop at, and
    sampling settings the sampler refuses, are refused at construction in one line (not after the transform). A
    trained head's weights reach the transform (``rollout_retrieval``), and its refusal names this config's keys."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from types import SimpleNamespace

    from kvtransform.integrations.trl import GRPOConfig, GRPOTrainer
    from kvtransform.models import tiny_model
    from test_trl import _char_tokenizer

    seen = {}

    class FakeRollout:  # the SpeContext module's interface the trainer uses (no transform: this test is about args)
        def check_source_parameters(self):
            pass

        def generate(self, ids, mask, max_new_tokens, **kw):
            seen["max_new_tokens"] = max_new_tokens
            new = torch.full((ids.shape[0], max_new_tokens), 5)
            return SimpleNamespace(sequences=torch.cat([ids, new], 1), logprobs=torch.zeros(new.shape),
                                   stats=SimpleNamespace(decode_tokens_per_s=1.0))

    model = tiny_model("llama", eos_token_id=1, pad_token_id=0)
    model.generation_config.eos_token_id = 1

    def trainer(gk, **kw):
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2,
                          per_device_train_batch_size=2, max_completion_length=8, rollout="specontext",
                          vllm_importance_sampling_mode="token_truncate", generation_kwargs=gk, **kw)
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                           train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}),
                           processing_class=_char_tokenizer())

    import kvtransform

    draft = tmp_path / "draft"  # a directory (the config refuses a missing one); the transform is faked below
    draft.mkdir()

    def refuse(model, cfg, **kw):  # what the transform says for a head without its weights (CLI key names)
        seen["retrieval"], seen["compile"] = cfg.retrieval, cfg.compile
        raise ValueError("head=eagle3 needs the draft: transform.retrieval=<EAGLE-3 checkpoint directory>")

    monkeypatch.setattr(kvtransform, "transform", refuse)
    with pytest.raises(ValueError) as e:  # the fix it names is one this config has (it named the CLI's keys)
        trainer({}, rollout_head="eagle3", rollout_retrieval=str(draft), rollout_compile=True)
    assert seen["retrieval"] == str(draft) and seen["compile"] is True and str(e.value).endswith(
        "rollout_head=eagle3 needs the draft: rollout_retrieval=<EAGLE-3 checkpoint directory>")
    monkeypatch.setattr(GRPOTrainer, "_build_rollout", lambda self: FakeRollout())
    ids, lps = trainer({"max_new_tokens": 3})._generate_single_turn([[3, 4], [5]], None, {}, 1)
    assert seen["max_new_tokens"] == 3 and [len(c) for c in ids] == [3, 3] and [len(x) for x in lps] == [3, 3]
    with pytest.raises(ValueError, match="rollout_compile: compile must be true or false; got 'yes'"):
        trainer({}, rollout_compile="yes")
    import logging

    with caplog.at_level(logging.WARNING, logger="kvtransform.integrations.trl"):  # set but unused: said
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", rollout_budget=512)
    assert "rollout_budget=512 has no effect without rollout='specontext'" in caplog.text
    for gk, msg in (({"eos_token_id": [7]}, "drop it from generation_kwargs"),
                    ({"temperature": 0.0}, "temperature must be a finite number > 0"),  # was: at the first rollout
                    ({"top_p": 0.0}, "top_p must be in")):
        with pytest.raises(ValueError, match=msg) as e:
            trainer(gk)
        assert "\n" not in str(e.value)


def test_rollout_mismatch_refuses_an_unwritable_out_before_the_run(tmp_path):
    """``out`` naming a file (or a path under one) is refused before the model loads, in one line naming the fix
    (it used to fail with ``[Errno 17] File exists`` after the whole decode); a new nested directory passes and
    nothing is created by the check."""
    from omegaconf import OmegaConf

    from kvtransform.rollout_mismatch import RolloutMismatchConfig, run_rollout_mismatch
    from kvtransform.utils import check_results_dir

    f = tmp_path / "a_file"
    f.write_text("x")
    for out in (f, f / "sub"):
        cfg = OmegaConf.structured(RolloutMismatchConfig(head=["self"], budget=[4], lengths=[4], prompt=8,
                                                         documents=["argparse.py"], out=str(out)))
        cfg.model = "no-such-model-is-loaded"
        with pytest.raises(ValueError, match="choose another out=") as e:
            run_rollout_mismatch(cfg)
        assert "\n" not in str(e.value)
    check_results_dir(tmp_path / "new" / "deep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    for empty in ("", "  ", None):  # (was the current directory, reported as "Wrote /results.csv")
        with pytest.raises(ValueError, match=r"^out_dir is empty: give the directory for the results"):
            check_results_dir(empty, "out_dir")


def test_tiny_model_refuses_an_override_no_layer_reads():
    """A misspelt or foreign config field (``sliding_windw``; Mistral has no ``use_sliding_window``) used to build a
    model without it, silently; real fields (head_dim on any family, Qwen2's window switch) still pass."""
    from kvtransform.models import tiny_model

    for family, kw in (("mistral", {"sliding_windw": 4}), ("mistral", {"use_sliding_window": True}),
                       ("qwen3_moe", {"max_window_layers": 1})):
        with pytest.raises(ValueError, match="has no field") as e:
            tiny_model(family, **kw)
        assert "\n" not in str(e.value)
    model = tiny_model("qwen2", head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert model.model.layers[0].self_attn.head_dim == 8 and model.config.layer_types[0] == "sliding_attention"


def test_enable_refuses_what_the_packed_ops_cannot_compute():
    """Gemma 3 with ``use_bidirectional_attention`` (EmbeddingGemma): the packed ops are causal, so ``enable`` used to
    accept it and change every logit silently (0.25 on the tiny model); now the one line ``kvt.transform`` gives.
    A head_dim above the ops' 256 is refused at ``enable`` (TRL's construction) instead of at the first forward."""
    from kvtransform.integrations.transformers import enable
    from kvtransform.models import tiny_model

    with pytest.raises(ValueError, match="non-causal") as e:
        enable(tiny_model("gemma3", use_bidirectional_attention=True), "dualkv")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unsupported head_dim 258") as e:  # at enable(), not the first packed call
        enable(tiny_model("gemma3", head_dim=258), "dualkv")
    assert "\n" not in str(e.value)


_LONGROPE = dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                  "long_factor": [1.0 + 3 * i for i in range(8)],
                                  "original_max_position_embeddings": 32})


def test_longrope_capture_leaves_no_fake_tensor_in_the_model():
    """transformers' longrope RoPE (Phi-3-128k / 3.5) caches ``long_inv_freq`` on the rotary module during the
    forward: under torch.export that was a fake tensor left in the user's model, and the next export (SpeContext's
    second capture, or any second transform) failed ("fake mode ... doesn't match"). SpeContext on a fresh model now
    decodes HF's greedy tokens past the 32-token switch to the long factors."""
    import inspect

    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import modeling_rope_utils

    from kvtransform.capture import CaptureError

    m = kvt.tiny_model("phi3", **_LONGROPE)
    if "if seq_len > original_max_position_embeddings" in inspect.getsource(modeling_rope_utils):
        # transformers before ~5.2x branches on a tensor's value in Python: refused in one line, naming where
        with pytest.raises(CaptureError, match=r"data-dependent control flow .* in longrope_frequency_update"):
            kvt.transform(m, kvt.SpeContextConfig(budget=128), progress=False)
        return
    sp = kvt.transform(m, kvt.SpeContextConfig(budget=128), progress=False)
    assert not isinstance(getattr(m.model.rotary_emb, "long_inv_freq", None), FakeTensor)
    kvt.transform(m, "canonical", progress=False)  # a second transform of the same model
    row = torch.randint(3, m.config.vocab_size, (27,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.generate(row[None], max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(sp.generate(row[None], max_new_tokens=12, eos_token_id=None), want)


def test_canonical_with_nothing_rewritten_is_refused_in_one_line(monkeypatch):
    """A canonical module that rewrote no attention would only re-run the model while its report claims a rewrite."""
    import kvtransform.passes.attention as attention_pass

    monkeypatch.setattr(attention_pass, "find_attention", lambda gm: [])
    with pytest.raises(ValueError, match=r"the canonical transform rewrote no attention of LlamaForCausalLM: no "
                                         r"attention found .*kvt.inspect\(model\)"):
        kvt.transform(kvt.tiny_model("llama"), "canonical", progress=False)


def test_a_negative_soft_cap_is_its_absolute_value():
    """``c · tanh(s / c)`` with ``c < 0`` (a config HF accepts) is the cap ``|c|``: the matcher rewrites it (it used to
    match nothing, and canonical returned an unrewritten module); enable() still refuses the config value by name."""
    m = kvt.tiny_model("gemma2", attn_logit_softcapping=-5.0)
    opt = kvt.transform(m, "canonical", progress=False)  # verified against the model by the gate
    assert [s.softcap for s in opt.report.sites] == [5.0] * m.config.num_hidden_layers
    with pytest.raises(ValueError, match="softcap must be a finite float > 0"):
        kvt.integrations.transformers.enable(kvt.tiny_model("gemma2", attn_logit_softcapping=-5.0), "dualkv")


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_enable_refuses_a_zero_sliding_window(family):
    """A ``sliding_window`` of 0 (a degenerate window HF applies) is refused at enable() as for Gemma 2 / gpt-oss,
    not at the first packed forward."""
    with pytest.raises(ValueError, match="window must be a pos"):
        kvt.integrations.transformers.enable(kvt.tiny_model(family, sliding_window=0), "dualkv")


def test_a_window_as_long_as_the_positions_is_not_probed_at_its_length():
    """The mask proof probes a window past its length only (at ``window`` tokens a window mask is causal), so a
    window equal to max_position_embeddings costs no (window, window) probe."""
    from kvtransform.passes.manager import PassContext
    from kvtransform.passes.mask_proof import probe_lengths

    ctx = PassContext.__new__(PassContext)
    ctx.config, ctx.max_seq_len = kvt.tiny_model("mistral", sliding_window=8).config, 4096
    assert probe_lengths(ctx) == [2, 3, 5, 9, 10, 17, 64]
    ctx.max_seq_len = 8  # (a short max_seq_len is probed itself)
    assert probe_lengths(ctx) == [2, 3, 5, 8]
    ctx.max_seq_len = 2048
    ctx.config = kvt.tiny_model("mistral", sliding_window=2048).config
    assert probe_lengths(ctx) == [2, 3, 5, 17, 64]


@pytest.mark.parametrize("model_type,config", [
    ("gpt2", dict(n_layer=1, n_embd=32, n_head=4)),
    ("phi", dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64))])
def test_auto_head_where_the_self_head_cannot_bind_is_quest(model_type, config):
    """head='auto' (the default; TRL's rollout_head default) picks quest where the self head cannot bind: GPT-2 (its
    embedding is wte, not embed_tokens: the packaged-head lookup failed with "no parameter named
    '*embed_tokens.weight'") and Phi-2 (LayerNorm inputs: 'self' was picked, and its bind refused "cannot reproduce
    layer 0's input norm", a head the user never chose). Quest decodes HF's greedy tokens when the budget covers the
    context; a Llama still gets 'self'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtransform.runtime.distilled import auto_head

    torch.manual_seed(0)  # (fixed weights)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, bos_token_id=1,
                                                              eos_token_id=1, **config)).eval()  # (no dropout)
    sp = kvt.transform(m, kvt.SpeContextConfig(budget=64), progress=False)
    assert sp.runtime.head.name == "quest"
    row = torch.randint(3, 60, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.generate(row, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(sp.generate(row, max_new_tokens=6, eos_token_id=None), want)
    assert auto_head(kvt.tiny_model("llama")) == "self"


def test_a_model_whose_capture_fixes_the_length_is_one_line():
    """RecurrentGemma's recurrent blocks make torch.export fix the sequence length by a guard (the size stays a
    SymInt equal to a number): refused at capture in one line, not a 'Guard failed' assertion at the first call."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    cfg = RecurrentGemmaConfig(num_hidden_layers=2, vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, lru_width=64, attention_window_size=16,
                               block_types=["recurrent", "attention"])
    torch.manual_seed(0)
    model = RecurrentGemmaForCausalLM(cfg).eval()
    with pytest.raises(RuntimeError, match="specialised dimension 1 of input_ids for RecurrentGemmaForCausalLM"):
        kvt.transform(model, "canonical", progress=False)


def test_a_trajectory_past_learned_positions_is_one_line():
    """GPT-2 has a learned position table (config.n_positions): a packed trajectory longer than it is refused in
    one line by the DualKV module and by enable(), not an IndexError from inside the embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, attn_pdrop=0,
                                       resid_pdrop=0, embd_pdrop=0, bos_token_id=0, eos_token_id=0)).eval()
    opt = kvt.transform(model, kvt.DualKVConfig(verify=kvt.VerifyConfig(enabled=False)), progress=False)
    g = torch.Generator().manual_seed(0)
    fits = kvt.pack_shared_prefix(torch.randint(0, 64, (10,), generator=g),
                                  [torch.randint(0, 64, (n,), generator=g) for n in (6, 3)])
    past = kvt.pack_shared_prefix(fits.input_ids[0, :10], [torch.randint(0, 64, (n,), generator=g) for n in (7, 3)])
    opt(fits)
    kvt.integrations.transformers.enable(model, "dualkv")
    try:
        for run in (opt, lambda b: model(**kvt.integrations.transformers.packed_inputs(b))):
            with pytest.raises(ValueError, match="16 learned positions and a trajectory of this packed batch has 17"):
                run(past)
    finally:
        kvt.integrations.transformers.disable(model)


def test_multi_head_latent_attention_runs_dualkv_exactly_and_is_refused_by_specontext():
    """DeepSeek-V3's attention (value heads of ``v_head_dim`` against query/key heads of ``qk_nope_head_dim +
    qk_rope_head_dim``) failed inside the DualKV op ("k and v must have the same shape"): the pass pads the values
    (or, wider, q and k) with zero columns, exact under the numerics rule for both batch kinds and both orders of the
    two dims. SpeContext failed in transformers' cache update during the capture: refused in one line naming both
    dims."""
    import transformers

    from kvtransform.verify import check_numerics_rule

    def deepseek(v_head_dim):
        cfg = transformers.DeepseekV3Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=v_head_dim, vocab_size=128)
        torch.manual_seed(0)
        return transformers.DeepseekV3ForCausalLM(cfg).eval()

    for v_head_dim in (12, 40):
        m = deepseek(v_head_dim)
        dk = kvt.transform(m, "dualkv", progress=False)
        assert dk.report.pass_record("dualkv").rewritten == 2
        for batch in (kvt.pack_shared_prefix([1, 2, 3, 4, 5], [[6, 7], [8, 9, 10]]),
                      kvt.pack_trajectories([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9]])):
            assert check_numerics_rule(m, dk, batch)["passed"]
    with pytest.raises(ValueError, match="value heads of 40 and query/key heads of 24 .* use the canonical or DualKV"):
        kvt.transform(m, kvt.SpeContextConfig(budget=16), progress=False)


def test_specontext_gate_verifies_longrope_lengths_on_their_own():
    """LongRoPE picks its long factors from a call's longest row (transformers' dynamic_rope_update), so the gate's
    ragged batch of 9 and 37 tokens gave the 9-token row the long factors while the reference ran it alone with the
    short ones: a 2e-2 error and a VerificationError advising a larger tolerance. Each length runs on its own for such
    RoPE now, and the gate passes at the fp32 tolerance."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
            "short_factor": [1 + 0.1 * i for i in range(8)], "long_factor": [2 + 0.5 * i for i in range(8)]}
    m = kvt.tiny_model("llama", rope_parameters=rope)
    sp = kvt.transform(m, kvt.SpeContextConfig(budget=256, head="quest"), progress=False)
    v = sp.report.verification
    assert v.passed and v.max_rel_error < 1e-5 and [c["name"] for c in v.cases] == ["len9+3", "len37+3"]


def test_default_eos_is_the_generation_configs_as_in_transformers():
    """eos_token_id='default' fell back to config.eos_token_id where the generation config sets none, so generate
    stopped where transformers' generate never does; the model config's EOS is used only without a generation
    config."""
    from kvtransform.runtime.outputs import ModelInfo

    m = kvt.tiny_model("llama")
    assert ModelInfo.from_model(m, 64).eos_token_id == [2]
    m.generation_config.eos_token_id = None
    assert m.config.eos_token_id == 2 and ModelInfo.from_model(m, 64).eos_token_id == []
    m.generation_config = None
    assert ModelInfo.from_model(m, 64).eos_token_id == [2]


def test_specontext_captures_dynamic_ntk_rope_within_the_models_positions():
    """SpeContext refused dynamic-NTK RoPE ("this capture needs an unbounded position axis"), yet its prefill restarts
    positions per prompt and generate keeps prompt + new tokens within the model's positions, where dynamic NTK is
    plain RoPE: captured, verified, and greedy tokens equal transformers' generate. DualKV still refuses it."""
    m = kvt.tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    sp = kvt.transform(m, kvt.SpeContextConfig(budget=512, head="quest"), progress=False)
    assert sp.report.verification.passed
    ids = torch.randint(3, 120, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert torch.equal(sp.generate(ids, max_new_tokens=8, eos_token_id=None), want)
    with pytest.raises(RuntimeError, match="dynamic-NTK RoPE"):
        kvt.transform(m, "dualkv", progress=False)
