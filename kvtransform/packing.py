"""Packed shared-prefix batches for DualKV (arXiv 2605.15422, §2): ``[P][R_1]...[R_N]`` in one token axis.

N responses that share one prompt of P tokens are packed as ``[P][R_1]...[R_N]`` (``P + ΣR`` tokens instead of
``Σ(P + R_i)``); several prompt groups pack one after another. :class:`PackedBatch` holds the ids, position ids (each
response continues its prompt's positions) and the :class:`~kvtransform.layout.DualKVLayout` (``cu_seqlens``,
``segment_prefix``), and extracts per-response log-probs from the packed logits::

    batch = kvt.pack_shared_prefix(prompt_ids, [r1, r2, r3])                # one group
    batch = kvt.pack_shared_prefix_groups([(p_a, [ra1, ra2]), (p_b, [rb1])])
    logprobs = batch.response_logprobs(opt(batch))                          # [(R_i,) ...]
"""
from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from .layout import DualKVLayout
from .packed_logits import packed_logits
from .utils import is_integer_dtype

# prefix-tree packing (any depth of shared prefix) lives in its own module; exported here too
from .tree_packing import TreeBatch, _as_device, _as_vocab, pack_trajectories  # noqa: F401

__all__ = ["PackedBatch", "pack_shared_prefix", "pack_shared_prefix_groups", "check_packed", "check_rope_lengths",
           "PackedLayoutMask", "UnpackedModelError"]

TokenIds = Union[Sequence[int], torch.Tensor]


def _token_id(v, what: str, j: int) -> int:
    """One token id as a python int: python ints, NumPy integer scalars and 0-d integer tensors (``operator.index``);
    floats, bools and strings raise ValueError."""
    bad = isinstance(v, (bool, str, bytes)) or (isinstance(v, torch.Tensor) and (v.dim() != 0 or v.dtype == torch.bool)) \
        or type(v).__name__ in ("bool_", "bool") and type(v).__module__ == "numpy"
    if not bad:
        try:
            i = operator.index(v)
        except TypeError:
            pass
        else:
            if -2 ** 63 <= i < 2 ** 63:
                return i
            raise ValueError(f"{what}: element {j} is {i}, outside int64: token ids are vocabulary indices (>= 0)")
    raise ValueError(f"{what}: element {j} is {v!r}, not an integer token id (ints, NumPy integers or an integer "
                     f"tensor; not floats, bools or strings)")


def _as_ids(x: TokenIds, what: str, vocab_size: Optional[int]) -> torch.Tensor:
    """1-D int64 CPU tensor from a list of ints (or NumPy integers), a 1-D integer tensor or a 1-D integer NumPy
    array; raises ValueError on bad input."""
    if type(x).__module__ == "numpy" and hasattr(x, "ndim") and hasattr(x, "dtype"):  # a NumPy array
        if x.ndim != 1:
            raise ValueError(f"{what} must be 1-D token ids; got a NumPy array of shape {tuple(x.shape)}")
        if x.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integer token ids; got NumPy dtype {x.dtype}")
        if x.dtype.kind == "u" and x.size and int(x.max()) > 2 ** 63 - 1:  # (astype would wrap it negative)
            j = int(x.argmax())
            raise ValueError(f"{what}: element {j} is {int(x[j])}, outside int64: token ids are vocabulary indices "
                             f"(>= 0)")
        x = torch.tensor(x.astype("int64"))
    if isinstance(x, torch.Tensor):
        if x.is_nested or x.layout != torch.strided:  # (their dim/min are not defined or not implemented)
            kind = "nested" if x.is_nested else str(x.layout).replace("torch.", "")
            raise ValueError(f"{what} is a {kind} tensor: pass dense 1-D token ids (.to_dense(), or a list of ids)")
        if x.dim() != 1:
            raise ValueError(f"{what} must be a 1-D tensor or a list of token ids; got a tensor of shape "
                             f"{tuple(x.shape)}")
        if not is_integer_dtype(x.dtype):
            raise ValueError(f"{what} must hold integer token ids; got dtype {x.dtype}")
        t = x.detach().to("cpu", torch.long)
    else:
        if isinstance(x, (Mapping, Set)):  # no token order to keep
            raise ValueError(f"{what} is a {type(x).__name__} (unordered): pass a list or 1-D tensor of token ids")
        if isinstance(x, (str, bytes, bytearray)):  # characters or bytes are not token ids
            raise ValueError(f"{what} is {type(x).__name__} text: tokenize it first (tokenizer(text).input_ids)")
        try:
            seq = list(x)
        except TypeError:
            raise ValueError(f"{what} must be a list of token ids or a 1-D tensor; got {type(x).__name__}") from None
        t = torch.tensor([_token_id(v, what, j) for j, v in enumerate(seq)], dtype=torch.long)
    if t.numel() == 0:
        raise ValueError(f"{what} is empty: prompts and responses need at least one token")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0:
        raise ValueError(f"{what} holds token id {lo} (at position {int((t == lo).nonzero()[0])}): ids must be >= 0")
    if vocab_size is not None and hi >= vocab_size:
        raise ValueError(f"{what} holds token id {hi} (at position {int((t == hi).nonzero()[0])}) outside the "
                         f"vocabulary of {vocab_size} tokens")
    return t


@dataclass
class PackedBatch:
    """A packed shared-prefix batch: groups ``[P_g][R_g,0]...[R_g,N_g-1]`` in one token axis of length ``T``.

    Attributes:
        input_ids: int64 ``(1, T)``.
        position_ids: int64 ``(1, T)``: ``0..P_g-1`` on a prompt, ``P_g..P_g+R_g,i-1`` on each of its responses.
        layout: :class:`~kvtransform.layout.DualKVLayout` (int32 ``cu_seqlens`` ``(S+1,)``, ``segment_prefix``
            ``(S,)``) on the same device.
        groups: the token ids as packed, ``[(prompt (P_g,), [response (R_g,i,), ...]), ...]`` (int64, CPU).

    Build it with :func:`pack_shared_prefix` or :func:`pack_shared_prefix_groups`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: DualKVLayout
    groups: list = field(default_factory=list)

    # ------------------------------------------------------------------ views
    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.layout.cu_seqlens

    @property
    def segment_prefix(self) -> torch.Tensor:
        return self.layout.segment_prefix

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_tokens(self) -> int:
        """``T = Σ_g (P_g + Σ_i R_g,i)``."""
        return int(self.input_ids.shape[1])

    @property
    def num_responses(self) -> int:
        return sum(len(r) for r in self.layout.response_lens)

    @property
    def prompt_lengths(self) -> list:
        return list(self.layout.prefix_lens)

    @property
    def response_lengths(self) -> list:
        """Flat list of ``R_i`` in packing order."""
        return [r for rs in self.layout.response_lens for r in rs]

    @property
    def replicated_tokens(self) -> int:
        """``Σ_g Σ_i (P_g + R_g,i)``: tokens of the same batch as separate (unpadded) sequences."""
        return sum(p + r for p, rs in zip(self.layout.prefix_lens, self.layout.response_lens) for r in rs)

    @property
    def token_ratio(self) -> float:
        """ρ = replicated tokens / packed tokens (``N(P+R̄)/(P+ΣR)`` for one group)."""
        return self.replicated_tokens / self.num_tokens

    @torch.inference_mode(False)  # a copy made during a rollout still trains (as the packers' tensors)
    def to(self, device) -> "PackedBatch":
        device = _as_device(device)
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device), self.layout.to(device),
                           self.groups)

    def replicated_sequences(self) -> list:
        """``[prompt_g + response_g,i]`` (1-D int64, CPU) for every response in packing order."""
        return [torch.cat([p, r]) for p, rs in self.groups for r in rs]

    # ------------------------------------------------------------------ indices
    def _index(self):
        """(logit rows (ΣR,), target token positions (ΣR,)) in the packed axis, both int64 CPU."""
        rows, tgts = [], []
        cu = self.layout.cu_seqlens.tolist()
        seg = 0
        for p, rs in zip(self.layout.prefix_lens, self.layout.response_lens):
            last_prompt = cu[seg + 1] - 1
            seg += 1
            for r in rs:
                a = cu[seg]
                rows.append(torch.tensor([last_prompt]))
                rows.append(torch.arange(a, a + r - 1))
                tgts.append(torch.arange(a, a + r))
                seg += 1
        return torch.cat(rows), torch.cat(tgts)

    def response_logprobs(self, logits: torch.Tensor) -> list:
        """Per-response log-probabilities of the response tokens.

        Args:
            logits: ``(1, T, vocab)`` or ``(T, vocab)``, the transformed module's output for this batch.

        Returns:
            list of ``(R_i,)`` float32 tensors in packing order (fp64 for fp64 logits): entry ``j`` is
            ``log p(r_ij | prompt, r_i<j)``; the first comes from the last prompt position. Differentiable.

        Raises:
            ValueError: logits that are not a floating-point tensor, of the wrong rank, a length that is not ``T``,
                or a vocabulary smaller than the largest token id of the batch.
        """
        logits = packed_logits(logits, self.num_tokens, self.input_ids)
        rows, tgts = self._index()
        rows, tgts = rows.to(logits.device), tgts.to(logits.device)
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        sel = logits.index_select(0, rows).to(work)
        lp = torch.log_softmax(sel, dim=-1).gather(1, self.input_ids[0].to(logits.device)[tgts][:, None])[:, 0]
        return list(torch.split(lp, self.response_lengths))

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Check ids, positions and layout against each other. Raises ValueError naming the mismatch."""
        check_packed(self.input_ids, self.position_ids, self.layout, vocab_size)


@torch.inference_mode(False)  # packed during a rollout (inference mode), trained on later: normal tensors
def pack_shared_prefix_groups(groups: Sequence[tuple], vocab_size: Optional[int] = None,
                              device: Union[str, torch.device, None] = None) -> PackedBatch:
    """Pack several groups ``[(prompt_ids, [response_ids, ...]), ...]`` into one :class:`PackedBatch`.

    Args:
        groups: per group a prompt (list of ints or NumPy integers, 1-D integer tensor or NumPy array, ≥ 1 token)
            and a non-empty list of responses (same types, ≥ 1 token each; or the rows of a 2-D tensor or NumPy
            array, each row a whole response: padding would be packed as tokens). A list or a generator.
        vocab_size: when given, every id must be ``< vocab_size``.
        device: device of the batch tensors (default CPU, or the device of the first tensor given).

    Returns:
        :class:`PackedBatch` with ``T = Σ_g (P_g + Σ_i R_g,i)``.

    Raises:
        ValueError: no groups, a group without responses, an empty prompt or response, a non-integer or negative
            token id, or an id ``>= vocab_size``; a vocab_size that is not a positive integer; a device that is
            not usable here (meta, an absent GPU).
    """
    if isinstance(groups, Iterator):  # a generator of groups, as pack_trajectories takes one of trajectories
        groups = list(groups)
    if isinstance(groups, (torch.Tensor, str)) or not hasattr(groups, "__len__") or len(groups) == 0:
        raise ValueError("pack_shared_prefix_groups needs a non-empty list of (prompt_ids, [response_ids, ...])")
    if vocab_size is not None:
        vocab_size = _as_vocab(vocab_size)
    device = _as_device(device)
    packed_groups, ids, pos, lens = [], [], [], []
    for g, grp in enumerate(groups):
        if not isinstance(grp, (tuple, list)) or len(grp) != 2:
            raise ValueError(f"group {g} must be a pair (prompt_ids, [response_ids, ...]); got {type(grp).__name__}")
        prompt, responses = grp
        if device is None and isinstance(prompt, torch.Tensor):
            device = _as_device(prompt.device)
        p = _as_ids(prompt, f"group {g}: prompt", vocab_size)
        if isinstance(responses, torch.Tensor) and responses.dim() == 2 and not responses.is_nested \
                and responses.layout == torch.strided:  # its rows, as a 2-D NumPy array's (unpadded responses)
            responses = list(responses)
        if isinstance(responses, (torch.Tensor, Mapping, Set)) or not hasattr(responses, "__len__"):
            raise ValueError(f"group {g}: responses must be a list of token-id sequences, got "
                             f"{type(responses).__name__}")
        if len(responses) == 0:
            raise ValueError(f"group {g} has no responses: pass at least one response per prompt")
        rs = [_as_ids(r, f"group {g}: response {i}", vocab_size) for i, r in enumerate(responses)]
        packed_groups.append((p, rs))
        ids.append(p)
        pos.append(torch.arange(p.numel()))
        for r in rs:
            ids.append(r)
            pos.append(torch.arange(p.numel(), p.numel() + r.numel()))
        lens.append((p.numel(), [r.numel() for r in rs]))
    device = torch.device(device) if device is not None else torch.device("cpu")
    layout = DualKVLayout.from_lengths(lens, device=device)
    return PackedBatch(torch.cat(ids)[None].to(device), torch.cat(pos)[None].to(device), layout, packed_groups)


def pack_shared_prefix(prompt_ids: TokenIds, responses: Sequence[TokenIds], vocab_size: Optional[int] = None,
                       device: Union[str, torch.device, None] = None) -> PackedBatch:
    """Pack one prompt and its N responses as ``[P][R_1]...[R_N]`` (see :func:`pack_shared_prefix_groups`)."""
    return pack_shared_prefix_groups([(prompt_ids, responses)], vocab_size=vocab_size, device=device)


def check_packed(input_ids, position_ids, layout: DualKVLayout, vocab_size: Optional[int]) -> None:
    meta = [n for n, x in (("input_ids", input_ids), ("position_ids", position_ids)) if x.device.type == "meta"]
    if meta:
        raise ValueError(f"packed {' and '.join(meta)} on the meta device hold no token ids or positions to run: move "
                         f"the batch to the model's device (batch.to(device))")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"packed input_ids must be (1, T); got shape {tuple(input_ids.shape)}")
    t = int(input_ids.shape[1])
    try:
        layout.validate(total_tokens=t)
    except ValueError as e:
        raise ValueError(f"the batch layout does not match its {t} tokens: {e}") from None
    if tuple(position_ids.shape) != (1, t):
        raise ValueError(f"position_ids must be (1, T={t}); got shape {tuple(position_ids.shape)}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be integer positions (batch.position_ids); got {position_ids.dtype}")
    expect = layout.position_ids().to(position_ids.device)
    if not torch.equal(position_ids[0].long(), expect):
        bad = int((position_ids[0].long() != expect).nonzero()[0])
        raise ValueError(f"position_ids do not match the layout: at token {bad} the layout gives position "
                         f"{int(expect[bad])}, the batch {int(position_ids[0, bad])}")
    if input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be integer token ids; got {input_ids.dtype}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        where = int((input_ids[0] == bad).nonzero()[0])
        raise ValueError(f"token id {bad} at packed position {where} is outside the vocabulary "
                         f"[0, {vocab_size if vocab_size is not None else '?'})")



def check_rope_lengths(limits: dict, layout) -> None:
    """Refuse a packed batch whose trajectories a length-dependent RoPE would compute with another one's
    frequencies, or one longer than a learned position table (``limits``: :func:`kvtransform.model_features.position_limits`).
    transformers picks RoPE frequencies once per call from its largest position, so in a packed batch the longest
    trajectory decides for every trajectory: dynamic-NTK RoPE is exact only while every trajectory stays within its limit (past it, each
    length has its own scaling), LongRoPE while all trajectories are on one side of its limit. ``layout``: a
    :class:`~kvtransform.layout.DualKVLayout` or :class:`~kvtransform.tree_layout.PrefixTreeLayout` (host lists,
    no device read).

    Raises:
        ValueError: one line naming the limit and how to split the batch.
    """
    if not limits:
        return
    lengths = layout.trajectory_lengths()
    if not lengths:
        return
    longest, shortest = max(lengths), min(lengths)
    limit = limits.get("dynamic")
    if limit is not None and longest > limit:
        raise ValueError(f"this model's dynamic-NTK RoPE rescales its frequencies by the longest sequence of a call "
                         f"once it passes {limit} positions, so in this packed batch every trajectory would get its "
                         f"longest one's ({longest} tokens): pack trajectories of at most {limit} tokens (run longer "
                         f"ones unpacked, one per call)")
    limit = limits.get("learned")
    if limit is not None and longest > limit:
        raise ValueError(f"this model has {limit} learned positions and a trajectory of this packed batch has "
                         f"{longest} tokens (positions past the table do not exist, packed or not): pack "
                         f"trajectories of at most {limit} tokens")
    limit = limits.get("longrope")
    if limit is not None and shortest <= limit < longest:
        raise ValueError(f"this model's LongRoPE uses its long factors for a whole call once its longest sequence "
                         f"passes {limit} positions, and this packed batch mixes trajectories of {shortest} and "
                         f"{longest} tokens: pack those of at most {limit} tokens and the longer ones in separate "
                         f"batches")


class UnpackedModelError(ValueError, AttributeError):
    """Raised when a model's own code reads :class:`PackedLayoutMask`; an ``AttributeError`` too, so ``hasattr``
    probes (accelerate's device placement) see a plain object."""


class PackedLayoutMask:
    """The ``attention_mask`` of ``model(**kvt.integrations.transformers.packed_inputs(batch))``: a packed batch has
    no padding and its attention is the layout's, so there is no mask tensor. A model under
    ``kvt.integrations.transformers.enable`` (and a ``kvt.transform`` module) drops it before the forward. A model
    without packed attention would ignore the layout keywords and read ``position_ids`` as separate sequences (each
    branch cut off its prefix, a silently wrong answer): its mask code reads this object's attributes instead, and
    any such read raises :class:`UnpackedModelError` naming the fix."""

    __slots__ = ()

    @staticmethod
    def _refuse():
        raise UnpackedModelError(
            "this model read a packed batch's attention_mask without kvtransform's packed attention (it would cut "
            "every branch off its prefix): call kvt.integrations.transformers.enable(model, 'dualkv') before "
            "model(**packed_inputs(batch)), and call the model itself (its .forward skips the checks)")

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and other protocol lookups
            raise AttributeError(name)
        self._refuse()

    def __bool__(self) -> bool:  # `if attention_mask:` reads it too
        self._refuse()

    def __repr__(self) -> str:
        return "PackedLayoutMask()"


# a saved packed_inputs(...) dict loads with torch.load's default weights_only=True (the marker holds no state)
torch.serialization.add_safe_globals([PackedLayoutMask])
