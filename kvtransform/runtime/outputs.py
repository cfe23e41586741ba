"""What a SpeContext generation returns and measures, and the model facts the runtime needs (SpeContext, arXiv
2512.00722 §4–5): :class:`GenerationStats`, :class:`GenerateOutput`, :class:`ModelInfo`, and the per-step helpers
that fill the stats (selection checksums and overlap, EOS trimming)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Optional

import torch

from ..utils import is_count

__all__ = ["GenerationStats", "GenerateOutput", "ModelInfo"]


@dataclass
class GenerationStats:
    """Per-run numbers of :meth:`SpeContextRuntime.generate`.

    Attributes:
        batch: rows.
        prompt_tokens: real prompt tokens (sum over rows; padding not counted).
        new_tokens: tokens generated (sum over rows, up to and including each row's EOS).
        prefill_s, decode_s: wall seconds of the prefill (with the first token) and of the decode steps.
        prefill_tokens_per_s: ``prompt_tokens / prefill_s``.
        decode_tokens_per_s: tokens produced by the decode steps (rows still running) per second.
        decode_steps: decode steps run. Whether every row has stopped is checked every 8 steps (each check is a host
            sync), so up to 7 steps can run after the last EOS: ``decode_steps`` may exceed ``new_tokens``.
        ms_per_step: ``1000 * decode_s / decode_steps``.
        selection_overlap: mean fraction of the tokens selected at a step that were also selected at the
            previous step (per row and KV head; ``1 - 1/len`` for ``dense``; None without two comparable steps).
        kv_bytes: bytes allocated for the KV cache (``2 * L * batch * H_kv * max_length * D * itemsize``).
        cache_max_length: ``max_length`` of the cache (longest prompt + ``max_new_tokens``; with ``compile`` on CUDA
            rounded up to its bucket, ``SpeContextRuntime.cache_length``).
        head, budget: the retrieval head and the budget it ran with (tokens per KV head; ignored by ``dense``; at
            most the cache's length: a larger configured budget selects every cached token).
        cuda_graph: whether the decode steps replayed a CUDA graph.
        fused_weight_bytes: extra memory (on the model's device) of the decode program's fused projection weights:
            the groups kept as a copy of the model's (``fuse_projections``); 0 when nothing is fused or every group
            took the parameters' place.
        offload: whether layers' KV moved to CPU (``SpeContextConfig.offload`` and a plan that needs it).
        offload_bytes_per_step: per decode step with an offloaded layer, bytes copied to the GPU by elastic loading
            (entries that entered the selection × offloaded layers × K+V bytes of one entry).
        offload_full_bytes_per_step: the same steps, bytes of loading all ``W`` selected tokens of every offloaded
            layer (what loading without elastic reuse would copy).
        offload_layers_per_step: layers on CPU at each decode step.
        offload_moves: ``(decode step, length in tokens, layer)`` of every layer move.
        offload_copy_hidden: CUDA, eager decode with ``offload_timing``: mean over steps of ``1 − exposed / copy``,
            ``copy`` the side stream's copy time, ``exposed`` the part of it still running when the compute stream
            reached the first offloaded layer's wait (1 = fully hidden); None under CUDA graphs (timing events are
            not captured) and on the CPU stand-in.
        selection_checksums: per decode step and row, an int64 hash of the selected positions of every KV head
            (of the set: the order a head returns them in does not count): equal lists mean equal selections (used
            to check a graph replay against eager).
    """

    batch: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    decode_steps: int = 0
    ms_per_step: float = 0.0
    selection_overlap: Optional[float] = None
    kv_bytes: int = 0
    cache_max_length: int = 0
    head: str = ""
    budget: int = 0
    cuda_graph: bool = False
    fused_weight_bytes: int = 0
    offload: bool = False
    offload_bytes_per_step: list = field(default_factory=list, repr=False)
    offload_full_bytes_per_step: list = field(default_factory=list, repr=False)
    offload_layers_per_step: list = field(default_factory=list, repr=False)
    offload_moves: list = field(default_factory=list, repr=False)
    offload_copy_hidden: Optional[float] = None
    selection_checksums: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("selection_checksums")
        return d


@dataclass
class GenerateOutput:
    """``generate(..., return_dict_in_generate=True)``: ``sequences`` int64 ``(batch, prompt + new)``, ``stats``
    (:class:`GenerationStats`) and, with ``output_logprobs=True``, ``logprobs`` float32 ``(batch, new)``: per
    generated token, its log-probability under the distribution it was drawn from (after temperature / top-k /
    top-p; greedy: the ``log_softmax`` of the raw logits; :func:`~kvtransform.runtime.sampling._sampler` says
    exactly), 0 at the pad positions after a row's EOS (None without ``output_logprobs``)."""

    sequences: torch.Tensor
    stats: GenerationStats
    logprobs: Optional[torch.Tensor] = None


@dataclass
class ModelInfo:
    """What the runtime needs to know about the model (stored in the artifact's ``meta.json``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: str
    eos_token_id: list
    pad_token_id: Optional[int]

    @classmethod
    def from_model(cls, model, max_positions: int) -> "ModelInfo":
        """The facts of a Hugging Face causal LM; ``max_positions``: the longest prompt + generation the captured
        programs take (tokens; the transform passes the capture's bound)."""
        cfg = model.config
        gen = getattr(model, "generation_config", None)
        # as transformers' generate: the generation config's EOS (None there: never stop); the model config's only
        # for a model without a generation config
        eos = gen.eos_token_id if gen is not None else getattr(cfg, "eos_token_id", None)
        eos = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        pad = getattr(gen, "pad_token_id", None) if gen is not None else None
        return cls(num_layers=cfg.num_hidden_layers,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                   head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                   vocab_size=int(cfg.vocab_size), max_positions=int(max_positions),
                   dtype=str(next(model.parameters()).dtype).replace("torch.", ""), eos_token_id=eos,
                   pad_token_id=None if pad is None else int(pad))

    @classmethod
    def from_meta(cls, info, where: str) -> "ModelInfo":
        """The facts ``meta.json`` stores (``dataclasses.asdict`` of one), checked.

        Raises:
            ValueError: ``info`` is not an object with exactly these fields, a count that is not a positive int, a
                ``dtype`` not a torch dtype's name, EOS ids not a list of ints or a pad id neither int nor null (one
                line naming ``where``, the artifact's ``meta.json``).
        """
        def bad(why):
            return ValueError(f"{where} is damaged (model_info: {why}): save the artifact again")

        names = [f.name for f in fields(cls)]
        if not isinstance(info, dict):
            raise bad(f"a JSON {type(info).__name__}, not an object")
        if set(info) != set(names):
            missing, extra = sorted(set(names) - set(info)), sorted(set(info) - set(names))
            raise bad(", ".join([f"missing {missing}"] * bool(missing) + [f"unknown {extra}"] * bool(extra)))
        for key in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_positions"):
            if not is_count(info[key], 1):
                raise bad(f"{key} is {info[key]!r}, not a positive int")
        if not isinstance(info["dtype"], str) or not isinstance(getattr(torch, info["dtype"], None), torch.dtype):
            raise bad(f"dtype is {info['dtype']!r}, not a torch dtype's name")
        eos = info["eos_token_id"]
        if not isinstance(eos, list) or not all(is_count(e, -(1 << 63)) for e in eos):  # (any int, as HF stores)
            raise bad(f"eos_token_id is {info['eos_token_id']!r}, not a list of ints")
        if info["pad_token_id"] is not None and not is_count(info["pad_token_id"], -(1 << 63)):
            raise bad(f"pad_token_id is {info['pad_token_id']!r}, not an int or null")
        return cls(**info)

    def check_decode_program(self, program, where: str) -> None:
        """Check these facts against the saved decode step (a ``torch.export.ExportedProgram`` whose 4th input is
        the K cache ``(layers, batch, H_kv, S_max, head_dim)`` and whose first output is the logits
        ``(batch, vocab)``), so that a ``meta.json`` edited or paired with another artifact's programs is refused at
        load, not met as a shape error (or, for ``max_positions``, a prompt past the captured positions) later.

        Raises:
            ValueError: a fact that differs from the program's (one line naming ``where`` and the fact).
        """
        names = program.graph_signature.user_inputs
        nodes = {n.name: n for n in program.graph.nodes}
        k = nodes[names[3]].meta["val"]
        logits = [n for n in program.graph.nodes if n.op == "output"][0].args[0][0].meta["val"]
        s_max = k.shape[3]
        bound = program.range_constraints.get(getattr(getattr(s_max, "node", None), "expr", None))
        upper = int(bound.upper) if bound is not None and bound.upper.is_finite else int(s_max)
        found = {"num_layers": int(k.shape[0]), "num_kv_heads": int(k.shape[2]), "head_dim": int(k.shape[4]),
                 "vocab_size": int(logits.shape[-1]), "dtype": str(k.dtype).replace("torch.", "")}
        bad = [f"{key} {getattr(self, key)!r} (the program's: {v!r})" for key, v in found.items()
               if getattr(self, key) != v]
        if self.max_positions > upper:
            bad.append(f"max_positions {self.max_positions} (the program takes at most {upper})")
        if bad:
            raise ValueError(f"{where} is damaged (model_info: {', '.join(bad)} does not match decode.pt2): save the "
                             f"artifact again")



def _first_eos(new: torch.Tensor, eos: list) -> torch.Tensor:
    """Per row, the column of its first EOS in ``new`` ``(batch, n)``, or ``n`` when none."""
    n = new.shape[1]
    if not eos:
        return torch.full((new.shape[0],), n, dtype=torch.long)
    hit = torch.isin(new.cpu(), torch.tensor(eos))
    col = torch.where(hit, torch.arange(n)[None], torch.full_like(hit, n, dtype=torch.long))
    return col.amin(dim=1)


def _trim(new: torch.Tensor, eos: list) -> torch.Tensor:
    """Drop the columns after every row has finished (HF stops when the last row reaches EOS)."""
    last = int(_first_eos(new, eos).max())
    return new[:, :last + 1]


def _count_new(new: torch.Tensor, eos: list) -> int:
    """Tokens generated per row up to and including its first EOS, summed."""
    return int((_first_eos(new, eos) + 1).clamp(max=new.shape[1]).sum())


def _checksum(sel: torch.Tensor) -> torch.Tensor:
    """Per row, a hash of the selected set of each KV head (order-independent: heads may return their selection
    in any order; ``-1`` padding adds nothing)."""
    x = sel.to(torch.int64) + 1
    head = torch.arange(1, sel.shape[1] + 1, device=sel.device, dtype=torch.int64)[None, :, None]
    key = (x * 2654435761 + head * 40503) % 2147483647  # (position, KV head), then xor-shift-multiply rounds: no
    key = ((key ^ (key >> 13)) * 1103515245) % 2147483647  # linear term survives, so exchanging positions between
    key = key ^ (key >> 16)                                # heads changes the sum
    return (key * (x > 0)).sum(dim=(1, 2))


def _overlap(prev: torch.Tensor, cur: torch.Tensor, s_max: int) -> torch.Tensor:
    """Mean over (row, KV head) of |cur ∩ prev| / |cur| (valid entries only)."""
    b, h, _ = prev.shape
    member = torch.zeros(b, h, s_max + 1, dtype=torch.bool, device=prev.device)
    member.scatter_(2, (prev.long() + 1).clamp(min=0), True)
    member[:, :, 0] = False
    valid = cur >= 0
    hit = member.gather(2, (cur.long() + 1).clamp(min=0)) & valid
    return (hit.sum(-1).float() / valid.sum(-1).clamp(min=1).float()).mean()

