"""Tiny randomly initialised causal LMs of every architecture family kvtransform covers, for tests:
Llama, Qwen2, Qwen3, Mistral, and the attention variants of Gemma 2 (soft-capping, alternating sliding windows),
Gemma 3 (text), gpt-oss (learned sinks, windows, mixture-of-experts), Qwen3-MoE and Phi-3 (fused QKV); built from
transformers' own config classes (``docs/ARCHITECTURE.md``).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["TINY_FAMILIES", "TINY_WINDOW", "tiny_model"]

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss", "qwen3_moe", "phi3")

#: family -> (config class, model class) in ``transformers``.
_TINY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}

#: Window of the sliding-window layers of the tiny families that have them (small, so it matters at test lengths).
TINY_WINDOW = 8

_ALTERNATING = ["sliding_attention", "full_attention"]

#: Per-family config fields on top of the shared tiny defaults.
_TINY_EXTRA: dict[str, dict[str, Any]] = {
    "mistral": dict(sliding_window=None),
    # Gemma 2: alternating window/global layers, attention logits soft-capped (HF default 50; 5 so it bites).
    "gemma2": dict(sliding_window=TINY_WINDOW, layer_types=_ALTERNATING, attn_logit_softcapping=5.0,
                   final_logit_softcapping=30.0, query_pre_attn_scalar=16),
    "gemma3": dict(sliding_window=TINY_WINDOW, layer_types=_ALTERNATING, query_pre_attn_scalar=16),
    # gpt-oss: alternating layers, learned sinks (re-drawn non-zero below), 4 experts / 2 per token.
    "gpt_oss": dict(sliding_window=TINY_WINDOW, layer_types=_ALTERNATING, num_local_experts=4,
                    num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3_moe": dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    # Phi-3: fused qkv_proj / gate_up_proj; MHA by default upstream, GQA here like the others.
    "phi3": dict(pad_token_id=0, sliding_window=None),
}


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny randomly initialised causal LM of one architecture family (float32, eval mode), for tests.

    Defaults: 2 layers, hidden 64, 4 query heads, 2 KV heads (GQA), head_dim 16, intermediate 128, vocab 128,
    256 positions. Per family:

    - ``mistral``: sliding window off (``sliding_window=None``) unless overridden;
    - ``gemma2``: layers alternate sliding (window :data:`TINY_WINDOW` = 8) / global, attention soft-cap 5.0;
    - ``gemma3`` (``Gemma3ForCausalLM``, text only): alternating sliding (window 8) / global layers;
    - ``gpt_oss``: alternating sliding (window 8) / global layers, learned sinks drawn from N(0, 1) (non-zero, so
      they matter), 4 experts with 2 per token, plain RoPE;
    - ``qwen3_moe``: 4 experts with 2 per token, expert width 32;
    - ``phi3``: fused ``qkv_proj``, GQA 4/2.

    The MoE families keep transformers' default experts implementation (``config._experts_implementation``).
    Transformers has no SDPA attention for Gemma 2 and gpt-oss (soft-capping / sinks): for them ``"sdpa"`` builds
    the eager attention, which is what ``from_pretrained`` gives by default too (``model.config._attn_implementation``
    says which one runs).

    Args:
        family: one of :data:`TINY_FAMILIES`.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        seed: seed of the weight initialisation (the global RNG state is left untouched).
        **overrides: config fields to change, e.g. ``num_hidden_layers=3``, ``sliding_window=8``.

    Raises:
        ValueError: an unknown family, an override that is not a field of the family's config class (e.g.
            ``use_sliding_window`` for Mistral, which no layer reads).
    """
    import transformers

    if family not in _TINY_CLASSES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {list(TINY_FAMILIES)}")
    cfg_cls, model_cls = (getattr(transformers, n) for n in _TINY_CLASSES[family])
    kwargs: dict[str, Any] = dict(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(_TINY_EXTRA.get(family, {}))
    unknown = sorted(k for k in overrides if k not in kwargs and not hasattr(cfg_cls(), k))
    if unknown:  # a config class keeps any keyword as an attribute that no layer reads: a typo would be silent
        raise ValueError(f"{cfg_cls.__name__} has no field {unknown[0]!r} (misspelt? {family} models ignore it)")
    kwargs.update(overrides)
    if "layer_types" in kwargs and "layer_types" not in overrides:  # one type per layer, alternating
        n = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = [kwargs["layer_types"][i % len(kwargs["layer_types"])] for i in range(n)]
    config = cfg_cls(**kwargs)
    if attn_implementation == "sdpa" and not getattr(model_cls, "_supports_sdpa", True):
        attn_implementation = "eager"  # transformers' only attention for this family (see the docstring)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        for module in model.modules():  # gpt-oss: sinks initialised like weights (std 0.02) barely matter
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):
                with torch.no_grad():
                    sinks.normal_(0.0, 1.0)
    return model.to(torch.float32).eval()
