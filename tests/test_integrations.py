"""kvt.integrations.transformers: DualKV through a Hugging Face model's own forward (AttentionInterface)."""
import copy

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
