"""What a model's architecture means for packed attention and capture, read from its config and modules: the
attention variants its layers use (sliding window, soft-capping, sinks), the position limits a packed batch must
respect (length-dependent RoPE, learned position tables), layers that mix tokens outside attention, and training
dropout. The DualKV transform, the Hugging Face integration and the TRL trainer ask these before packing."""
from __future__ import annotations

import torch

__all__ = [
    "SOFTCAP_NOT_APPLIED",
    "config_attention_variants",
    "length_dependent_rope",
    "position_limits",
    "ATTENTION_ONLY_LAYER_TYPES",
    "check_attention_only_mixing",
    "refuse_training_dropout",
    "check_equal_kv_head_dims",
    "training_dropout",
]


#: Families whose config carries ``attn_logit_softcapping`` but whose attention never applies it (HF's Gemma 3
#: attention passes no ``softcap``): their value is not checked at ``enable()``
SOFTCAP_NOT_APPLIED = frozenset({"gemma3", "gemma3_text"})


def config_attention_variants(model) -> dict:
    """``{"window" | "softcap" | "sinks": where}`` for the variants some attention layer of ``model`` uses (from its
    config: ``layer_types`` with sliding layers, or ``sliding_window`` switched on; ``attn_logit_softcapping``; a
    ``sinks`` parameter in a module)."""
    cfg = model.config
    out = {}
    layer_types = getattr(cfg, "layer_types", None) or []
    # Mistral has no use_sliding_window: its sliding_window alone turns the window on
    # (a sliding_window of 0 is a window too, a degenerate one HF applies: reported, so that enable() refuses it)
    if any("sliding" in str(t) for t in layer_types) or (getattr(cfg, "use_sliding_window", True) and
                                                         getattr(cfg, "sliding_window", None) is not None):
        out["window"] = getattr(cfg, "sliding_window", None)
    if (getattr(cfg, "attn_logit_softcapping", None) is not None
            and getattr(cfg, "model_type", None) not in SOFTCAP_NOT_APPLIED):
        out["softcap"] = cfg.attn_logit_softcapping
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        out["sinks"] = "per-head parameters"
    return out


def length_dependent_rope(model) -> dict:
    """``{"dynamic" | "longrope": positions}`` for the rotary embeddings of ``model`` whose frequencies depend on
    the largest position of a call (transformers' ``dynamic_rope_update``): dynamic-NTK RoPE rescales past
    ``positions`` (``original_max_seq_len``), LongRoPE (Phi-3-128k / 3.5) switches to its long factors past
    ``positions`` (``original_max_position_embeddings``). A packed batch is one call, so its longest trajectory
    decides for all of them (:func:`kvtransform.packing.check_rope_lengths`). Empty for every other RoPE."""
    out = {}
    for m in model.modules():
        rope_type = getattr(m, "rope_type", None)
        types = rope_type if isinstance(rope_type, dict) else {None: rope_type}
        for layer_type, kind in types.items():
            if not isinstance(kind, str):
                continue
            if "dynamic" in kind and isinstance(getattr(m, "original_max_seq_len", None), int):
                out["dynamic"] = min(out.get("dynamic", 1 << 62), m.original_max_seq_len)
            elif kind == "longrope":
                params = getattr(getattr(m, "config", None), "rope_parameters", None) or {}
                params = params.get(layer_type, params) if layer_type is not None else params
                limit = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
                limit = limit or getattr(getattr(m, "config", None), "original_max_position_embeddings", None)
                if isinstance(limit, int):
                    out["longrope"] = limit
    return out


def position_limits(model) -> dict:
    """:func:`length_dependent_rope` plus ``{"learned": positions}`` when ``model`` has a learned absolute position
    table (GPT-2's ``wpe``, OPT's ``embed_positions`` less its offset): a trajectory longer than that indexes past
    it. Read by :func:`kvtransform.packing.check_rope_lengths` for every packed batch."""
    out = length_dependent_rope(model)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _LEARNED_POSITION_TABLES:
            out["learned"] = min(out.get("learned", 1 << 62), m.num_embeddings - int(getattr(m, "offset", 0)))
    return out


_LEARNED_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


#: ``config.layer_types`` entries (transformers' ``ALLOWED_LAYER_TYPES``) whose layers mix tokens only through
#: causal attention (full or sliding window) or not at all (MLP kinds)
ATTENTION_ONLY_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "sparse", "dense", "moe"})


def check_attention_only_mixing(model, what: str) -> None:
    """Refuse a model some of whose layers mix tokens other than through causal (full or sliding-window) attention:
    convolutions or recurrent / linear-attention state (LFM2, MiniMax, Mamba hybrids: ``config.layer_types``),
    chunked attention (Llama 4's ``attention_chunk_size``). A packed batch puts several sequences on one token axis
    and only the attention layers are given its layout, so such a layer would mix the branches of a packed batch
    (DualKV arXiv 2605.15422 and prefix trees need every cross-token operation to be attention).

    Raises:
        ValueError: one line naming the layer kind and ``what`` cannot take it.
    """
    cfg = getattr(model, "config", None)
    cfgs = [cfg] + [getattr(cfg, k, None) for k in ("text_config",)]
    for c in (c for c in cfgs if c is not None):
        kinds = sorted({str(t) for t in (getattr(c, "layer_types", None) or [])} - ATTENTION_ONLY_LAYER_TYPES)
        if kinds:
            raise ValueError(f"{type(model).__name__} has {', '.join(repr(k) for k in kinds)} layers "
                             f"(config.layer_types): {what} gives a packed batch's layout to causal full or "
                             f"sliding-window attention only, so these layers would mix its sequences: train it on "
                             f"unpacked batches")
        if getattr(c, "attention_chunk_size", None) is not None:
            raise ValueError(f"{type(model).__name__} uses chunked attention (config.attention_chunk_size="
                             f"{c.attention_chunk_size}), which {what} does not express: train it on unpacked "
                             f"batches")


def check_equal_kv_head_dims(model, what: str) -> None:
    """Refuse a model whose value heads are narrower or wider than its query/key heads (multi-head latent attention,
    DeepSeek-V2/V3's ``v_head_dim`` against ``qk_nope_head_dim + qk_rope_head_dim``) where ``what`` holds K and V of
    one ``head_dim`` (SpeContext's static KV cache). The canonical and DualKV rewrites take such attention (DualKV
    pads the values with zero columns, which is exact).

    Raises:
        ValueError: one line naming both head dims, ``what`` and the canonical transform.
    """
    cfg = getattr(model, "config", None)
    for c in (c for c in (cfg, getattr(cfg, "text_config", None)) if c is not None):
        v = getattr(c, "v_head_dim", None)
        qk = getattr(c, "qk_head_dim", None)
        if qk is None and getattr(c, "qk_nope_head_dim", None) is not None:
            qk = int(c.qk_nope_head_dim) + int(getattr(c, "qk_rope_head_dim", 0) or 0)
        if qk is None:
            qk = getattr(c, "head_dim", None)
        if isinstance(v, int) and isinstance(qk, int) and v != qk:
            raise ValueError(f"{type(model).__name__} has value heads of {v} and query/key heads of {qk} "
                             f"(config.v_head_dim: multi-head latent attention); {what} needs K and V of one "
                             f"head_dim: use the canonical or DualKV transform")


def training_dropout(model: torch.nn.Module, attention_only: bool = False):
    """``(where, p, is_module)`` of the first dropout ``model`` would apply in training, or None: an attention
    module's ``attention_dropout`` probability (Llama-style, passed to the attention function) or ``attn_dropout``
    ``nn.Dropout`` (GPT-2-style), and unless ``attention_only`` any other ``nn.Dropout`` with ``p > 0``."""
    for name, m in model.named_modules():
        for attr in ("attention_dropout", "attn_dropout"):
            p = getattr(m, attr, None)
            module = isinstance(p, torch.nn.Dropout)
            p = p.p if module else p
            if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
                return f"{name}.{attr}", p, module
        if not attention_only and isinstance(m, torch.nn.Dropout) and m.p > 0:
            return name, m.p, True
    return None


def refuse_training_dropout(model: torch.nn.Module, before: str = "kvt.transform") -> None:
    """A model in train mode with a dropout above 0 is refused in one line by the transform built for training
    (DualKV), and by its module's forward when the model is switched to train mode later (``before``: what to call
    ``model.eval()`` before): the capture runs the model in eval mode, so the program would silently never apply it
    (the canonical module is verified in eval semantics and says so: a warning and a note in its report)."""
    found = training_dropout(model) if model.training else None
    if found is not None:
        raise ValueError(f"{type(model).__name__} is in train mode with dropout {found[1]} ({found[0]}), and the "
                         f"transformed program applies no dropout: call model.eval() before {before} (or set the "
                         f"dropout to 0 in the model's config)")
