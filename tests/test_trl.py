"""kvtransform.integrations.trl: TRL's GRPOTrainer with shared-prefix log-prob passes and SpeContext rollouts, checked
against the stock trl.GRPOTrainer on a tiny random Llama (fp32) with a character tokenizer built in memory."""
import logging

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl", reason="the trl extra (pip install kvtransform[trl])")

from kvtransform.integrations.trl import GRPOConfig, GRPOTrainer  # noqa: E402
from kvtransform.integrations.trl_packing import plan_packing  # noqa: E402

PROMPTS = ["hello wor", "the cat", "abc d", "xyz q"]
EOS, PAD = 1, 0


def _char_tokenizer():
    """Printable ASCII, one token per character (ids 2..96), ``<pad>`` 0 and ``<eos>`` 1: no files, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{chr(c): c - 30 for c in range(32, 127)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def _save_tiny(tmp_path_factory, family: str, **overrides) -> str:
    """A tiny model (2 layers, vocab 128) and the character tokenizer, saved (TRL loads its reference model by
    path)."""
    from kvtransform.models import tiny_model

    path = tmp_path_factory.mktemp(f"tiny-trl-{family}")
    model = tiny_model(family, seed=0, eos_token_id=EOS, pad_token_id=PAD, **overrides)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    model.save_pretrained(path)
    _char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _save_tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="module")
def tiny_window_dir(tmp_path_factory):
    """Mistral with a 4-token sliding window: shorter than every prompt + completion of the tests."""
    return _save_tiny(tmp_path_factory, "mistral", sliding_window=4)


def _reward(completions, **kw):
    return [float(c.count("a")) + 0.1 * len(c) for c in completions]


def _fixed_completions(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """Completions of 1-8 tokens, a third ending in EOS (the same for every trainer: seeded by the batch size)."""
    g = torch.Generator().manual_seed(len(prompt_ids))
    out = []
    for i in range(len(prompt_ids)):
        c = torch.randint(2, 97, (int(torch.randint(1, 9, (), generator=g)),), generator=g).tolist()
        if i % 3 == 0:
            c[-1] = EOS
        out.append(c)
    return out, None


def _trainer(cls, path, dtype=torch.float32, peft_config=None, **kw):
    from datasets import Dataset
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    args = (GRPOConfig if cls is GRPOTrainer else trl.GRPOConfig)(**{**dict(
        output_dir=f"{path}/out", per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        use_cpu=True, bf16=False, report_to="none", seed=0, save_strategy="no", model_init_kwargs={"dtype": dtype}),
        **kw})
    return cls(model=path, reward_funcs=_reward, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
               processing_class=AutoTokenizer.from_pretrained(path), peft_config=peft_config)


def _one_step(cls, path, dtype=torch.float32, peft_config=None, **kw):
    """One GRPO step on fixed completions: (loss, the batch TRL built (old / ref log-probs), every gradient)."""
    tr = _trainer(cls, path, dtype, peft_config, **kw)
    tr._generate_single_turn = _fixed_completions.__get__(tr)
    tr.model.train()  # what Trainer.train() sets before its first step
    tr.current_gradient_accumulation_steps = 1
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    loss = tr.compute_loss(tr.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in tr.model.named_parameters() if p.grad is not None}
    return loss.detach(), inputs, grads


def _rel(x, ref):
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])


@pytest.mark.parametrize("setup", ["full", "lora+checkpointing", "sliding-window", "tree"])
def test_shared_prefix_step_matches_stock_trainer(request, setup, caplog, monkeypatch):
    """One step with shared_prefix=True against stock trl.GRPOTrainer on the same completions and rewards: loss,
    old-policy and reference log-probs and every gradient within the numerics rule (as
    kvtransform.verify.check_numerics_rule: ``err(ours) <= 2 err(stock) + 1e-5``, each error relative to the same
    trainer run in float64 -- TRL's fused LM head works in float32 even then)."""
    kw = dict(beta=0.1, num_iterations=2)  # a reference model pass and an old-policy pass, both packed
    tiny_dir = request.getfixturevalue("tiny_window_dir" if setup == "sliding-window" else "tiny_dir")
    peft, mode = None, True
    trees = []
    if setup == "tree":  # prompts sharing a system prefix: one prefix tree across the groups
        import kvtransform.integrations.trl as kvt_trl

        mode = "tree"
        monkeypatch.setitem(globals(), "PROMPTS", ["sys> " + p for p in PROMPTS])
        monkeypatch.setattr(kvt_trl, "pack_chunk_tree", lambda *a, f=kvt_trl.pack_chunk_tree: trees.append(
            f(*a)) or trees[-1])
    if setup == "lora+checkpointing":
        kw["gradient_checkpointing"] = True
        peft = _lora()
    with caplog.at_level(logging.WARNING, logger="kvtransform.integrations.trl"):
        ours = _one_step(GRPOTrainer, tiny_dir, peft_config=peft, shared_prefix=mode, **kw)
    assert not [r for r in caplog.records if "unpacked" in r.getMessage()]  # every pass packed
    if setup == "tree":  # three passes (policy, old policy, reference), each one tree sharing "sys> " across prompts
        assert len(trees) >= 3 and all(t[0].layout.num_trees == 1 and t[0].num_tokens < t[0].replicated_tokens
                                       for t in trees)
    stock = _one_step(trl.GRPOTrainer, tiny_dir, peft_config=peft, **kw)
    ref = _one_step(trl.GRPOTrainer, tiny_dir, torch.float64, peft_config=peft, **kw)
    pairs = [("loss", ours[0], stock[0], ref[0])]
    pairs += [(k, ours[1][k], stock[1][k], ref[1][k]) for k in ("old_per_token_logps", "ref_per_token_logps")]
    assert ours[2].keys() == stock[2].keys() and len(ours[2]) >= 4
    pairs += [(n, ours[2][n], stock[2][n], ref[2][n]) for n in ours[2]]
    for name, a, b, r in pairs:
        assert _rel(a, r) <= 2 * _rel(b, r) + 1e-5, (name, _rel(a, r), _rel(b, r))
    assert torch.equal(ours[1]["completion_mask"], stock[1]["completion_mask"])


def test_unpackable_batch_runs_trl_pass_and_says_so_once(tiny_dir, caplog):
    """Rows without a shared prompt do not pack: TRL's own pass runs (same numbers) and the log says why, once."""
    tr = _trainer(GRPOTrainer, tiny_dir, shared_prefix=True)
    ids = torch.randint(2, 97, (3, 9))  # prompts of 5 columns, completions of 4
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    assert plan_packing(ids, mask, 4)[1].startswith("no two rows share a prompt (a micro-batch holds at most one")
    same = ids.clone()
    same[2, :5] = same[0, :5]
    plan, why = plan_packing(same, mask, 4)
    assert why == "" and [rows for _, rows in plan.chunks[0]] == [[0, 2], [1]]
    assert [[rows for _, rows in c] for c in plan_packing(same, mask, 4, batch_size=2)[0].chunks] == [[[0, 2]], [[1]]]
    hole = mask.clone()
    hole[0, 3] = 0
    assert plan_packing(same, hole, 4)[1] == "the prompt mask is not left padding"
    hole = mask.clone()
    hole[0, 6] = 0
    assert plan_packing(same, hole, 4)[1].startswith("a completion mask is not a prefix of ones")
    with caplog.at_level(logging.WARNING, logger="kvtransform.integrations.trl"), torch.no_grad():
        got = [tr._get_per_token_logps_and_entropies(tr.model, ids, mask, 4)[0] for _ in range(2)]
        want = trl.GRPOTrainer._get_per_token_logps_and_entropies(tr, tr.model, ids, mask, 4)[0]
    assert torch.equal(got[0], want)
    fractions = lambda: [v for m in tr._metrics.values() for v in m.get("shared_prefix/token_fraction", [])]  # noqa
    assert fractions() == [1.0, 1.0]  # logged: TRL's own pass, all of its padded tokens
    with torch.no_grad():
        tr._get_per_token_logps_and_entropies(tr.model, same, mask, 4)
    # rows 0 and 2 share a 5-token prompt: its first 4 tokens + completion segments of 4 and 2; row 1: 2 + 4
    assert fractions()[-1] == ((4 + 4 + 2) + (2 + 4)) / same.numel()
    (msg,) = [r.getMessage() for r in caplog.records if "unpacked" in r.getMessage()]
    assert msg.startswith("shared_prefix: a batch runs unpacked (TRL's own pass): no two rows share a prompt") and \
        "per_device_train_batch_size to num_generations or more" in msg


@pytest.mark.parametrize("kw,msg", [
    (dict(rollout="vllm"), "rollout must be None"),
    (dict(rollout_budget=2.0), "rollout_budget must be an integer >= 1"),
    (dict(rollout="specontext", use_vllm=True), "set use_vllm=False"),
    (dict(rollout="specontext", repetition_penalty=1.1), "temperature / top_k / top_p only"),
    (dict(rollout="specontext", generation_kwargs={"num_beams": 2}), "does not take generation_kwargs ['num_beams']"),
    (dict(rollout="specontext", rollout_head="nope"), "rollout_budget / rollout_head"),
    (dict(rollout_budget=0), "rollout_budget must be an integer >= 1"),
    (dict(shared_prefix="trees"), "shared_prefix must be True, False or 'tree'; got 'trees'"),
    (dict(shared_prefix=2), "shared_prefix must be True, False or 'tree'; got 2"),
    (dict(shared_prefix=1.0), "shared_prefix must be True, False or 'tree'; got 1.0"),
    (dict(shared_prefix=np.array([True, False])), "shared_prefix must be True, False or 'tree'"),
    (dict(rollout="specontext", generation_kwargs={"num_beams": 1, "use_cache": False}),
     "does not take generation_kwargs ['use_cache']"),
    (dict(rollout="specontext", generation_kwargs={"num_beams": np.array([1, 1])}),
     "does not take generation_kwargs ['num_beams']"),
    (dict(rollout="specontext", rollout_head="self", rollout_retrieval="/tmp"),
     "rollout_head='self' does not read: set rollout_head=distilled"),
    (dict(rollout="specontext", rollout_head="distilled", rollout_retrieval="/no/such/dir"), "is not a directory"),
    (dict(shared_prefix="tree", use_transformers_continuous_batching=True), "shared_prefix='tree' switches"),
])
def test_config_refusals_are_one_line(tmp_path, kw, msg):
    with pytest.raises(ValueError) as e:
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2,
                   per_device_train_batch_size=2, **kw)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv,want", [([], False), (["--shared_prefix", "tree"], "tree"),
                                       (["--shared_prefix", "true"], True), (["--shared_prefix", "no"], False),
                                       (["--shared_prefix"], True), (["--shared_prefix", "TREE"], "tree")])
def test_shared_prefix_from_the_command_line(tmp_path, argv, want):
    """TRL's own parser (a script's ``--shared_prefix tree``, or the same key in a YAML config) gives the three
    settings a Python caller has."""
    from trl import TrlParser

    (cfg,) = TrlParser(GRPOConfig).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--num_generations", "2",
         "--per_device_train_batch_size", "2"] + argv)
    assert cfg.shared_prefix == want and type(cfg.shared_prefix) is type(want)


@pytest.mark.parametrize("argv,want", [([], None), (["--rollout", "none"], None), (["--rollout", "None"], None),
                                       (["--rollout", "SpeContext"], "specontext")])
def test_rollout_from_the_command_line(tmp_path, argv, want):
    """A command line (or YAML) spells rollout=None as a string: 'none' in any case is TRL's own generation (it was
    refused with "rollout must be None ... got 'None'"); a NumPy integer budget is a budget."""
    import numpy as np
    from trl import TrlParser

    (cfg,) = TrlParser(GRPOConfig).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--num_generations", "2",
         "--per_device_train_batch_size", "2"] + argv)
    assert cfg.rollout == want
    cfg = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2,
                     per_device_train_batch_size=2, rollout_budget=np.int64(64))
    assert cfg.rollout_budget == 64 and type(cfg.rollout_budget) is int
    cfg = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2,
                     per_device_train_batch_size=2, rollout="SpeContext", rollout_head=" AUTO")
    assert cfg.rollout_head == "auto"  # head names are case-insensitive as rollout's and shared_prefix's
    # 0 / 1 (a JSON config) and NumPy's bool are the booleans; generation_kwargs at values that change nothing
    for value, want in ((1, True), (0, False), (np.bool_(True), True), (" 1 ", True)):
        cfg = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2,
                         per_device_train_batch_size=2, shared_prefix=value)
        assert cfg.shared_prefix is want
    GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=2,
               per_device_train_batch_size=2, rollout="specontext", generation_kwargs={"num_beams": 1})


def test_sequence_level_correction_with_sparse_rollouts_is_warned_once():
    """A rollout whose prompt + new tokens pass the budget is sparse: TRL's sequence-level correction is warned about
    once (it masks most long sparse rollouts, docs/ROLLOUT_MISMATCH.md); token_truncate, the correction switched
    off, or a context within the budget is not (the check once read TRL's absent max_prompt_length and warned for
    every budget)."""
    from types import SimpleNamespace
    from unittest import mock

    import kvtransform.integrations.trl as trl_integration

    def warned(context, **kw):
        said = []
        args = SimpleNamespace(**{"rollout_budget": 64, "vllm_importance_sampling_mode": "sequence_mask",
                                  "vllm_importance_sampling_correction": True, **kw})
        me = SimpleNamespace(args=args, _kvt_said=set())
        me._say_once = lambda what, key=None: GRPOTrainer._say_once(me, what, key)
        for extra in (0, 0, 1, 7):  # rollouts of other lengths: still once (the length is in the message)
            with mock.patch.object(trl_integration.logger, "warning", side_effect=said.append):
                GRPOTrainer._warn_sequence_weights(me, context + extra)
        return said

    (msg,) = warned(65)
    assert "rollouts of up to 65 tokens pass rollout_budget=64" in msg and "token_truncate" in msg
    assert not warned(64 - 7) and not warned(10 ** 6 - 7, rollout_budget=10 ** 6)
    assert not warned(65, vllm_importance_sampling_mode="token_truncate")
    assert not warned(65, vllm_importance_sampling_correction=False)


def test_models_packing_cannot_match_are_refused_or_run_unpacked():
    """Three families TRL trains that the packed passes would silently change: a model whose attention bypasses
    transformers' interface (Falcon: each packed row attended across its segments) is refused by enable(); attention
    dropout in training is refused at construction (it failed mid-step); learned absolute positions that TRL numbers
    from the first left pad (GPT-2; log-probs off by 0.26) make left-padded batches run TRL's own pass."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtransform.integrations.transformers import enable
    from kvtransform.integrations.trl import _check_no_attention_dropout, _pads_shift_positions
    from kvtransform.models import tiny_model

    def hf(family, **kw):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, vocab_size=64, **kw))

    falcon = hf("falcon", num_hidden_layers=1, hidden_size=32, num_attention_heads=4)
    with pytest.raises(ValueError, match="FalconForCausalLM runs its own attention code"):
        enable(falcon, "dualkv")
    with pytest.raises(ValueError, match=r"applies attention dropout 0.1 .* load the model with attention_dropout=0 in "
                                         r"its config"):
        _check_no_attention_dropout(tiny_model("llama", attention_dropout=0.1))
    gpt2 = hf("gpt2", n_layer=1, n_embd=32, n_head=4)
    with pytest.raises(ValueError, match=r"attention dropout 0.1 .*attn_dropout\), .*: set disable_dropout=True"):
        _check_no_attention_dropout(gpt2)
    from trl.trainer.utils import disable_dropout_in_model

    disable_dropout_in_model(gpt2)
    _check_no_attention_dropout(gpt2)  # TRL's disable_dropout zeroes GPT-2's attention dropout
    assert _pads_shift_positions(gpt2) and gpt2.training  # (the probe leaves the mode as it was)
    assert not _pads_shift_positions(tiny_model("llama"))  # RoPE
    assert not _pads_shift_positions(hf("opt", num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                        ffn_dim=64, word_embed_proj_dim=32))  # positions numbered by the mask
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 9], [3, 5, 6, 7, 2]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert plan_packing(ids, mask, 2)[0] is not None
    plan, why = plan_packing(ids, mask, 2, left_padding=False)
    assert plan is None and "left padding moves this model's learned absolute positions" in why
    assert plan_packing(ids[2:], mask[2:], 2, trees=True, left_padding=False)[0] is not None


def test_trainer_refusals(tiny_dir, monkeypatch):
    """Greedy rollouts at a temperature other than 1, and a model the transform cannot capture: one line each,
    at construction."""
    import kvtransform

    with pytest.raises(ValueError, match="greedy decoding reports temperature-1 log-probs"):
        _trainer(GRPOTrainer, tiny_dir, rollout="specontext", temperature=0.7,
                 generation_kwargs={"do_sample": False})

    def refuse(model, cfg, **kw):
        raise ValueError("layer 0 attention: sliding window 8 is not causal attention over the cache\nmore")

    # a model object without a name to load a tokenizer from (kvt.tiny_model) and no processing_class
    with pytest.raises(ValueError, match="no name_or_path to load its tokenizer from .* pass processing_class="):
        GRPOTrainer(model=kvtransform.tiny_model("llama"), reward_funcs=lambda completions, **k: [0.0],
                    args=GRPOConfig(output_dir=f"{tiny_dir}/out", use_cpu=True, bf16=False, report_to="none"),
                    train_dataset=[])

    monkeypatch.setattr(kvtransform, "transform", refuse)
    with pytest.raises(ValueError) as e:
        _trainer(GRPOTrainer, tiny_dir, rollout="specontext")
    assert str(e.value) == ("rollout='specontext' cannot transform LlamaForCausalLM: layer 0 attention: sliding "
                            "window 8 is not causal attention over the cache")

    def no_head(model, cfg, **kw):  # the runtime's message names the CLI's and SpeContextConfig's keys
        raise FileNotFoundError(f"{tiny_dir} is not a distilled retrieval head: train one with `kvtransform "
                                f"distill-retrieval-head MODEL out={tiny_dir}`, or use retrieval=self; head=eagle3")

    monkeypatch.setattr(kvtransform, "transform", no_head)
    with pytest.raises(ValueError, match=r"or use rollout_retrieval=self; rollout_head=eagle3$"):
        _trainer(GRPOTrainer, tiny_dir, rollout="specontext")


def test_specontext_rollout_lora_greedy_equals_stock_and_follows_live_weights(tiny_dir):
    """rollout='specontext' with a budget >= every sequence, greedy, LoRA: the completions are the stock trainer's
    (HF generate on the same model), the importance weights TRL computes are 1, and an in-place update of the
    adapters reaches the next rollout (no copy); a replaced parameter makes the trainer transform again."""
    tr = _trainer(GRPOTrainer, tiny_dir, peft_config=_lora(), shared_prefix=True, rollout="specontext",
                  rollout_budget=64, generation_kwargs={"do_sample": False}, vllm_importance_sampling_mode="token_truncate")
    prompt_ids = [tr._tokenizer(p)["input_ids"] for p in PROMPTS]

    def both():
        ours = tr._generate_single_turn(prompt_ids, None, {}, 1)
        tr.use_vllm = False  # the stock path (HF generate); ours set it to get TRL's importance-sampling correction
        try:
            stock = trl.GRPOTrainer._generate_single_turn(tr, prompt_ids, None, {}, 1)
        finally:
            tr.use_vllm = True
        return ours, stock

    (ours, lps), (stock, _) = both()
    assert ours == stock and all(len(c) == 8 for c in ours) and all(len(c) == len(lp) for c, lp in zip(ours, lps))
    inputs = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    m = inputs["completion_mask"].bool()
    assert (inputs["sampling_per_token_logps"] - inputs["old_per_token_logps"])[m].abs().max() < 1e-5
    assert (inputs["importance_sampling_ratio"][m] - 1).abs().max() < 1e-4
    # sampled rollouts: each token's log-prob is that of the warped distribution it was drawn from
    ids = torch.tensor([[0, 0] + prompt_ids[0][:5], prompt_ids[1][:7]])
    am = (ids != PAD).long()
    out = tr._kvt_rollout.generate(ids, am, max_new_tokens=6, do_sample=True, temperature=0.7, top_k=20, seed=3,
                                   eos_token_id=None, return_dict_in_generate=True, output_logprobs=True)
    seq, full = out.sequences, torch.cat([am, torch.ones(2, 6, dtype=am.dtype)], 1)
    with torch.no_grad():
        lg = tr._kvt_base()(seq, attention_mask=full, position_ids=(full.cumsum(1) - 1).clamp(min=0)).logits
    lg = lg[:, 6:-1] / 0.7
    lg = lg.masked_fill(lg < lg.topk(20, dim=-1).values[..., -1:], -float("inf"))
    want = torch.log_softmax(lg, -1).gather(-1, seq[:, 7:, None])[..., 0]
    assert out.logprobs.shape == (2, 6) and (out.logprobs - want).abs().max() < 1e-4
    lora = [p for n, p in tr.model.named_parameters() if "lora_" in n]
    with torch.no_grad():
        for p in lora:
            p.add_(torch.randn_like(p))  # an optimizer step's kind of update: in place
    (after, _), (stock_after, _) = both()
    assert after == stock_after and after != ours
    tr.args.max_steps, tr.args.logging_steps = 1, 1
    tr.train()  # one whole TRL step: accelerate's prepare, the rollout, packed passes, the correction, the update
    logged = tr.state.log_history[0]
    assert abs(logged["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4 and logged["rollout/decode_tokens_per_s"] > 0
    old = tr._kvt_rollout
    tr._kvt_base().lm_head.weight = torch.nn.Parameter(tr._kvt_base().lm_head.weight.detach().clone())
    tr._rollout_module()  # transformed for real again, the policy under enable() (shared_prefix) included
    assert tr._kvt_rollout is not old and tr._kvt_base().config._attn_implementation == "kvt_dualkv"
    (again, _), (stock_again, _) = both()
    assert again == stock_again == after


def test_sampler_logprobs_are_those_of_the_drawn_distribution():
    """The runtime's sampler with logprobs: the warped (temperature, top-k, top-p) log_softmax at the drawn token;
    greedy: the raw log_softmax at the argmax; an overflowing temperature row: 0 (its point mass)."""
    from kvtransform.runtime.sampling import _sampler

    logits = torch.randn(5, 50) * 3
    tok, lp = _sampler(True, 0.7, 10, 0.9, 0, "cpu", logprobs=True)(logits)
    scores = logits / 0.7
    scores = scores.masked_fill(scores < scores.topk(10, -1).values[:, -1:], -float("inf"))
    probs = torch.softmax(scores, -1)
    srt, idx = probs.sort(-1, descending=True)
    drop = (srt.cumsum(-1) - srt) > 0.9  # outside the top-p nucleus
    scores = scores.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), -float("inf"))
    assert torch.allclose(lp, torch.log_softmax(scores, -1).gather(1, tok[:, None])[:, 0], atol=1e-5)
    assert torch.isfinite(lp).all() and torch.equal(tok, _sampler(True, 0.7, 10, 0.9, 0, "cpu")(logits))
    tok, lp = _sampler(False, 1.0, None, None, None, "cpu", logprobs=True)(logits)
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).max(-1).values)
    tok, lp = _sampler(True, 1e-38, None, None, 0, "cpu", logprobs=True)(logits)
    assert torch.equal(tok, logits.argmax(-1)) and torch.equal(lp, torch.zeros(5))


def test_two_processes_equal_one(tiny_dir, tmp_path):
    """``shared_prefix=True`` under two processes (``torch.distributed.run``, gloo through accelerate; on two GPUs
    the same launch with NCCL): each rank packs its half of the global batch (here one prompt group each); the mean
    of the ranks' losses and the rank-averaged gradients (what DDP applies) equal one process's step on the whole
    batch within 1e-5 relative."""
    import subprocess
    import sys
    from pathlib import Path

    from trl_two_process_worker import one_step

    worker = Path(__file__).resolve().parent / "trl_two_process_worker.py"
    out = tmp_path / "two.pt"
    env = dict(__import__("os").environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29563",
                        str(worker), tiny_dir, str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = torch.load(out)
    loss, grads = one_step(tiny_dir)
    assert _rel(two["loss"], loss) <= 1e-5, (float(two["loss"]), float(loss))
    assert two["grads"].keys() == grads.keys() and len(grads) >= 4
    worst = max(_rel(two["grads"][n], g) for n, g in grads.items())
    assert worst <= 1e-5, worst


def test_tree_packing_shares_prefixes_across_prompts():
    """``shared_prefix="tree"``: two prompts with a common 5-token prefix, two completions each (one completion a
    prefix of the other's row, one row without completion tokens): the common prefix is packed once, every
    completion token's label sits at the packed position of its (token, next token) pair, and the scores land at
    the rows' completion columns."""
    from kvtransform.integrations.trl_packing import pack_chunk_tree

    sys_, c = [5, 6, 7, 8, 9], 4
    prompts = [sys_ + [10, 11], sys_ + [12]]
    comps = [[20, 21, 22], [20, 21], [30], []]
    rows = [prompts[0], prompts[0], prompts[1], prompts[1]]
    p = max(len(x) for x in rows)
    ids = torch.zeros(4, p + c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (pr, co) in enumerate(zip(rows, comps)):
        ids[r, p - len(pr):p], mask[r, p - len(pr):p] = torch.tensor(pr), 1
        ids[r, p:p + len(co)], mask[r, p:p + len(co)] = torch.tensor(co, dtype=torch.long), 1
    assert plan_packing(ids, mask, c)[1] == ""  # prompts 0 and 1 each have two rows
    plan, why = plan_packing(ids, mask, c, trees=True)
    assert why == "" and len(plan.chunks) == 1
    batch, labels, r_, c_, src = pack_chunk_tree(plan, plan.chunks[0], "cpu")
    # pairs: row 0 (5,6)(6,7)(7,8)(8,9)(9,10)(10,11)(11,20)(20,21)(21,22); row 1 the same up to (20,21) then ends;
    # row 2 (5,6)..(8,9)(9,12)(12,30): shared (5,6)..(8,9) once, then 9+10+11+20+21 | 9+12 -> 4 + 5 + 2 = 11
    assert batch.num_tokens == 11 and batch.num_trajectories == 3
    got = {(int(a), int(b)): int(labels[0, s]) for a, b, s in zip(r_, c_, src)}
    assert got == {(0, 0): 20, (0, 1): 21, (0, 2): 22, (1, 0): 20, (1, 1): 21, (2, 0): 30}
    assert int((labels != -100).sum()) == 4  # (11,20) (20,21) (21,22) (12,30): rows 0 and 1 share two positions
    assert torch.equal(batch.input_ids[0, src], torch.tensor([11, 20, 21, 11, 20, 12]))
