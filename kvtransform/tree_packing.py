"""Packed prefix-tree batches: whole trajectories merged into a token trie, every shared prefix stored once.

RL rollouts of multi-turn and agentic tasks are trees: a system prompt and task shared by every trajectory, then
turns that branch. :func:`pack_trajectories` takes the N trajectories as whole token sequences, merges them into a
compressed token trie (each trie chain one node, at any depth: Tree Training, arXiv 2511.00413) and packs the nodes
depth-first into one token axis with a :class:`~kvtransform.tree_layout.PrefixTreeLayout`; DualKV's ``[P][R_1..R_N]``
(arXiv 2605.15422, :mod:`kvtransform.packing`) is the one-level case::

    batch = kvt.pack_trajectories([seq_1, ..., seq_N])       # 1-D token ids, each a whole conversation
    logits = model(batch.input_ids, position_ids=batch.position_ids, ...)       # tree attention on batch.layout
    lps = batch.trajectory_logprobs(logits)                  # N tensors [len(seq_i) - 1]
    masks = batch.loss_mask_tensors()                        # N bool tensors [len(seq_i) - 1] (e.g. assistant turns)

A shared token's logit row is computed once; ``trajectory_logprobs`` gathers it for every trajectory through it, so
autograd sums its gradient over those trajectories: the loss and gradients equal running each trajectory separately.
"""
from __future__ import annotations

import numbers
import operator
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from .layout import _as_device
from .ops._common import as_int
from .packed_logits import packed_logits
from .tree_layout import PrefixTreeLayout, _as_index

TokenIds = Union[Sequence[int], torch.Tensor]

__all__ = ["TreeBatch", "pack_trajectories"]


@dataclass
class TreeBatch:
    """N trajectories packed as a prefix tree in one token axis of length ``T``.

    Attributes:
        input_ids: int64 ``(1, T)``, the nodes' tokens in packing (depth-first) order.
        position_ids: int64 ``(1, T)``: each node continues its parent's positions (a root starts at 0).
        layout: :class:`~kvtransform.tree_layout.PrefixTreeLayout` on the batch's device.
        sequences: the N trajectories as given (1-D int64, CPU).
        end_nodes: python list, the node each trajectory ends in (its tokens are the root→node path).
        loss_masks: ``None`` or N bool ``(len(seq_i),)`` CPU tensors over the trajectory's tokens.

    Build it with :func:`pack_trajectories`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: PrefixTreeLayout
    sequences: list
    end_nodes: list
    loss_masks: Optional[list] = None
    _index: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ views
    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_tokens(self) -> int:
        """``T``: tokens stored in the packed axis."""
        return int(self.input_ids.shape[1])

    @property
    def num_trajectories(self) -> int:
        return len(self.sequences)

    @property
    def replicated_tokens(self) -> int:
        """``Σ_i len(seq_i)``: the tokens of the trajectories run separately."""
        return sum(int(s.numel()) for s in self.sequences)

    @property
    def token_ratio(self) -> float:
        """Replicated tokens / packed tokens (>= 1)."""
        return self.replicated_tokens / self.num_tokens

    @torch.inference_mode(False)  # a copy made during a rollout still trains (as the packers' tensors)
    def to(self, device) -> "TreeBatch":
        device = _as_device(device)
        return TreeBatch(self.input_ids.to(device), self.position_ids.to(device), self.layout.to(device),
                         self.sequences, self.end_nodes, self.loss_masks)

    def token_index(self, i: int) -> torch.Tensor:
        """int64 CPU ``(len(seq_i),)``: packed positions of trajectory ``i``'s tokens in order (``i`` in
        ``0..N-1``, else IndexError, one line)."""
        i = _as_index(i, "trajectory")
        if not 0 <= i < self.num_trajectories:
            raise IndexError(f"trajectory {i} is out of range: this batch holds trajectories "
                             f"0..{self.num_trajectories - 1}")
        return self.layout.path_index(self.end_nodes[i])

    # ------------------------------------------------------------------ indices
    def _targets(self):
        """``(tgt, pred, per_traj)``: every packed token that has a predecessor (all but each root's first token),
        its predecessor's packed position (for a node's first token: its parent's last token), and per trajectory the
        index into ``tgt`` of its tokens 1.. (int64 CPU)."""
        if "tgt" not in self._index:
            self._index.update(self._build_targets())
        return self._index["tgt"], self._index["pred"], self._index["per"]

    @torch.inference_mode(False)  # cached: built under inference_mode they could never be saved for a backward
    def _build_targets(self) -> dict:
        """What :meth:`_targets` caches, built as normal tensors whatever the caller's inference mode."""
        lay = self.layout
        cu = lay._cu
        t = lay.total_tokens
        pred = torch.arange(-1, t - 1)
        for n, p in enumerate(lay.parents):
            pred[cu[n]] = -1 if p < 0 else cu[p + 1] - 1
        tgt = (pred >= 0).nonzero()[:, 0]
        where = torch.full((t,), -1, dtype=torch.long)
        where[tgt] = torch.arange(tgt.numel())
        per = [where[self.token_index(i)[1:]] for i in range(self.num_trajectories)]
        return dict(tgt=tgt, pred=pred[tgt], per=per)

    def trajectory_logprobs(self, logits: torch.Tensor) -> list:
        """Per-trajectory log-probabilities of tokens ``1..len-1`` given the tokens before them.

        Args:
            logits: ``(1, T, vocab)`` or ``(T, vocab)``: the packed batch's logits (the model run with tree
                attention on :attr:`layout`).

        Returns:
            list of N float32 tensors (fp64 for fp64 logits) ``(len(seq_i) - 1,)``: entry ``t - 1`` is
            ``log p(seq_i[t] | seq_i[:t])``, read from the predecessor's packed row (a node's first token: its
            parent's last token). Differentiable; a shared row's gradient sums over every trajectory through it.

        Raises:
            ValueError: not a floating-point tensor, a wrong rank, a length other than T, or a vocabulary smaller
                than the largest token id.
        """
        logits = packed_logits(logits, self.num_tokens, self.input_ids)
        tgt, pred, per = self._targets()
        work = torch.float64 if logits.dtype == torch.float64 else torch.float32
        dev = logits.device
        rows, inv = torch.unique(pred, return_inverse=True)  # a branching row predicts several children
        lsm = torch.log_softmax(logits.index_select(0, rows.to(dev)).to(work), dim=-1)
        vals = lsm[inv.to(dev), self.input_ids[0].to(dev)[tgt.to(dev)]]
        return [vals[p.to(dev)] for p in per]

    def loss_mask_tensors(self) -> list:
        """Per trajectory a bool ``(len(seq_i) - 1,)`` CPU tensor aligned with :meth:`trajectory_logprobs`: True
        where the predicted token is trained (the given ``loss_masks[i][1:]``; all True without loss masks)."""
        if self.loss_masks is None:
            return [torch.ones(int(s.numel()) - 1, dtype=torch.bool) for s in self.sequences]
        return [m[1:].clone() for m in self.loss_masks]

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Check ids, positions, layout and every trajectory's tokens against each other; ValueError naming the
        mismatch."""
        t = self.num_tokens
        if tuple(self.input_ids.shape) != (1, t) or tuple(self.position_ids.shape) != (1, t):
            raise ValueError(f"input_ids and position_ids must be (1, T); got {tuple(self.input_ids.shape)}, "
                             f"{tuple(self.position_ids.shape)}")
        self.layout.validate(total_tokens=t)
        if not torch.equal(self.position_ids[0].cpu(), self.layout.position_ids().cpu()):
            raise ValueError("position_ids do not match the layout")
        ids = self.input_ids[0].cpu()
        for i, s in enumerate(self.sequences):
            if not torch.equal(ids[self.token_index(i)], s):
                raise ValueError(f"trajectory {i} is not the root→node path of node {self.end_nodes[i]}")
        if vocab_size is not None and int(ids.max()) >= _as_vocab(vocab_size):
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of {vocab_size} tokens")


def _as_vocab(v) -> int:
    """``vocab_size`` as a python int >= 1; ValueError (one line) for anything else."""
    try:
        ok = not isinstance(v, (bool, float, str, bytes)) and operator.index(v) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"vocab_size must be a positive integer (the model's vocabulary size) or None; got {v!r}")
    return operator.index(v)


def _as_mask(m, n: int, i: int) -> torch.Tensor:
    """Trajectory ``i``'s loss mask as a bool ``(n,)`` CPU tensor (bools, or 0/1 integers or floats); ValueError on a
    wrong length or another value."""
    if isinstance(m, (Mapping, Set)):
        raise ValueError(f"loss_masks[{i}] is a {type(m).__name__} (unordered): pass a list or 1-D tensor of bools, "
                         f"one per token")
    if isinstance(m, torch.Tensor):
        if m.device.type == "meta":
            raise ValueError(f"loss_masks[{i}] is on the meta device (no data): pass real bools")
        if m.dim() != 1:
            raise ValueError(f"loss_masks[{i}] must be 1-D over the trajectory's {n} tokens; got shape "
                             f"{tuple(m.shape)}")
        if m.dtype != torch.bool:  # 0/1 integers or floats (TRL keeps int masks, many RL loops float ones)
            if m.dtype.is_complex or not bool(((m == 0) | (m == 1)).all()):
                raise ValueError(f"loss_masks[{i}] must hold bools or 0/1 values (a weighted loss multiplies the "
                                 f"log-probs instead); got a value other than 0/1 in its {m.dtype} entries")
        t = m.detach().to("cpu", torch.bool)
    else:
        try:
            vals = list(m)
        except TypeError:
            raise ValueError(f"loss_masks[{i}] must be a 1-D bool tensor or a list of bools; got "
                             f"{type(m).__name__}") from None
        for j, x in enumerate(vals):
            if isinstance(x, torch.Tensor) and x.numel() == 1:  # a list of 0-d tensors (iterating a mask tensor)
                x = x.item()
            try:
                ok = isinstance(x, bool) or (type(x).__name__ in ("bool_", "bool")) or \
                    (hasattr(x, "__index__") and operator.index(x) in (0, 1)) or \
                    (isinstance(x, numbers.Real) and x in (0.0, 1.0))
            except TypeError:  # an array or a tensor of several values where one value belongs
                ok = False
            if not ok:
                raise ValueError(f"loss_masks[{i}][{j}] = {x!r}: loss masks hold bools or 0/1 values (a weighted loss "
                                 f"multiplies the log-probs instead)")
        t = torch.tensor([bool(x) for x in vals], dtype=torch.bool)
    if t.numel() != n:
        raise ValueError(f"loss_masks[{i}] has {t.numel()} entries but trajectory {i} has {n} tokens: give one entry "
                         f"per token (a bool, or 0/1 as an integer or float)")
    return t


def _common_run(flat: torch.Tensor, starts: torch.Tensor, run: int) -> int:
    """The length (at most ``run`` tokens) of the prefix that every row ``flat[starts[r] : starts[r] + run]`` shares,
    compared in doubling chunks (64, 128, ... tokens), so a short shared run costs little however long the rows."""
    done, chunk = 0, 64
    while done < run:
        n = min(chunk, run - done)
        cols = flat[starts[:, None] + (done + torch.arange(n))]
        diff = (cols != cols[0]).any(0).nonzero()
        if diff.numel():
            return done + int(diff[0])
        done, chunk = done + n, chunk * 2
    return run


def _trie_nodes(seqs: list, min_shared: int):
    """The compressed token trie of ``seqs`` (1-D int64 CPU tensors, each >= 1 token) in depth-first preorder:
    ``nodes`` = list of ``(representative trajectory, start, end, parent)`` and per trajectory the node it ends
    at. Each node's members are handled with a few tensor ops on one flat token tensor (no Python step per member
    or per token), so deep trees (a comb of N trajectories is N levels deep) cost O(nodes) Python steps."""
    lens = torch.tensor([int(s.numel()) for s in seqs], dtype=torch.long)
    off = torch.cumsum(lens, 0) - lens
    flat = torch.cat(seqs)
    nodes, end_node = [], [-1] * len(seqs)

    def split(members: torch.Tensor, at: int) -> list:
        """Members ending at ``at`` (each alone), then groups by the token at ``at`` in order of first
        appearance (each an int64 tensor of member indices, in input order)."""
        ln = lens[members]
        ended = members[ln == at]
        out = list(ended.split(1)) if ended.numel() else []  # an empty tensor splits into one empty piece
        live = members[ln > at]
        if live.numel():
            uniq, inv = torch.unique(flat[off[live] + at], return_inverse=True)
            first = torch.full((uniq.numel(),), live.numel(), dtype=torch.long).scatter_reduce(
                0, inv, torch.arange(live.numel()), "amin")
            rank = torch.empty_like(first)
            rank[first.argsort()] = torch.arange(first.numel())
            key = rank[inv]
            order = torch.sort(key, stable=True).indices
            out += list(live[order].split(torch.bincount(key, minlength=uniq.numel()).tolist()))
        return out

    stack = [(g, 0, -1) for g in reversed(split(torch.arange(len(seqs)), 0))]
    while stack:
        members, start, parent = stack.pop()
        if members.numel() == 1:
            i = int(members[0])
            nodes.append((i, start, int(lens[i]), parent))
            end_node[i] = len(nodes) - 1
            continue
        lcp = _common_run(flat, off[members] + start, int(lens[members].min()) - start)
        if lcp < min_shared:  # too short to share: every branch gets its own copy of the run
            stack.extend((g, start, parent) for g in reversed(split(members, start + lcp)))
            continue
        nodes.append((int(members[0]), start, start + lcp, parent))
        me = len(nodes) - 1
        rest = []
        for g in split(members, start + lcp):
            if g.numel() == 1 and int(lens[g[0]]) == start + lcp:
                end_node[int(g[0])] = me
            else:
                rest.append(g)
        stack.extend((g, start + lcp, me) for g in reversed(rest))
    return nodes, end_node


@torch.inference_mode(False)  # packed during a rollout (inference mode), trained on later: normal tensors
def pack_trajectories(seqs: Sequence[TokenIds], loss_masks: Optional[Sequence] = None, min_shared: int = 1,
                      vocab_size: Optional[int] = None,
                      device: Union[str, torch.device, None] = None) -> TreeBatch:
    """Merge N trajectories into a prefix tree (compressed token trie) and pack it depth-first.

    Every shared prefix is stored once, at any depth: trajectories that agree on their first tokens share a node,
    branch where they first differ, share again below that if several agree further, and so on. A trajectory that
    is a prefix of another ends at a node boundary; identical trajectories end at the same node.

    Args:
        seqs: N >= 1 trajectories, each a whole conversation: a list of ints (or NumPy integers), a 1-D integer
            tensor or a 1-D integer NumPy array, >= 1 token. A list, a tuple, a generator (materialised) or the
            rows of a 2-D tensor / NumPy array.
        loss_masks: optional, per trajectory a bool ``(len(seq_i),)`` over its tokens (True: trained, e.g.
            assistant turns; False: prompt and tool output), a tensor or a list of bools or 0/1 integers or floats;
            or the rows of a 2-D tensor / NumPy array.
        min_shared: a run shared by several trajectories shorter than this many tokens is duplicated into each
            branch instead of becoming its own node (fewer, longer nodes; 1 = always share). Default 1. Counted on
            CPU with the kernels' tile structure (every node costs whole ``BLOCK_M``-row query tiles, each reading
            all its ancestors' key blocks; ``kernels/dualkv.py`` ``_default_fwd_cfg``, bf16 D=128: 128/128) plus
            the per-token ops (a visible pair weighs ``1/(6·d)`` tokens, d=4096; ``kvtransform.balance.PAIR_WEIGHT``):
            sharing an s-token run by 2 branches under a 2K-token context costs +13 token-equivalents at s=1 and
            saves from s=16 on; under 8K, +45 at s=1, break-even near s=32-64; with 4 branches it saves from s=4
            (2K) / s=16 (8K). Within ~0.5 % of the step either way, so the default keeps every share (and the
            depth the transform's verification tree needs); pass ~32 for contexts of 8K tokens and more
            (``docs/PREFIX_TREES.md``, "Packing"). GPU timing: not measured.
        vocab_size: when given, a positive integer; every id must be ``< vocab_size``.
        device: device of the batch tensors (default: the first tensor's, else CPU); must be usable here.

    Returns:
        :class:`TreeBatch` (``T`` = tokens of the trie's nodes).

    Raises:
        ValueError: no trajectories, an empty trajectory, a non-integer / negative / out-of-int64 /
            out-of-vocabulary id, meta tensors, a loss mask of the wrong length, unordered (a set) or with non-bool
            values, loss_masks not one per trajectory, min_shared < 1, a vocab_size that is not a positive integer,
            an unusable device.
    """
    from .packing import _as_ids  # here: kvtransform.packing imports this module

    if isinstance(seqs, torch.Tensor) and seqs.dim() == 2:  # rows of a 2-D tensor, as of a 2-D NumPy array
        seqs = list(seqs.unbind(0))
    elif hasattr(seqs, "__iter__") and not hasattr(seqs, "__len__") and not isinstance(seqs, torch.Tensor):
        seqs = list(seqs)  # a generator / iterator of trajectories
    if isinstance(seqs, (Mapping, Set)):
        raise ValueError(f"pack_trajectories takes trajectories in order: pass a list, not a {type(seqs).__name__}")
    if isinstance(seqs, (torch.Tensor, str, bytes)) or not hasattr(seqs, "__len__") or len(seqs) == 0:
        raise ValueError("pack_trajectories needs a non-empty list of trajectories (1-D token-id sequences); got "
                         + (f"a tensor of shape {tuple(seqs.shape)} (one trajectory? pass [ids])"
                            if isinstance(seqs, torch.Tensor) else type(seqs).__name__))
    min_shared = as_int(min_shared, "min_shared", " >= 1 (tokens)")  # NumPy / torch integers too
    if min_shared < 1:
        raise ValueError(f"min_shared must be an integer >= 1 (tokens); got {min_shared!r}")
    if vocab_size is not None:
        vocab_size = _as_vocab(vocab_size)
    device = _as_device(device)
    for i, s in enumerate(seqs):
        if isinstance(s, torch.Tensor) and s.device.type == "meta":
            raise ValueError(f"trajectory {i} is on the meta device (no data): pass real token ids")
    if device is None:
        device = next((s.device for s in seqs if isinstance(s, torch.Tensor)), None)
    seqs = [_as_ids(s, f"trajectory {i}", vocab_size) for i, s in enumerate(seqs)]
    masks = None
    if loss_masks is not None:
        if isinstance(loss_masks, torch.Tensor) and loss_masks.dim() == 2:  # rows, as the trajectories' own
            loss_masks = list(loss_masks.unbind(0))
        elif isinstance(loss_masks, Iterator):  # a generator, as seqs may be
            loss_masks = list(loss_masks)
        if isinstance(loss_masks, (torch.Tensor, Mapping, Set)) or not hasattr(loss_masks, "__len__") or \
                len(loss_masks) != len(seqs):
            got = len(loss_masks) if hasattr(loss_masks, "__len__") and not isinstance(loss_masks, torch.Tensor) \
                else type(loss_masks).__name__
            raise ValueError(f"loss_masks must be a list with one mask per trajectory ({len(seqs)}); got {got}")
        masks = [_as_mask(m, int(s.numel()), i) for i, (s, m) in enumerate(zip(seqs, loss_masks))]
    nodes, end_node = _trie_nodes(seqs, min_shared)
    layout = PrefixTreeLayout.from_parents([e - s for _, s, e, _ in nodes], [p for *_, p in nodes],
                                           device=device)
    layout.trajectory_nodes = sorted(set(end_node))
    ids = torch.cat([seqs[i][s:e] for i, s, e, _ in nodes])
    dev = torch.device(device) if device is not None else torch.device("cpu")
    batch = TreeBatch(ids[None].to(dev), layout.position_ids()[None].to(dev), layout, seqs, end_node, masks)
    return batch
