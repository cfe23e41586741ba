"""torch.compile: kvtransform's modules under torch.compile, and compile_backend rewriting HF models' attention."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kvtransform as kvt
from kvtransform.compile import compile_backend


def _batch(model, b=2, s=11, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids)
    am[-1, :3] = 0  # left padding: the mask reaches kvt.attention as attn_mask
    return ids, am


def _train_step_vs_eager(model, ids, am):
    """One training step of ``model`` under ``compile_backend("canonical")`` and of an eager deep copy made first;
    returns ``(loss, eager loss, backend, compiled, eager copy)`` with the gradients of both in ``.grad``."""
    ref = copy.deepcopy(model)
    be = compile_backend("canonical", inner="aot_eager")
    compiled = torch.compile(model, backend=be)
    loss = compiled(input_ids=ids, attention_mask=am, labels=ids).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, attention_mask=am, labels=ids).loss
    ref_loss.backward()
    return loss, ref_loss, be, compiled, ref


def _grads_rel(a, b):
    return max(float((x.grad - y.grad).abs().max() / y.grad.abs().max()) for x, y in
               zip(a.parameters(), b.parameters()) if y.grad is not None)


@pytest.mark.parametrize("family,checkpointing", [("llama", False), ("qwen3", True)])
def test_backend_training_matches_eager(family, checkpointing, monkeypatch):
    """An unmodified HF model under compile_backend: class kept, every SDPA call rewritten into kvt.attention,
    loss and every parameter gradient equal the eager original (also with gradient checkpointing)."""
    model = kvt.tiny_model(family)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # transformers >= 5.25's layers set its output collector (a context variable) inside the checkpointed
        # region: dynamo then runs each layer eagerly (nothing to rewrite) unless told not to replay that side
        # effect in the recompute, which the gradients do not need (README, "torch.compile backend")
        monkeypatch.setattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint", True,
                            raising=False)
    loss, ref_loss, be, compiled, ref = _train_step_vs_eager(model, *_batch(model))
    assert be.rewritten == model.config.num_hidden_layers and not be.skipped
    assert type(model).__name__.endswith("ForCausalLM") and compiled._orig_mod is model
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    assert _grads_rel(model, ref) < 1e-5


def test_backend_model_still_saves(tmp_path):
    model = kvt.tiny_model("llama")
    compiled = torch.compile(model, backend=compile_backend("canonical", inner="eager"))
    ids, am = _batch(model)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=am).logits
    compiled._orig_mod.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    with torch.no_grad():
        want = reloaded(input_ids=ids, attention_mask=am).logits
    keep = am.bool()
    assert torch.allclose(got[keep], want[keep], atol=1e-5)


def test_backend_leaves_what_it_cannot_prove():
    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3) + \
                F.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3], is_causal=True)

    be = compile_backend(inner="eager")
    x = torch.randn(1, 2, 5, 4)
    torch.compile(M(), backend=be, fullgraph=True)(x, x, x)
    reasons = sorted(r for _, _, r in be.skipped)
    assert be.rewritten == 0 and len(reasons) == 2
    assert "dropout" in reasons[0] and "not provably equal" in reasons[1]


def test_backend_refuses_other_transforms_by_name():
    with pytest.raises(ValueError, match="dualkv.*integrations.transformers.enable"):
        compile_backend("dualkv")


def test_emitted_modules_under_compile_equal_eager():
    """The transformed modules (kvt ops opaque to torch.compile) give the eager outputs when compiled."""
    model = kvt.tiny_model("llama")
    opt = kvt.transform(model, "canonical", progress=False)
    ids, am = _batch(model)
    with torch.no_grad():
        eager = opt.core(ids, am)
        got = torch.compile(opt.core, backend="aot_eager", dynamic=True)(ids, am)
    assert torch.allclose(got, eager, atol=1e-6)
    d = kvt.transform(model, "dualkv", progress=False)
    batch = kvt.pack_shared_prefix_groups([([1, 2, 3, 4], [[5, 6], [7, 8, 9]]), ([2, 3], [[4]])])
    args = d.core_inputs(batch)
    with torch.no_grad():
        assert torch.allclose(torch.compile(d.core, backend="aot_eager")(*args), d.core(*args), atol=1e-6)


@pytest.mark.slow
def test_inductor_end_to_end():
    """Inductor proper (compiles C++ on CPU: minutes): the emitted module and a training step under
    compile_backend equal eager. One layer: a second identical layer adds compile time, not coverage."""
    model = kvt.tiny_model("llama", num_hidden_layers=1)
    opt = kvt.transform(model, "canonical", progress=False)
    ids, am = _batch(model)
    with torch.no_grad():
        assert torch.allclose(torch.compile(opt.core)(ids, am), opt.core(ids, am), atol=1e-5)
    model.train()
    ref = copy.deepcopy(model)
    be = compile_backend("canonical")
    torch.compile(model, backend=be)(input_ids=ids, attention_mask=am, labels=ids).loss.backward()
    ref(input_ids=ids, attention_mask=am, labels=ids).loss.backward()
    assert be.rewritten == model.config.num_hidden_layers
    assert _grads_rel(model, ref) < 1e-5


def test_backend_with_peft_lora_adapters():
    """A PEFT LoRA-wrapped HF model under compile_backend keeps its adapters: every SDPA call rewritten, loss and the
    adapter gradients equal the eager wrapped model's."""
    peft = pytest.importorskip("peft")
    base = kvt.tiny_model("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # LoRA's B starts at zero: give the adapters a non-trivial value
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.train()
    loss, ref_loss, be, compiled, ref = _train_step_vs_eager(model, *_batch(base))
    assert be.rewritten == base.config.num_hidden_layers and not be.skipped
    assert isinstance(compiled._orig_mod, peft.PeftModel)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    assert _grads_rel(model, ref) < 1e-5


def test_enabled_model_under_compile_takes_both_packed_batch_kinds():
    """A model under kvt.integrations.transformers.enable() compiled with compile_backend: a one-level PackedBatch
    failed in enable()'s pre-call check, which read the layout's offsets (fake tensors in the trace: "cu_seqlens has
    no data to read ... build the layout from real tensors", advice the caller cannot follow); a TreeBatch ran. Both
    give the eager logits; a bad layout is still refused, by the DualKV op when the compiled graph runs."""
    from kvtransform.integrations.transformers import enable, packed_inputs

    model = kvt.tiny_model("llama")
    groups = [([1, 2, 3, 4], [[5, 6], [7, 8, 9]]), ([3, 4, 5], [[6], [7, 7]])]
    batches = (kvt.pack_shared_prefix_groups(groups),
               kvt.pack_trajectories([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [9, 8]]))
    enable(model, "dualkv")
    compiled = torch.compile(model, backend=compile_backend("canonical", inner="aot_eager"))
    with torch.no_grad():
        for b in batches:
            torch.testing.assert_close(compiled(**packed_inputs(b)).logits, model(**packed_inputs(b)).logits)
        bad = packed_inputs(batches[0])
        bad["segment_prefix"] = bad["segment_prefix"].clone()
        bad["segment_prefix"][0] = 99
        with pytest.raises(ValueError, match="segment 0 is a response before any prefix segment"):
            compiled(**bad)
