"""Balanced assignment of shared-prefix prompt groups to data-parallel ranks and micro-batches.

In packed shared-prefix training (DualKV, arXiv 2605.15422) a prompt group ``(P, [R_1..R_N])`` costs
``P + ΣR_i`` packed tokens and never splits (its responses attend to the prompt's K/V). Under FSDP every rank waits
for the slowest at each layer's collectives, so the packed token count per rank (and per micro-batch index) should
match. :func:`balance_groups` assigns whole groups greedily, longest first, to the least-loaded rank (LPT: the
maximum load is at most ``mean + largest group`` and at most ``4/3 · OPT``), then, with ``max_tokens``, packs each
rank's groups into the same number of micro-batches of at most ``max_tokens`` tokens (balanced longest-first where
it fits, first-fit decreasing otherwise); micro-batch sizes need not divide any group size::

    plan = kvt.balance_groups(groups, world_size=8, max_tokens=16384)
    for mb in plan[rank]:                          # list of micro-batches, each a list of groups
        batch = kvt.pack_shared_prefix_groups(mb)   # an empty micro-batch: run a filler batch with zero loss weight
    print(plan.summary())                           # imbalance max/mean per rank
"""
from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

__all__ = ["GroupBalance", "balance_groups", "group_tokens"]


def _length(x: Any, what: str) -> int:
    if isinstance(x, (bool, str, bytes)):
        raise ValueError(f"{what}: {x!r} is not a token count or a token sequence")
    shape = getattr(x, "shape", None)
    try:
        if shape is not None and len(shape) == 1:
            n = int(shape[0])
        elif shape is not None and len(shape) == 0:
            n = operator.index(x.item() if hasattr(x, "item") else x)
        elif shape is not None:
            raise TypeError
        elif hasattr(x, "__len__"):
            n = len(x)
        else:
            n = operator.index(x)
    except TypeError:
        raise ValueError(f"{what}: expected a token count (int) or a 1-D token sequence; got "
                         f"{type(x).__name__}{'' if shape is None else f' of shape {tuple(shape)}'}") from None
    if n < 1:
        raise ValueError(f"{what} has {n} tokens; prompts and responses need at least one token")
    return n


def group_tokens(group: Any, index: int = 0) -> int:
    """Packed tokens ``P + Σ_i R_i`` of one group ``(prompt, [responses])``; prompt and responses are token
    counts (ints) or 1-D token sequences (lists, tensors, arrays).

    Raises:
        ValueError: not a pair, no responses, an empty prompt or response (the message names group ``index``).
    """
    if not isinstance(group, (tuple, list)) or len(group) != 2:
        raise ValueError(f"group {index} must be a pair (prompt, [responses]); got {type(group).__name__}")
    prompt, responses = group
    if isinstance(responses, (str, bytes)) or not hasattr(responses, "__len__") or hasattr(responses, "shape"):
        raise ValueError(f"group {index}: responses must be a list of response lengths or token sequences")
    if len(responses) == 0:
        raise ValueError(f"group {index} has no responses")
    return _length(prompt, f"group {index}: prompt") + sum(
        _length(r, f"group {index}: response {i}") for i, r in enumerate(responses))


@dataclass
class GroupBalance(_SequenceABC):
    """Result of :func:`balance_groups`: a sequence of ranks, each rank's list of groups (``plan[r]`` is
    ``plan.ranks[r]``; ``len(plan)`` is the world size; ``for rank_groups in plan`` iterates the ranks), with the
    fields below.

    Attributes:
        ranks: per rank, the groups themselves (as given): ``ranks[r]`` is a list of groups, or with
            ``max_tokens`` a list of micro-batches, each a list of groups. Every rank has the same number of
            micro-batches (some may be empty when there are few groups).
        indices: the same structure holding the groups' positions in the input list.
        tokens: packed tokens per rank, ``(world_size,)`` list of ints.
        micro_batch_tokens: with ``max_tokens``, per rank the packed tokens of each micro-batch; else ``None``.
        max_tokens: the micro-batch limit (``None``: no micro-batches).
    """

    ranks: list
    indices: list
    tokens: list
    micro_batch_tokens: Optional[list] = None
    max_tokens: Optional[int] = None
    group_tokens: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank):
        return self.ranks[rank]

    def __iter__(self) -> Iterator[list]:
        return iter(self.ranks)

    @property
    def imbalance(self) -> float:
        """``max / mean`` packed tokens per rank (1.0 is perfect)."""
        mean = sum(self.tokens) / len(self.tokens)
        return max(self.tokens) / mean if mean > 0 else 1.0

    @property
    def lower_bound(self) -> float:
        """A lower bound on the best possible maximum rank load: ``max(mean, largest group)``."""
        return max(sum(self.tokens) / len(self.tokens), max(self.group_tokens, default=0))

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0]) if self.max_tokens is not None and self.ranks else 1

    def summary(self) -> str:
        """One line: tokens per rank, ``max/mean``, and the micro-batch count."""
        mb = f", {self.num_micro_batches} micro-batches of <= {self.max_tokens} tokens per rank" \
            if self.max_tokens is not None else ""
        return (f"{len(self.group_tokens)} groups on {len(self.tokens)} ranks: packed tokens per rank "
                f"{self.tokens} (max/mean {self.imbalance:.3f}; max/lower bound "
                f"{max(self.tokens) / max(self.lower_bound, 1):.3f}){mb}")


def _lpt(sizes: Sequence[int], order: Sequence[int], bins: int, cap: Optional[int] = None):
    """Longest-processing-time-first: each item (in ``order``, largest first) to the least-loaded bin (that still
    fits under ``cap``); returns (bins as lists of item ids, loads) or ``None`` when an item fits nowhere."""
    heap = [(0, b) for b in range(bins)]
    out: list = [[] for _ in range(bins)]
    loads = [0] * bins
    for i in order:
        if cap is None:
            load, b = heapq.heappop(heap)
            out[b].append(i)
            loads[b] = load + sizes[i]
            heapq.heappush(heap, (loads[b], b))
        else:
            fits = [b for b in range(bins) if loads[b] + sizes[i] <= cap]
            if not fits:
                return None
            b = min(fits, key=lambda k: (loads[k], k))
            out[b].append(i)
            loads[b] += sizes[i]
    return out, loads


def _ffd(sizes: Sequence[int], order: Sequence[int], cap: int) -> list:
    """First-fit decreasing bin packing under ``cap`` (at most 11/9·OPT + 6/9 bins)."""
    bins: list = []
    loads: list = []
    for i in order:
        for b, load in enumerate(loads):
            if load + sizes[i] <= cap:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])
    return bins


def balance_groups(groups: Sequence[Any], world_size: int, max_tokens: Optional[int] = None) -> GroupBalance:
    """Assign prompt groups to ``world_size`` ranks (and micro-batches) with balanced packed token counts.

    Args:
        groups: ``[(prompt, [response, ...]), ...]``; prompt and responses as token counts (ints) or 1-D token
            sequences (lists of ids, tensors, arrays). A group costs ``P + Σ_i R_i`` packed tokens and is never split.
        world_size: number of data-parallel ranks (>= 1).
        max_tokens: when given, each rank's groups are packed into micro-batches of at most this many packed
            tokens; every rank gets the same number of micro-batches (the most any rank needs), so that all ranks
            run the same number of forward/backward passes (FSDP's collectives must match); micro-batch ``k`` of
            each rank is the ``k``-th largest.

    Returns:
        :class:`GroupBalance`, a sequence of the ``world_size`` per-rank lists (``plan[r]``, ``for rank_groups in
        plan``), with ``ranks``, ``indices``, ``tokens``, ``imbalance``, ``summary()``. Ranks: greedy
        longest-first (LPT), max load <= mean + largest group. Ranks may get no group when there are fewer groups
        than ranks (they must still run a filler step).

    Raises:
        ValueError: ``world_size`` < 1 or not an int, no groups, a malformed group, ``max_tokens`` < 1, or a group
            larger than ``max_tokens`` (the message names the group, its size and the fix).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (the number of data-parallel ranks); got {world_size!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive integer (packed tokens per micro-batch) or None; "
                         f"got {max_tokens!r}")
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__len__") or len(groups) == 0:
        raise ValueError("balance_groups needs a non-empty list of (prompt, [responses]) groups")
    groups = list(groups)
    sizes = [group_tokens(g, i) for i, g in enumerate(groups)]
    if max_tokens is not None:
        too_big = [(i, s) for i, s in enumerate(sizes) if s > max_tokens]
        if too_big:
            i, s = max(too_big, key=lambda t: t[1])
            raise ValueError(f"group {i} packs to {s} tokens (prompt + all responses) > max_tokens={max_tokens}"
                             f"{f' (and {len(too_big) - 1} more groups)' if len(too_big) > 1 else ''}: a group "
                             f"cannot be split across micro-batches (its responses share the prompt's K/V); raise "
                             f"max_tokens to at least {s} or give that prompt fewer/shorter responses")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    rank_items, rank_tokens = _lpt(sizes, order, world_size)
    if max_tokens is None:
        idx = [sorted(r) for r in rank_items]
        return GroupBalance([[groups[i] for i in r] for r in idx], idx, rank_tokens, None, None, sizes)

    per_rank_order = [sorted(r, key=lambda i: (-sizes[i], i)) for r in rank_items]
    ffd = [_ffd(sizes, o, max_tokens) for o in per_rank_order]
    m = max(1, max(len(b) for b in ffd))
    mbs = []
    for o, packed in zip(per_rank_order, ffd):
        lpt = _lpt(sizes, o, m, cap=max_tokens)
        bins = lpt[0] if lpt is not None else packed + [[] for _ in range(m - len(packed))]
        bins = [sorted(b) for b in bins]
        bins.sort(key=lambda b: -sum(sizes[i] for i in b))
        mbs.append(bins)
    mb_tokens = [[sum(sizes[i] for i in b) for b in r] for r in mbs]
    return GroupBalance([[[groups[i] for i in b] for b in r] for r in mbs], mbs, rank_tokens, mb_tokens,
                        max_tokens, sizes)
