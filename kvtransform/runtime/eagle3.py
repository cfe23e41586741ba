"""The ``eagle3`` retrieval head: the attention of an EAGLE-3 draft model's decoder layer picks the tokens
(SpeContext, arXiv 2512.00722 §4.1–4.3: the draft's retrieval layer predicts the LLM's important tokens).

An EAGLE-3 draft checkpoint directory holds ``config.json`` (Llama-style: ``hidden_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``vocab_size``, ``draft_vocab_size``, ``rope_theta``, ``rms_norm_eps``) and
its weights (``model.safetensors`` or ``pytorch_model.bin``): ``fc.weight`` ``(hidden, 3·hidden)`` fusing three
target hidden states, ``midlayer.input_layernorm.weight`` and ``midlayer.hidden_norm.weight`` ``(hidden,)``,
``midlayer.self_attn.{q,k}_proj.weight`` ``(heads·D, 2·hidden)`` over ``concat(input_layernorm(embedding),
hidden_norm(fused_hidden))``, and optionally ``d2t``/``t2d`` (draft ↔ target vocabulary maps). Only what selection
needs is kept: ``fc``, the two norms and the q/k projections (the value/output projections, MLP and LM head are
dropped).

**The fused-hidden half.** At decode time the runtime has no target hidden states of the cached tokens (the cache
holds K/V only), so something else must fill the second half of the midlayer's input. This head uses
``fc(concat(e, e, e))`` with ``e`` the token's embedding (``fused="embedding"``, default): the draft's own fusion
applied to the one per-token representation available, normalised by ``hidden_norm`` like a real fused state;
``fused="zeros"`` leaves that half at zero (the query/key then come from the embedding half alone). No public
EAGLE-3 draft fits a model that runs on this machine offline, so the choice could not be measured on real text
here; both are selectable and tested for shape and refusal only.

Refused with a clear error: a draft whose vocabulary (``vocab_size``, ``t2d`` length) or hidden size differs from
the target's, or whose ``num_key_value_heads`` differs from the target's (the selection is per target KV head).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .embedding_heads import EmbeddingKeyHead, find_param, rms_norm, rope, yarn_rows
from .heads import register_head

__all__ = ["Eagle3Head", "load_eagle3"]

_KEEP = ("fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
         "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight")


def _read_weights(d: Path) -> dict:
    """The draft's tensors from ``d``'s ``*.safetensors`` (else ``*.bin``) files.

    Raises:
        FileNotFoundError: neither kind of file. ValueError: a damaged file (one line naming it).
    """
    import pickle
    import zipfile

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    read = lambda f: load_file(str(f))  # noqa: E731
    if not files:
        files = sorted(d.glob("*.bin"))
        if not files:
            raise FileNotFoundError(f"{d} has no *.safetensors or *.bin weights of an EAGLE-3 draft")
        read = lambda f: torch.load(f, map_location="cpu", weights_only=True)  # noqa: E731
    out = {}
    for f in files:
        try:
            out.update(read(f))
        except (SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
            why = (str(e).strip().splitlines() or [""])[0][:160]
            raise ValueError(f"{f} is damaged ({type(e).__name__}: {why}): copy the EAGLE-3 draft again") from None
    return out


def load_eagle3(directory, target_info: dict) -> tuple[dict, dict]:
    """Read an EAGLE-3 draft directory, keep only the selection weights, check it fits the target.

    Args:
        directory: the draft's directory (``config.json`` + weights).
        target_info: the target's ``vocab_size``, ``hidden_size``, ``num_key_value_heads``.

    Returns:
        ``(weights, config)``: fp32 tensors named as in :data:`_KEEP` (plus ``d2t``/``t2d`` when present) and the
        draft's config dict.

    Raises:
        FileNotFoundError: no ``config.json`` or weights.
        ValueError: a missing selection weight, or a vocabulary / hidden size / KV-head layout that does not fit.
    """
    d = Path(directory).expanduser()
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d} is not an EAGLE-3 draft directory (no config.json): give the directory of an "
                                f"EAGLE-3 draft trained for this model (its config.json and weights), or use "
                                f"head=distilled")
    cfg = json.loads((d / "config.json").read_text())
    raw = _read_weights(d)
    raw = {k[len("model."):] if k.startswith("model.") else k: v for k, v in raw.items()}
    missing = [k for k in _KEEP if k not in raw]
    if missing:
        raise ValueError(f"{d} is not an EAGLE-3 draft: missing {', '.join(missing)}")
    checks = [("vocab_size", cfg.get("vocab_size"), target_info["vocab_size"]),
              ("hidden_size", cfg.get("hidden_size"), target_info["hidden_size"]),
              ("num_key_value_heads", cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
               target_info["num_key_value_heads"])]
    if "t2d" in raw:
        checks.append(("t2d length (target vocabulary)", int(raw["t2d"].shape[0]), target_info["vocab_size"]))
    bad = [f"{name} {a} vs target {b}" for name, a, b in checks if a is None or int(a) != int(b)]
    if bad:
        raise ValueError(f"the EAGLE-3 draft {d} does not fit this model: {'; '.join(bad)} (a draft trained for "
                         f"this target is needed)")
    h, hid = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    hd = int(cfg.get("head_dim") or hid // h)
    shapes = {"fc.weight": (hid, 3 * hid), "midlayer.self_attn.q_proj.weight": (h * hd, 2 * hid),
              "midlayer.self_attn.k_proj.weight": (int(cfg["num_key_value_heads"]) * hd, 2 * hid)}
    wrong = [f"{k} {tuple(raw[k].shape)} (expected {s})" for k, s in shapes.items() if tuple(raw[k].shape) != s]
    if wrong:
        raise ValueError(f"the EAGLE-3 draft {d} has weights of the wrong shape: {'; '.join(wrong)}")
    keep = {k: raw[k].float() for k in _KEEP}
    for k in ("d2t", "t2d"):
        if k in raw:
            keep[k] = raw[k]
    return keep, cfg


@register_head("eagle3")
class Eagle3Head(EmbeddingKeyHead):
    """Selection by an EAGLE-3 draft's midlayer attention (module docstring). ``SpeContextConfig.retrieval`` is
    the draft's directory. Its own key cache: one key per cached token from the draft's ``k_proj``."""

    fused = "embedding"

    def __init__(self, config, scale=None):
        super().__init__(config, scale)
        self.source = str(getattr(config, "retrieval", "") or "")
        self.w: dict = {}
        self.cfg: dict = {}

    def bind(self, model) -> None:
        self.embed = find_param(model, "embed_tokens.weight")
        if self.w:
            return
        if self.source in ("", "self"):
            raise ValueError("head=eagle3 needs the draft: transform.retrieval=<EAGLE-3 checkpoint directory>")
        mc = model.config
        info = {"vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
                "num_key_value_heads": getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads}
        self.w, self.cfg = load_eagle3(self.source, info)

    def _head_dim(self) -> int:
        c = self.cfg
        return int(c.get("head_dim") or c["hidden_size"] // int(c["num_attention_heads"]))

    def rope_tables(self, lengths, device):
        """Per-row RoPE (YaRN past the draft's ``max_position_embeddings``), as :func:`~.embedding_heads.yarn_rows`."""
        c = self.cfg
        inv, ms = yarn_rows(float(c.get("rope_theta", 10000.0)), self._head_dim(), tuple(lengths),
                            int(c.get("max_position_embeddings", 2048)))
        return inv.to(device), ms.to(device)

    def qk(self, emb, positions, tables):
        c, w = self.cfg, self.w
        eps = float(c.get("rms_norm_eps", 1e-6))
        h, hkv = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
        d = self._head_dim()
        e = emb[..., -1, :].float()
        if self.fused == "zeros":
            fused = torch.zeros_like(e)
        else:
            fused = torch.cat([e, e, e], dim=-1) @ w["fc.weight"].to(e.device).t()
        x = torch.cat([rms_norm(e, w["midlayer.input_layernorm.weight"].to(e.device), eps),
                       rms_norm(fused, w["midlayer.hidden_norm.weight"].to(e.device), eps)], dim=-1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].to(e.device).t()).unflatten(-1, (h, d))
        k = (x @ w["midlayer.self_attn.k_proj.weight"].to(e.device).t()).unflatten(-1, (hkv, d))
        inv, ms = tables
        return rope(q, positions, inv, ms), rope(k, positions, inv, ms)

    def prefill(self, cache, max_new_tokens=None) -> None:
        self.w = {k: v.to(cache.k.device) for k, v in self.w.items()}
        super().prefill(cache, max_new_tokens)

    def state_dict(self) -> dict:
        return {**self.w, "config": json.dumps(self.cfg)} if self.w else {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.cfg = json.loads(state["config"])
            self.w = {k: v for k, v in state.items() if k != "config"}
