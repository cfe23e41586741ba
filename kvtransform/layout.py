"""The packed shared-prefix (DualKV) token layout.

Several groups share one packed token axis of length ``T``. Group ``g`` is its prompt (prefix, ``P_g`` tokens)
followed by its ``N_g`` responses (``R_{g,0} .. R_{g,N_g-1}`` tokens)::

    [P_0][R_0,0]..[R_0,N_0-1] [P_1][R_1,0].. ...

Attention in this layout (DualKV, arXiv 2605.15422, §2–3): a prefix token attends causally within its prefix; token
``r`` of a response attends to the whole prefix of its group plus tokens ``0..r`` of its own response, never to
another response. Every per-token op runs once on the prompt instead of ``N_g`` times.

The layout is described, flash-attention style, by two int32 device tensors:

* ``cu_seqlens`` ``(S+1,)``: boundaries of the ``S`` segments in the packed axis, segments ordered group by group
  (prefix_g, then response_g,0 .. response_g,N_g-1); ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``;
* ``segment_prefix`` ``(S,)``: for a response segment, the index of its group's prefix segment; ``-1`` for a prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from kvtransform.ops._common import as_int
from kvtransform.utils import is_integer_dtype


def _lists_from_lengths(groups) -> tuple:
    """``(cu, sp, prefix_lens, response_lens)`` python lists from ``[(P_g, [R_g,i, ..]), ..]``; ValueError on no
    groups, a malformed group, a non-integer length or a length <= 0."""
    if isinstance(groups, torch.Tensor) or not hasattr(groups, "__len__"):
        raise ValueError(f"groups must be a sequence of (prefix_len, [response_lens]); got {type(groups).__name__}")
    if len(groups) == 0:
        raise ValueError("DualKVLayout needs at least one group")
    cu, sp, prefix_lens, response_lens = [0], [], [], []
    for g, grp in enumerate(groups):
        if not hasattr(grp, "__len__") or len(grp) != 2:
            raise ValueError(f"group {g} must be (prefix_len, [response_lens]); got {grp!r}")
        p, rs = grp
        p = as_int(p, f"group {g}: prompt (prefix) length")
        if isinstance(rs, (str, bytes)) or not hasattr(rs, "__iter__"):
            raise ValueError(f"group {g}: response lengths must be a list of integers; got {rs!r}")
        rs = [as_int(r, f"group {g}: response {i} length") for i, r in enumerate(rs)]
        if p <= 0:
            raise ValueError(f"group {g}: prompt (prefix) of length {p}; prompts must have at least one token")
        for i, r in enumerate(rs):
            if r <= 0:
                raise ValueError(f"group {g}: response {i} has length {r}; responses must have at least one token")
        pidx = len(sp)
        sp.append(-1)
        cu.append(cu[-1] + p)
        for r in rs:
            sp.append(pidx)
            cu.append(cu[-1] + r)
        prefix_lens.append(p)
        response_lens.append(rs)
    if cu[-1] >= 2 ** 31:
        raise ValueError(f"{cu[-1]} tokens do not fit int32 offsets")
    return cu, sp, prefix_lens, response_lens


def _offsets(name: str, t) -> list:
    """The values of a layout offset tensor as python ints (a host read). Raises ValueError unless ``t`` is a 1-D
    integer tensor with data (not meta / fake) whose values fit int32 (the kernels' index type): a float tensor
    would be truncated and an int64 above 2**31-1 would wrap when the layout is stored as int32."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor; got {type(t).__name__} "
                         f"{tuple(getattr(t, 'shape', ()))}")
    if not is_integer_dtype(t.dtype):
        raise ValueError(f"{name} must hold integer offsets (int32); got {t.dtype}: build it with "
                         f"dtype=torch.int32, or use DualKVLayout.from_lengths")
    if not _has_data(t):
        raise ValueError(f"{name} has no data to read ({t.device} device, a fake tensor, or inside torch.compile): "
                         f"build the layout from real tensors before compiling, or with DualKVLayout.from_lengths")
    vals = [int(x) for x in t.tolist()]
    if vals and (min(vals) < -2 ** 31 or max(vals) > 2 ** 31 - 1):
        what = ("token offsets are int32 in the DualKV kernels: at most 2**31 - 1 packed tokens per batch, split it"
                if name == "cu_seqlens" else "entries are -1 or a segment index, stored as int32")
        raise ValueError(f"{name} holds {max(vals) if max(vals) > 2 ** 31 - 1 else min(vals)}, outside int32: "
                         f"{what}")
    return vals


def _has_data(t) -> bool:
    """A real tensor whose values can be read (not a fake / meta tensor, not while compiling)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    try:
        if torch.compiler.is_compiling():
            return False
    except Exception:  # pragma: no cover
        pass
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor) and (type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter))


def _check_structure(cu: Sequence[int], sp: Sequence[int], total_tokens: Optional[int]) -> None:
    """Validate python lists ``cu`` (S+1) and ``sp`` (S). Raises ValueError naming the problem."""
    s = len(sp)
    if s == 0:
        raise ValueError(f"the layout is empty (cu_seqlens {list(cu)}, segment_prefix []): it needs at least one "
                         f"group, a prompt and its responses; build it with DualKVLayout.from_lengths([(P, [R, ..]), "
                         f"..])")
    if len(cu) != s + 1:
        raise ValueError(f"cu_seqlens must have len(segment_prefix) + 1 = {s + 1} entries; got {len(cu)}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {cu[0]}")
    for i in range(s):
        if cu[i + 1] < cu[i]:
            raise ValueError(f"cu_seqlens is not monotone: cu_seqlens[{i + 1}] = {cu[i + 1]} < cu_seqlens[{i}] = {cu[i]}")
        if cu[i + 1] == cu[i]:
            kind = "prompt (prefix)" if sp[i] < 0 else "response"
            raise ValueError(f"segment {i} is a {kind} of length 0 (cu_seqlens[{i}] == cu_seqlens[{i + 1}] == {cu[i]})")
    if total_tokens is not None and cu[-1] != total_tokens:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but there are {total_tokens} tokens (T): the segment lengths "
                         f"must sum to T")
    cur = -1
    for i in range(s):
        if sp[i] < 0:
            if sp[i] != -1:
                raise ValueError(f"segment_prefix[{i}] = {sp[i]}: a prefix segment must be marked -1")
            cur = i
        else:
            if cur < 0:
                raise ValueError(f"segment {i} is a response before any prefix segment")
            if sp[i] != cur:
                raise ValueError(f"segment_prefix[{i}] = {sp[i]} but the prefix of its group is segment {cur}: "
                                 f"responses must directly follow their prefix")


def structure_ok(cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """The conditions of :func:`_check_structure` computed on the tensors' device, without a host sync: a 0-dim bool
    tensor, True iff ``cu_seqlens`` starts at 0, strictly increases (no empty segment) and ends at ``total_tokens``,
    and every ``segment_prefix`` entry is ``-1`` (a prefix) or the index of the latest prefix segment before it.

    Args:
        cu_seqlens: int ``(S+1,)``; segment_prefix: int ``(S,)``, ``S >= 1`` (a shape the caller has checked).
        total_tokens: ``T``.
    """
    cu = cu_seqlens.long()
    sp = segment_prefix.long()
    is_prefix = sp == -1
    own = torch.arange(sp.numel(), device=sp.device).masked_fill(~is_prefix, -1)
    latest_prefix = torch.cummax(own, 0).values
    return ((cu[0] == 0) & (cu[-1] == int(total_tokens)) & ((cu[1:] - cu[:-1]) > 0).all()
            & (is_prefix | (sp == latest_prefix)).all())


def _as_device(device) -> Optional[torch.device]:
    """``device`` as a usable torch.device (None stays None); ValueError (one line) naming the fix."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0'; got {device!r}") from None
    if dev.type == "meta":
        raise ValueError("device='meta' holds no data: pack on 'cpu' or a GPU")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is available here: pass device='cpu'")
    try:
        torch.empty(0, device=dev)
    except Exception as e:  # an absent index or backend: one line instead of torch's traceback
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"device={device!r} is not usable here ({why}): pass 'cpu' or an available GPU") from None
    return dev


def _int32_on(values, device) -> torch.Tensor:
    """An int32 tensor of ``values`` (a list or a CPU integer tensor) on ``device``. For a CUDA device the copy goes
    through pinned memory without blocking (a pageable host-to-device copy waits for the stream: a per-step layout
    would stall the GPU queue); it is ordered on the current stream, so work on another stream must wait for that
    stream before reading it."""
    t = values.to(torch.int32) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int32)
    if device is None or torch.device(device).type != "cuda":
        return t if device is None else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@torch.inference_mode(False)
def _normal_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int32, a normal tensor (an inference-mode tensor is copied: the ops save the layout for backward,
    which inference tensors cannot be)."""
    t = t.to(torch.int32)
    return t.clone() if t.is_inference() else t


@dataclass
class DualKVLayout:
    """Packed layout of ``num_groups`` (prefix, responses) groups in one token axis.

    Attributes:
        cu_seqlens: int32 ``(S+1,)`` segment boundaries (see module docstring).
        segment_prefix: int32 ``(S,)``: prefix segment index for a response segment, ``-1`` for a prefix.
        prefix_lens: python ``P_g`` per group.
        response_lens: python ``[R_{g,0}, ..]`` per group.

    Build it with :meth:`from_lengths` or :meth:`from_tensors`. Direct construction with both the tensors and the
    python lengths checks that they describe the same layout (ValueError otherwise; one read of the tensors, skipped
    for fake / meta tensors); :meth:`validate` also checks dtypes and the token count.
    """

    cu_seqlens: torch.Tensor
    segment_prefix: torch.Tensor
    prefix_lens: list = field(default_factory=list)
    response_lens: list = field(default_factory=list)

    # ------------------------------------------------------------------ construction
    @classmethod
    @torch.inference_mode(False)  # a layout packed during a rollout is trained on later: its tensors stay normal
    def from_lengths(cls, groups: Sequence[tuple], device: Union[str, torch.device, None] = None) -> "DualKVLayout":
        """Layout from ``[(P_0, [R_0,0, R_0,1, ..]), (P_1, [..]), ..]`` in packing order.

        Lengths are python ints or NumPy / torch integer scalars.

        Raises:
            ValueError: no groups, a prompt or response of length <= 0, or a non-integer length (a float or a bool).
        """
        cu, sp, prefix_lens, response_lens = _lists_from_lengths(groups)
        device = _as_device(device)
        return cls._trusted(_int32_on(cu, device), _int32_on(sp, device), prefix_lens, response_lens)

    @classmethod
    def from_tensors(cls, cu_seqlens: torch.Tensor, segment_prefix: torch.Tensor) -> "DualKVLayout":
        """Layout from the two offset tensors (host sync: reads them). Raises ValueError if they are inconsistent,
        not 1-D integer tensors with values in the int32 range, on two different devices, hold no data (meta / fake
        tensors), or describe no segment (an empty layout)."""
        cu = _offsets("cu_seqlens", cu_seqlens)
        sp = _offsets("segment_prefix", segment_prefix)
        if cu_seqlens.device != segment_prefix.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but segment_prefix on {segment_prefix.device}: "
                             f"move both to the device of the tokens with .to()")
        _check_structure(cu, sp, None)
        prefix_lens, response_lens = [], []
        for i, s in enumerate(sp):
            n = cu[i + 1] - cu[i]
            if s < 0:
                prefix_lens.append(n)
                response_lens.append([])
            else:
                response_lens[-1].append(n)
        return cls._trusted(_normal_int32(cu_seqlens), _normal_int32(segment_prefix), prefix_lens, response_lens)

    @classmethod
    def _trusted(cls, cu_seqlens, segment_prefix, prefix_lens, response_lens) -> "DualKVLayout":
        """Construct without the consistency check (the caller built both sides from one source)."""
        obj = cls.__new__(cls)
        obj.cu_seqlens, obj.segment_prefix = cu_seqlens, segment_prefix
        obj.prefix_lens, obj.response_lens = prefix_lens, response_lens
        return obj

    def __post_init__(self):
        for name in ("cu_seqlens", "segment_prefix"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"{name} must be an int32 tensor; got {type(getattr(self, name)).__name__}: build "
                                 f"the layout from python lengths with DualKVLayout.from_lengths([(P, [R, ..]), ..])")
        if not self.prefix_lens and not self.response_lens:
            # constructed from tensors only: fill the python side (an empty layout is refused there)
            other = DualKVLayout.from_tensors(self.cu_seqlens, self.segment_prefix)
            self.cu_seqlens, self.segment_prefix = other.cu_seqlens, other.segment_prefix  # int32, normal tensors
            self.prefix_lens, self.response_lens = other.prefix_lens, other.response_lens
            return
        # both sides given: the kernels read the tensors, position_ids()/replicated_index() the lists, so they must
        # agree. One read of each tensor (construction is not a hot path); skipped for fake / meta tensors.
        if len(self.prefix_lens) != len(self.response_lens):
            raise ValueError(f"prefix_lens has {len(self.prefix_lens)} groups but response_lens "
                             f"{len(self.response_lens)}: give one [R_g,0, ..] list per prompt (or build the layout "
                             f"with DualKVLayout.from_lengths)")
        _, _, self.prefix_lens, self.response_lens = _lists_from_lengths(list(zip(self.prefix_lens,
                                                                                  self.response_lens)))
        if _has_data(self.cu_seqlens) and _has_data(self.segment_prefix):
            self._check_agree()  # (the values fit int32: checked there)
            self.cu_seqlens, self.segment_prefix = _normal_int32(self.cu_seqlens), _normal_int32(self.segment_prefix)

    def _check_agree(self, total_tokens: Optional[int] = None) -> None:
        if self.cu_seqlens.dim() != 1 or self.segment_prefix.dim() != 1:
            raise ValueError("cu_seqlens and segment_prefix must be 1-D")
        cu = _offsets("cu_seqlens", self.cu_seqlens)
        sp = _offsets("segment_prefix", self.segment_prefix)
        _check_structure(cu, sp, total_tokens)
        ecu, esp, _, _ = _lists_from_lengths(list(zip(self.prefix_lens, self.response_lens)))
        if ecu != cu or esp != sp:
            raise ValueError(f"prefix_lens/response_lens disagree with cu_seqlens/segment_prefix: the lengths "
                             f"{list(zip(self.prefix_lens, self.response_lens))} give cu_seqlens {ecu} and "
                             f"segment_prefix {esp}, the tensors hold {cu} and {sp}; build the layout with "
                             f"DualKVLayout.from_lengths or DualKVLayout.from_tensors so both sides agree")

    # ------------------------------------------------------------------ properties
    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_segments(self) -> int:
        return self.num_groups + sum(len(r) for r in self.response_lens)

    @property
    def total_tokens(self) -> int:
        return sum(self.prefix_lens) + sum(sum(r) for r in self.response_lens)

    @property
    def max_seqlen(self) -> int:
        """Longest single segment (prefix or response)."""
        return max([*self.prefix_lens, *(r for rs in self.response_lens for r in rs)])

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @torch.inference_mode(False)  # a copy made during a rollout still trains (as the packers' tensors)
    def to(self, device) -> "DualKVLayout":
        return DualKVLayout._trusted(self.cu_seqlens.to(device), self.segment_prefix.to(device),
                                     list(self.prefix_lens), [list(r) for r in self.response_lens])

    # ------------------------------------------------------------------ checks
    def trajectory_lengths(self) -> list:
        """Python list: tokens of each trajectory (a prompt and one of its responses; a prompt without responses
        alone), group by group."""
        return [p + r for p, rs in zip(self.prefix_lens, self.response_lens) for r in (rs or [0])]

    def validate(self, total_tokens: Optional[int] = None) -> None:
        """Check the tensors against each other, the python lengths and ``total_tokens`` (T).

        Raises:
            ValueError: wrong dtype/shape, offsets not monotone, a zero-length segment, offsets that do not sum to
                ``total_tokens``, a response not directly after its prefix, or python lengths that disagree.
        """
        if self.cu_seqlens.dtype != torch.int32 or self.segment_prefix.dtype != torch.int32:
            raise ValueError(f"cu_seqlens and segment_prefix must be int32; got {self.cu_seqlens.dtype}, "
                             f"{self.segment_prefix.dtype}")
        if self.cu_seqlens.dim() != 1 or self.segment_prefix.dim() != 1:
            raise ValueError("cu_seqlens and segment_prefix must be 1-D")
        if self.cu_seqlens.device != self.segment_prefix.device:
            raise ValueError(f"cu_seqlens is on {self.cu_seqlens.device} but segment_prefix on "
                             f"{self.segment_prefix.device}")
        self._check_agree(total_tokens)

    # ------------------------------------------------------------------ derived index tensors
    def position_ids(self) -> torch.Tensor:
        """int64 ``(T,)``: ``0..P-1`` on a prefix, ``P..P+R-1`` on each of its responses."""
        parts = []
        for p, rs in zip(self.prefix_lens, self.response_lens):
            parts.append(torch.arange(p))
            for r in rs:
                parts.append(torch.arange(p, p + r))
        return torch.cat(parts).to(self.device)

    def replicated_index(self) -> torch.Tensor:
        """int64 index of length ``Σ_g Σ_i (P_g + R_g,i)``: ``packed[idx]`` is the replicated layout, every
        response as its own sequence ``prefix + response``, groups and responses in packing order. A group without
        responses contributes nothing."""
        parts, off = [], 0
        for p, rs in zip(self.prefix_lens, self.response_lens):
            pre = torch.arange(off, off + p)
            roff = off + p
            for r in rs:
                parts.append(pre)
                parts.append(torch.arange(roff, roff + r))
                roff += r
            off = roff
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.cat(parts).to(self.device)

    def replicated_cu_seqlens(self) -> torch.Tensor:
        """int32 ``(ΣN+1,)`` boundaries of the replicated sequences (``P_g + R_g,i`` each)."""
        lens = [p + r for p, rs in zip(self.prefix_lens, self.response_lens) for r in rs]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=self.device)

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs the DualKV mask lets through (for FLOP counts)."""
        n = 0
        for p, rs in zip(self.prefix_lens, self.response_lens):
            n += p * (p + 1) // 2
            for r in rs:
                n += r * p + r * (r + 1) // 2
        return n
