"""The DualKV transform: shared-prefix packed training for GRPO/DAPO-style RL (DualKV, arXiv 2605.15422, §2–3).

N responses that share one prompt of P tokens are packed as ``[P][R_1]...[R_N]`` (``P + ΣR`` tokens instead of
``Σ(P + R_i)``): every per-token op (embeddings, projections, MLP, norms, LM head) runs once on the prompt, and every
attention becomes ``kvt.dualkv_attention``, in which a response token sees its group's prompt and its own response
so far, never another response. Log-probabilities and gradients equal those of the N separate sequences.

Public API (DESIGN.md §2)::

    opt = kvt.transform(model, "dualkv")                        # or kvt.DualKVConfig(...)
    batch = kvt.pack_shared_prefix(prompt_ids, [r1, r2, r3])    # one group
    batch = kvt.pack_shared_prefix_groups([(p_a, [ra1, ra2]), (p_b, [rb1])])
    logits = opt(batch)                                         # (1, T, vocab)
    logprobs = batch.response_logprobs(logits)                  # [ (R_i,) ... ]
    loss = -sum(a * lp.sum() for a, lp in zip(advantages, logprobs)); loss.backward()   # grads on model's params

The transformed module's parameters are the original model's ``Parameter`` objects, so an optimiser built on
``model.parameters()`` trains it.
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch.export import Dim

from .api import OptimizedModule, _check_model, _device_of, _model_name, _stage, register_module_type, \
    register_transform
from .config import DualKVConfig
from .layout import DualKVLayout
from .report import Report, Verification

__all__ = ["PackedBatch", "pack_shared_prefix", "pack_shared_prefix_groups", "DualKVModule", "dualkv_transform",
           "check_exactness", "replicated_logprobs", "run_demo"]

TokenIds = Union[Sequence[int], torch.Tensor]


# ====================================================================================================== packing
def _token_id(v, what: str, j: int) -> int:
    """One token id as a python int: python ints, NumPy integer scalars and 0-d integer tensors (``operator.index``);
    floats, bools and strings raise ValueError."""
    bad = isinstance(v, (bool, str, bytes)) or (isinstance(v, torch.Tensor) and (v.dim() != 0 or v.dtype == torch.bool)) \
        or type(v).__name__ in ("bool_", "bool") and type(v).__module__ == "numpy"
    if not bad:
        try:
            return operator.index(v)
        except TypeError:
            pass
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
        x = torch.tensor(x.astype("int64"))
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{what} must be a 1-D tensor or a list of token ids; got a tensor of shape "
                             f"{tuple(x.shape)}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{what} must hold integer token ids; got dtype {x.dtype}")
        t = x.detach().to("cpu", torch.long)
    else:
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

    def to(self, device) -> "PackedBatch":
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
        if not isinstance(logits, torch.Tensor):
            raise ValueError(f"logits must be a tensor (1, T, vocab); got {type(logits).__name__}")
        if not logits.dtype.is_floating_point:
            raise ValueError(f"logits must be a floating-point tensor (the model's output, e.g. float32/bfloat16); "
                             f"got dtype {logits.dtype}: pass the logits, not token ids or argmax indices")
        if logits.dim() == 3:
            if logits.shape[0] != 1:
                raise ValueError(f"logits must be (1, T, vocab) for a packed batch; got {tuple(logits.shape)}")
            logits = logits[0]
        elif logits.dim() != 2:
            raise ValueError(f"logits must be (1, T, vocab) or (T, vocab); got shape {tuple(logits.shape)}")
        if logits.shape[0] != self.num_tokens:
            raise ValueError(f"logits have {logits.shape[0]} positions but the packed batch has T = "
                             f"{self.num_tokens} tokens: these logits do not belong to this batch")
        vmax = int(self.input_ids.max())
        if logits.shape[1] <= vmax:
            raise ValueError(f"logits have a vocabulary of {logits.shape[1]} but the batch holds token id {vmax}")
        rows, tgts = self._index()
        rows, tgts = rows.to(logits.device), tgts.to(logits.device)
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        sel = logits.index_select(0, rows).to(work)
        lp = torch.log_softmax(sel, dim=-1).gather(1, self.input_ids[0].to(logits.device)[tgts][:, None])[:, 0]
        return list(torch.split(lp, self.response_lengths))

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Check ids, positions and layout against each other. Raises ValueError naming the mismatch."""
        _check_packed(self.input_ids, self.position_ids, self.layout, vocab_size)


def pack_shared_prefix_groups(groups: Sequence[tuple], vocab_size: Optional[int] = None,
                              device: Union[str, torch.device, None] = None) -> PackedBatch:
    """Pack several groups ``[(prompt_ids, [response_ids, ...]), ...]`` into one :class:`PackedBatch`.

    Args:
        groups: per group a prompt (list of ints or NumPy integers, 1-D integer tensor or NumPy array, ≥ 1 token)
            and a non-empty list of responses (same types, ≥ 1 token each).
        vocab_size: when given, every id must be ``< vocab_size``.
        device: device of the batch tensors (default CPU, or the device of the first tensor given).

    Returns:
        :class:`PackedBatch` with ``T = Σ_g (P_g + Σ_i R_g,i)``.

    Raises:
        ValueError: no groups, a group without responses, an empty prompt or response, a non-integer or negative
            token id, or an id ``>= vocab_size``.
    """
    if isinstance(groups, (torch.Tensor, str)) or not hasattr(groups, "__len__") or len(groups) == 0:
        raise ValueError("pack_shared_prefix_groups needs a non-empty list of (prompt_ids, [response_ids, ...])")
    packed_groups, ids, pos, lens = [], [], [], []
    for g, grp in enumerate(groups):
        if not isinstance(grp, (tuple, list)) or len(grp) != 2:
            raise ValueError(f"group {g} must be a pair (prompt_ids, [response_ids, ...]); got {type(grp).__name__}")
        prompt, responses = grp
        if device is None and isinstance(prompt, torch.Tensor):
            device = prompt.device
        p = _as_ids(prompt, f"group {g}: prompt", vocab_size)
        if isinstance(responses, torch.Tensor) or not hasattr(responses, "__len__"):
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


def _check_packed(input_ids, position_ids, layout: DualKVLayout, vocab_size: Optional[int]) -> None:
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"packed input_ids must be (1, T); got shape {tuple(input_ids.shape)}")
    t = int(input_ids.shape[1])
    try:
        layout.validate(total_tokens=t)
    except ValueError as e:
        raise ValueError(f"the batch layout does not match its {t} tokens: {e}") from None
    if tuple(position_ids.shape) != (1, t):
        raise ValueError(f"position_ids must be (1, T={t}); got shape {tuple(position_ids.shape)}")
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


# ====================================================================================================== module
class _PackedLogits(torch.nn.Module):
    """Adapter: ``(input_ids (1, T), position_ids (1, T), cu_seqlens, segment_prefix) -> logits (1, T, V)``
    around the rewritten packed graph; a reloaded ``.pt2`` has the same signature."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, input_ids, position_ids, cu_seqlens, segment_prefix):
        return self.gm(input_ids, position_ids, cu_seqlens, segment_prefix)


@register_module_type("dualkv")
class DualKVModule(OptimizedModule):
    """A model transformed for packed shared-prefix batches (trainable; parameters are the original model's).

    Call it as ``opt(batch) -> logits (1, T, vocab)`` with a :class:`PackedBatch`, or
    ``opt(input_ids (1, T), cu_seqlens=..., segment_prefix=..., position_ids=None)`` with the layout tensors
    (int32; ``position_ids`` derived from the layout when omitted), or ``opt(input_ids, layout)`` with a
    :class:`~kvtransform.layout.DualKVLayout`. Use :meth:`PackedBatch.response_logprobs` on the logits.

    Raises (forward):
        ValueError: a plain ``(B, S)`` batch without a layout, a layout whose offsets do not sum to ``T`` or are
            malformed, ``position_ids`` that disagree with the layout, or token ids outside the vocabulary.
    """

    def __init__(self, core: torch.nn.Module, config: DualKVConfig, report: Report, max_seq_len: int = 1 << 20):
        super().__init__(core, config, report, max_seq_len=max_seq_len)

    def forward(self, batch: Union[PackedBatch, torch.Tensor, None] = None, layout: Optional[DualKVLayout] = None,
                *, input_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, segment_prefix: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        input_ids, position_ids, lay = self._normalise(batch, layout, input_ids, position_ids, cu_seqlens,
                                                       segment_prefix)
        _check_packed(input_ids, position_ids, lay, self.vocab_size)
        return self.core(input_ids, position_ids, lay.cu_seqlens, lay.segment_prefix)

    def _normalise(self, batch, layout, input_ids, position_ids, cu_seqlens, segment_prefix):
        dev = _device_of(self)
        if isinstance(batch, PackedBatch):
            if any(x is not None for x in (layout, input_ids, position_ids, cu_seqlens, segment_prefix)):
                raise ValueError("pass either a PackedBatch or input_ids with layout tensors, not both")
            b = batch.to(dev) if batch.device != dev else batch
            return b.input_ids, b.position_ids, b.layout
        if batch is not None:
            if input_ids is not None:
                raise ValueError("input_ids given twice (positionally and as a keyword)")
            input_ids = batch
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError("DualKVModule takes a PackedBatch (kvt.pack_shared_prefix / pack_shared_prefix_groups) "
                             f"or input_ids (1, T) with cu_seqlens and segment_prefix; got {type(batch).__name__}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if layout is None:
            if cu_seqlens is None or segment_prefix is None:
                raise ValueError(
                    f"this module expects a packed shared-prefix batch but got input_ids of shape "
                    f"{tuple(input_ids.shape)} without a layout: build one with kvt.pack_shared_prefix(prompt, "
                    f"responses), or pass cu_seqlens= and segment_prefix= (int32)")
            for name, t in (("cu_seqlens", cu_seqlens), ("segment_prefix", segment_prefix)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                    raise ValueError(f"{name} must be a 1-D int32 tensor")
            try:
                layout = DualKVLayout.from_tensors(cu_seqlens, segment_prefix)
            except ValueError as e:
                raise ValueError(f"invalid packed layout: {e}") from None
        elif not isinstance(layout, DualKVLayout):
            raise ValueError(f"layout must be a DualKVLayout; got {type(layout).__name__}")
        layout = layout.to(dev) if layout.device != dev else layout
        input_ids = input_ids.to(dev)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"packed input_ids must be (1, T); got shape {tuple(input_ids.shape)}")
        if layout.total_tokens != input_ids.shape[1]:
            raise ValueError(f"layout mismatch: the layout describes {layout.total_tokens} tokens but input_ids has "
                             f"{input_ids.shape[1]}")
        position_ids = layout.position_ids()[None] if position_ids is None else position_ids.to(dev)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        return input_ids, position_ids.long(), layout

    def export_example(self):
        dev = _device_of(self)
        b = pack_shared_prefix([1, 2, 3, 4, 5], [[6, 7, 8], [9, 10, 11, 12]], device=dev)
        tok = Dim("tokens", min=2, max=self.max_seq_len)
        seg = Dim("segments", min=2, max=self.max_seq_len)
        seg1 = Dim("segments_plus_1", min=3, max=self.max_seq_len + 1)
        args = (b.input_ids, b.position_ids, b.cu_seqlens, b.segment_prefix)
        return args, ({1: tok}, {1: tok}, {0: seg1}, {0: seg})


# ====================================================================================================== exactness
def _params(model) -> list:
    seen, out = set(), []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def replicated_logprobs(model, batch: PackedBatch, padded: bool = False) -> list:
    """Per-response log-probs from the *original* model run on the replicated batch (every response as its own
    sequence ``prompt + response``): N separate forwards, or with ``padded`` one right-padded ``(N, max_len)``
    batch with an attention mask (what a trainer without packing runs). Differentiable; list of ``(R_i,)``."""
    dev = _device_of(model)
    seqs = batch.replicated_sequences()
    plens = [p.numel() for p, rs in batch.groups for _ in rs]
    rlens = batch.response_lengths
    outs = []
    if padded:
        n, s = len(seqs), max(x.numel() for x in seqs)
        ids = torch.zeros(n, s, dtype=torch.long)
        am = torch.zeros(n, s, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, :x.numel()] = x
            am[i, :x.numel()] = 1
        logits = model(input_ids=ids.to(dev), attention_mask=am.to(dev), use_cache=False).logits
        rows = [logits[i] for i in range(n)]
    else:
        rows = [model(input_ids=x[None].to(dev), use_cache=False).logits[0] for x in seqs]
    for x, lg, p, r in zip(seqs, rows, plens, rlens):
        work = torch.float64 if lg.dtype == torch.float64 else torch.float32
        lp = torch.log_softmax(lg[p - 1:p + r - 1].to(work), -1).gather(1, x[p:p + r].to(dev)[:, None])[:, 0]
        outs.append(lp)
    return outs


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.detach().double(), b.detach().double()
    err = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    return err, err / scale if scale > 0 else err


def check_exactness(model, opt: DualKVModule, batch: PackedBatch, advantages: Optional[torch.Tensor] = None,
                    backward: bool = True, padded: bool = False) -> dict:
    """Compare the transformed module on ``batch`` with the original model on the replicated batch.

    Compares the per-response log-probs and, with ``backward``, the gradient of every parameter of
    ``loss = Σ_i advantage_i · Σ_j logprob_ij`` (``torch.autograd.grad``: ``.grad`` of the model is untouched).

    Args:
        model: the original model (whose parameters ``opt`` shares).
        opt: the :class:`DualKVModule`.
        batch: a :class:`PackedBatch`.
        advantages: ``(N,)`` (default: standard normal, seeded 0).
        backward: also compare gradients.
        padded: run the original as one right-padded batch instead of N separate sequences.

    Returns:
        dict: ``logprobs_abs``/``logprobs_rel`` (max abs error, and that over max |reference|); ``grad_abs``,
        ``grad_rel`` (the worst parameter's max abs error, and that over the parameter's max |reference
        gradient|), ``grad_worst`` (its name); ``grad_global_rel`` (``‖g − g_ref‖₂ / ‖g_ref‖₂`` over all
        parameters as one vector); ``num_params``.

    Note: in fp32 the per-parameter ``grad_rel`` of a deep model has a noise floor set by the original model itself:
    on SmolLM2-135M (30 layers) the original run as N separate sequences and as one padded batch already differ by
    ~3e-5 on some LayerNorm weights (summation order); ``grad_global_rel`` sits at ~4e-6 for both.
    """
    n = batch.num_responses
    if advantages is None:
        advantages = torch.randn(n, generator=torch.Generator().manual_seed(0))
    dev = _device_of(model)
    params = _params(model)
    res: dict[str, Any] = {}
    with torch.set_grad_enabled(backward):
        lp_new = batch.response_logprobs(opt(batch))
        lp_ref = replicated_logprobs(model, batch, padded=padded)
    a = torch.cat([x.detach() for x in lp_new])
    b = torch.cat([x.detach() for x in lp_ref])
    res["logprobs_abs"], res["logprobs_rel"] = _rel(a, b)
    if backward:
        adv = advantages.to(dev, torch.float64 if a.dtype == torch.float64 else torch.float32)
        ps = [p for _, p in params]
        loss_new = sum(adv[i] * lp.sum() for i, lp in enumerate(lp_new))
        loss_ref = sum(adv[i] * lp.sum() for i, lp in enumerate(lp_ref))
        g_new = torch.autograd.grad(loss_new, ps, allow_unused=True)
        g_ref = torch.autograd.grad(loss_ref, ps, allow_unused=True)
        worst = (0.0, 0.0, "")
        sq_diff, sq_ref = 0.0, 0.0
        for (name, p), x, y in zip(params, g_new, g_ref):
            if x is None and y is None:
                continue
            x = (torch.zeros_like(p) if x is None else x).detach().double()
            y = (torch.zeros_like(p) if y is None else y).detach().double()
            sq_diff += float(((x - y) ** 2).sum())
            sq_ref += float((y ** 2).sum())
            e, r = _rel(x, y)
            if r > worst[1] or r != r:
                worst = (e, r, name)
        res["grad_abs"], res["grad_rel"], res["grad_worst"] = worst
        res["grad_global_rel"] = math.sqrt(sq_diff / sq_ref) if sq_ref > 0 else math.sqrt(sq_diff)
        res["num_params"] = len(params)
    return res


def _verify_batch(cfg: DualKVConfig, tokenizer, vocab: int, device) -> PackedBatch:
    """Packed batch of real text (the shipped prompts) in the shape of ``cfg.verify_groups``."""
    from .passes.verify import text_token_ids

    gen = torch.Generator().manual_seed(cfg.verify.seed)
    groups, off = [], 0
    for g in cfg.verify_groups:
        if not isinstance(g, (list, tuple)) or len(g) != 2:
            raise ValueError(f"verify_groups entries must be [prompt_len, [response_lens...]]; got {g!r}")
        p, rs = int(g[0]), [int(r) for r in g[1]]
        prompt = text_token_ids(tokenizer, vocab, p, offset=off, generator=gen)
        off += p + 7
        resp = []
        for r in rs:
            resp.append(text_token_ids(tokenizer, vocab, r, offset=off, generator=gen))
            off += r + 3
        groups.append((prompt, resp))
    return pack_shared_prefix_groups(groups, vocab_size=vocab, device=device)


def run_gate(model, opt: DualKVModule, cfg: DualKVConfig, tokenizer, report: Report, progress: bool) -> None:
    """The dualkv transform's verification gate: log-probs (and gradients, ``cfg.verify_backward``) of the packed
    module vs the original model on the replicated ``cfg.verify_groups`` batch of real text; fills
    ``report.verification`` and raises :class:`~kvtransform.passes.verify.VerificationError` beyond tolerance.

    Enforced: per-response log-probs (max abs error / max |ref|) ``<= verify.tolerance`` (fp32 1e-4, bf16/fp16
    2e-2 by default) and the gradient of ``Σ adv_i Σ logprobs_i`` over all parameters (``‖g − g_ref‖₂ /
    ‖g_ref‖₂``) ``<= verify_grad_tolerance`` (fp32 1e-4, bf16/fp16 5e-2 by default).
    The worst single parameter's max relative error is recorded as an informational case."""
    from .passes.verify import check, default_tolerance

    if not cfg.verify.enabled:
        return
    param = next(model.parameters())
    tol = default_tolerance(param.dtype, cfg.verify.tolerance)
    gtol = cfg.verify_grad_tolerance
    if gtol is None:
        gtol = {torch.float32: 1e-4, torch.float64: 1e-8}.get(param.dtype, 5e-2)
    batch = _verify_batch(cfg, tokenizer, model.config.vocab_size, param.device)
    n = batch.num_responses
    adv = torch.randn(n, generator=torch.Generator().manual_seed(cfg.verify.seed))
    with _stage(progress, f"verifying exactness vs the replicated batch ({n} responses, {batch.num_tokens} packed "
                          f"tokens)"):
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            res = check_exactness(model, opt, batch, adv, backward=cfg.verify_backward)
        finally:
            model.train(was_training)
        report.timings["verify"] = round(time.perf_counter() - t0, 3)
    v = Verification(tolerance=float(tol))
    shape = [1, batch.num_tokens]
    v.cases.append({"name": "logprobs", "shape": shape, "max_abs_error": res["logprobs_abs"],
                    "max_rel_error": res["logprobs_rel"]})
    if "grad_rel" in res:
        v.cases.append({"name": f"grad, all {res['num_params']} parameters (L2; tolerance {gtol:g})", "shape": shape,
                        "max_abs_error": res["grad_abs"], "max_rel_error": res["grad_global_rel"]})
    ok = all(c["max_rel_error"] <= tol for c in v.cases[:1]) and all(c["max_rel_error"] <= gtol for c in v.cases[1:])
    enforced = list(v.cases)
    if "grad_rel" in res:
        # Per parameter (max abs / max |ref|) is reported, not enforced: its floor is the original model's own
        # summation-order noise (fp32, 30 layers: ~3e-5 between two ways of running the original itself).
        v.cases.append({"name": f"grad, worst parameter {res['grad_worst']} (informational)", "shape": shape,
                        "max_abs_error": res["grad_abs"], "max_rel_error": res["grad_rel"]})
    v.max_abs_error = max(c["max_abs_error"] for c in enforced)
    v.max_rel_error = max(c["max_rel_error"] for c in enforced)
    bad = any(c["max_rel_error"] != c["max_rel_error"] for c in v.cases)
    v.passed = bool(not bad and ok)
    report.verification = v
    check(v)


# ====================================================================================================== transform
@register_transform("dualkv")
def dualkv_transform(model, cfg: DualKVConfig, tokenizer=None, progress: bool = True) -> DualKVModule:
    """DualKV transform: packed capture → canonical attention (mask proven causal) → ``kvt.dualkv_attention`` →
    cleanup → exactness gate on the replicated batch.

    Raises:
        ValueError: not a causal LM, or an attention the packed layout cannot express (sliding window, custom mask):
            the message lists the refused sites.
        kvtransform.passes.verify.VerificationError: the packed module differs from the original beyond tolerance.
    """
    from .capture import capture_packed
    from .passes.attention import canonicalize_attention
    from .passes.cleanup import cleanup
    from .passes.dualkv import dualkv_attention_pass
    from .passes.manager import PassContext, PassManager

    _check_model(model)
    report = Report(model=_model_name(model), transform=cfg.name)
    with _stage(progress, "capturing the model (packed, torch.export)"):
        t0 = time.perf_counter()
        cap = capture_packed(model)
        report.timings["capture"] = round(time.perf_counter() - t0, 3)
    ctx = PassContext(report, model.config, int(getattr(model.config, "max_position_embeddings", 4096) or 4096))
    with _stage(progress, "running passes") as st:
        gm = PassManager([("attention", canonicalize_attention), ("dualkv", dualkv_attention_pass),
                          ("cleanup", cleanup)]).run(cap.graph_module, ctx,
                                                     progress=(lambda n: st.update(f"running pass {n}")) if st
                                                     else None)
    rec = report.pass_record("dualkv")
    if rec.skipped or rec.rewritten == 0:
        reasons = "; ".join(sorted({f"site {s['site']}: {s['reason']}" for s in rec.skipped})) or \
            "no attention found"
        raise ValueError(f"the dualkv transform cannot rewrite this model: {reasons}. Packed shared-prefix "
                         f"attention supports causal attention only (no sliding window or custom masks)")
    remaining = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in
                    (torch.ops.kvt.attention.default, torch.ops.aten.scaled_dot_product_attention.default))
    if remaining:
        raise ValueError(f"{remaining} attention nodes were left unrewritten; refusing to build a packed module")
    opt = DualKVModule(_PackedLogits(gm), cfg, report, max_seq_len=cap.max_seq_len)
    run_gate(model, opt, cfg, tokenizer, report, progress)
    return opt


# ====================================================================================================== demo
def _sample_responses(model, tokenizer, prompt: torch.Tensor, n: int, max_new: int, seed: int,
                      temperature: float, min_new: int = 1) -> list:
    """N responses sampled from ``model`` after ``prompt`` (cut after EOS, which is kept)."""
    dev = _device_of(model)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    eos_set = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev]), torch.no_grad():
        torch.manual_seed(seed)
        ids = prompt[None].to(dev)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new,
                             min_new_tokens=max(0, min(min_new, max_new)),
                             num_return_sequences=n, pad_token_id=next(iter(eos_set), 0))
    responses = []
    for row in out[:, prompt.numel():].cpu():
        r = row.tolist()
        cut = next((j + 1 for j, t in enumerate(r) if t in eos_set), len(r))
        responses.append(torch.tensor(r[:cut] or r[:1], dtype=torch.long))
    return responses


def _time_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Median wall seconds of ``fa`` and ``fb``, run alternately (so load from other processes hits both alike)
    after one warm-up each."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fa(), fb()
    ta, tb = [], []
    for _ in range(max(1, repeats)):
        for f, ts in ((fa, ta), (fb, tb)):
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            ts.append(time.perf_counter() - t0)
    return sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2]


def run_demo(model, tokenizer, opt: DualKVModule, cfg: DualKVConfig, console=None) -> dict:
    """The ``kvtransform optimize transform=dualkv`` demo: a real GRPO-like batch on this machine.

    A real prompt from the shipped text (``kvtransform/data/prompts.txt``), ``cfg.demo.num_responses`` responses
    sampled from the model itself, random advantages; checks exactness (per-response log-probs and every parameter
    gradient) against the original model on the replicated batch, times forward+backward of the packed module and of
    the original on the right-padded replicated batch, and reports the token ratio ρ = Σ_i(P+R_i)/(P+ΣR).

    Returns:
        dict with ``P``, ``R`` (lengths), ``rho``, ``rho_padded`` (N·(P+max R)/(P+ΣR)), exactness errors,
        ``packed_ms``/``replicated_ms`` (median fwd+bwd), ``speedup``, and the demo's own wall time in seconds:
        ``sample_s`` (sampling the responses), ``check_s`` (exactness check), ``time_s`` (the timed fwd+bwd runs),
        ``demo_s`` (all of it; also ``opt.report.timings["demo"]``).
    """
    from .passes.verify import sample_text, text_token_ids

    t_start = time.perf_counter()
    d = cfg.demo
    vocab = model.config.vocab_size
    lines = [ln for ln in sample_text().splitlines() if ln.strip()]
    if tokenizer is not None:
        line = lines[d.prompt_index % len(lines)]
        prompt = torch.tensor(tokenizer(line, add_special_tokens=False)["input_ids"], dtype=torch.long)
    else:
        prompt = text_token_ids(None, vocab, 48, generator=torch.Generator().manual_seed(d.seed))
    responses = _sample_responses(model, tokenizer, prompt, d.num_responses, d.max_new_tokens, d.seed,
                                  d.temperature, d.min_new_tokens)
    t_sampled = time.perf_counter()
    batch = pack_shared_prefix(prompt, responses, vocab_size=vocab, device=_device_of(model))
    adv = torch.randn(len(responses), generator=torch.Generator().manual_seed(d.seed))
    exact = check_exactness(model, opt, batch, adv, backward=True, padded=True)
    t_checked = time.perf_counter()
    dev = _device_of(model)
    advd = adv.to(dev)
    ps = [p for _, p in _params(model)]

    def packed_step():
        lps = batch.response_logprobs(opt(batch))
        torch.autograd.grad(sum(advd[i] * lp.sum() for i, lp in enumerate(lps)), ps, allow_unused=True)

    def replicated_step():
        lps = replicated_logprobs(model, batch, padded=True)
        torch.autograd.grad(sum(advd[i] * lp.sum() for i, lp in enumerate(lps)), ps, allow_unused=True)

    tp, tr = _time_pair(packed_step, replicated_step, d.repeats)
    t_end = time.perf_counter()
    p, rs = prompt.numel(), batch.response_lengths
    res = dict(P=p, R=rs, N=len(rs), T=batch.num_tokens, rho=batch.token_ratio,
               rho_padded=len(rs) * (p + max(rs)) / batch.num_tokens, **exact,
               packed_ms=1e3 * tp, replicated_ms=1e3 * tr, sample_s=t_sampled - t_start,
               check_s=t_checked - t_sampled, time_s=t_end - t_checked, demo_s=t_end - t_start)
    res["speedup"] = res["replicated_ms"] / res["packed_ms"]
    if console is not None:
        from rich.table import Table

        t = Table(title="DualKV demo: real GRPO-like batch (responses sampled from the model)", title_justify="left")
        t.add_column("")
        t.add_column("value")
        text = tokenizer.decode(prompt) if tokenizer is not None else f"{p} random tokens"
        t.add_row("prompt", (text[:90] + "…") if len(text) > 90 else text)
        t.add_row("P, N, R_i", f"P={p}, N={len(rs)}, R={rs}")
        t.add_row("packed tokens T = P+ΣR", f"{batch.num_tokens}  (replicated {batch.replicated_tokens}, padded "
                                             f"{len(rs) * (p + max(rs))})")
        t.add_row("token ratio ρ = Σ(P+R_i)/(P+ΣR)", f"{res['rho']:.2f}  (vs padded: {res['rho_padded']:.2f})")
        t.add_row("log-prob max rel error", f"{res['logprobs_rel']:.2e} (abs {res['logprobs_abs']:.2e})")
        t.add_row("gradient rel error, all params (L2)", f"{res['grad_global_rel']:.2e}  ({res['num_params']} "
                                                         f"params)")
        t.add_row("gradient rel error, worst param (max)", f"{res['grad_rel']:.2e}  ({res['grad_worst']})")
        t.add_row("fwd+bwd packed (DualKV)", f"{res['packed_ms']:.1f} ms")
        t.add_row("fwd+bwd original, padded replicated", f"{res['replicated_ms']:.1f} ms")
        t.add_row("speedup", f"{res['speedup']:.2f}×  (medians of {d.repeats}, interleaved, {dev})")
        t.add_row("demo wall time", f"{res['demo_s']:.1f} s  (sampling {res['sample_s']:.1f} s, exactness check "
                                    f"{res['check_s']:.1f} s, timed fwd+bwd {res['time_s']:.1f} s)")
        console.print(t)
    opt.report.timings["demo_packed_fwd_bwd_ms"] = round(res["packed_ms"], 2)
    opt.report.timings["demo_replicated_fwd_bwd_ms"] = round(res["replicated_ms"], 2)
    opt.report.timings["demo"] = round(res["demo_s"], 3)
    return res
