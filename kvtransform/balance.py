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

Prefix trees (multi-turn / agentic rollouts; Tree Training, arXiv 2511.00413; ``docs/PREFIX_TREES.md``): with
``trees=True`` each item is one tree, given as its list of trajectories (what :func:`kvt.pack_trajectories` takes).
The keyword is what tells a tree from a DualKV group: a two-trajectory tree ``[[1, 2, 3], [1, 2, 4]]`` is also a
valid group ``(prompt of 3 tokens, responses of 1, 2 and 4 tokens)``. A tree is never split; it costs its packed
(deduplicated) tokens plus ``pair_weight`` times its visible attention pairs (:func:`tree_cost`)::

    plan = kvt.balance_groups(trees, world_size=8, max_tokens=16384, trees=True)   # trees: [[traj, ...], ...]
    for mb in plan[rank]:
        batch = kvt.pack_trajectories([s for tree in mb for s in tree])
"""
from __future__ import annotations

import heapq
import math
import numbers
import operator
from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch

from .ops._common import as_int

__all__ = ["GroupBalance", "balance_groups", "group_tokens", "tree_cost", "PAIR_WEIGHT"]

PAIR_WEIGHT = 1.0 / (6 * 4096)
"""Default token-equivalents per visible (query, key) pair of a tree: per layer, attention costs ``4·d`` FLOPs per
pair (``QKᵀ`` and ``PV``) and the projections + MLP of a Llama-style layer ``~24·d²`` per token (``~12·d²``
parameters, 2 FLOPs each), the same factor 3 for forward + backward on both; so a pair weighs ``1 / (6·d)`` tokens,
here for ``d = 4096``. Pass ``pair_weight=1 / (6 * hidden_size)`` for another model."""


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
    counts (ints) or 1-D token sequences (lists, tensors, arrays); the responses may be a 2-D tensor or array (rows).

    Raises:
        ValueError: not a pair, no responses, an empty prompt or response (the message names group ``index``).
    """
    if not isinstance(group, (tuple, list)) or len(group) != 2:
        hint = ", or pass trees=True for prefix trees (a list of trajectories per item)" if isinstance(
            group, (tuple, list)) or type(group).__name__ == "TreeBatch" else ""
        raise ValueError(f"group {index} must be a pair (prompt, [responses]); got {type(group).__name__}"
                         f"{' of length ' + str(len(group)) if isinstance(group, (tuple, list)) else ''}{hint}")
    prompt, responses = group
    if len(getattr(responses, "shape", ())) == 2:  # a 2-D tensor / array: one response per row, as the packers take
        responses = list(responses)
    if isinstance(responses, (str, bytes)) or not hasattr(responses, "__len__") or hasattr(responses, "shape"):
        raise ValueError(f"group {index}: responses must be a list of response lengths or token sequences, or a "
                         f"2-D tensor / array of responses (rows)")
    if len(responses) == 0:
        raise ValueError(f"group {index} has no responses")
    return _length(prompt, f"group {index}: prompt") + sum(
        _length(r, f"group {index}: response {i}") for i, r in enumerate(responses))


def _check_pair_weight(w) -> float:
    """``w`` as a finite float >= 0; ValueError (one line) otherwise (bools, NaN, inf, negatives, non-numbers)."""
    if isinstance(w, bool) or not isinstance(w, numbers.Real) or not 0 <= float(w) < math.inf:  # (NumPy scalars
        # are numbers.Real; NumPy's bool_ is not)
        raise ValueError(f"pair_weight must be a finite number >= 0 (token-equivalents per attention pair); got {w!r}")
    return float(w)


def tree_cost(tree: Any, index: int = 0, pair_weight: float = PAIR_WEIGHT, min_shared: int = 1) -> tuple:
    """``(packed tokens, visible pairs, cost)`` of one prefix tree given as its trajectories (each a 1-D id tensor,
    list or NumPy array, or the rows of a 2-D tensor or array, as :func:`kvtransform.tree_packing.pack_trajectories`
    takes them, packed with the same ``min_shared``): tokens = the trie's tokens (each shared prefix once), pairs =
    :meth:`~kvtransform.tree_layout.PrefixTreeLayout.visible_pairs`, cost = ``tokens + pair_weight · pairs``
    (float; :data:`PAIR_WEIGHT`).

    Raises:
        ValueError: a TreeBatch, a non-list, no trajectories or a malformed one (the message names tree ``index``),
            a pair_weight that is not a finite number >= 0.
    """
    from .tree_packing import pack_trajectories

    pair_weight = _check_pair_weight(pair_weight)
    if type(tree).__name__ == "TreeBatch":
        raise ValueError(f"tree {index} is a TreeBatch: pass its trajectories (batch.sequences) so that each rank can "
                         f"pack its own trees with kvt.pack_trajectories")
    rows = isinstance(tree, (torch.Tensor, np.ndarray)) and tree.ndim == 2  # its rows, as pack_trajectories
    if not rows and (isinstance(tree, (str, bytes)) or hasattr(tree, "shape") or not isinstance(tree, _SequenceABC)) \
            or len(tree) == 0:
        shape = f" of shape {tuple(tree.shape)}" if hasattr(tree, "shape") else ""
        raise ValueError(f"tree {index} must be a non-empty list of trajectories (1-D token-id sequences) or a 2-D "
                         f"tensor of them as rows; got {type(tree).__name__}{shape}")
    try:
        b = pack_trajectories(list(tree), min_shared=min_shared)
    except ValueError as e:
        pair = len(tree) == 2 and isinstance(tree[1], (list, tuple)) and any(
            isinstance(r, _SequenceABC) or hasattr(r, "shape") for r in tree[1])
        raise ValueError(f"tree {index}: {e}" + ("; a DualKV group (prompt, [responses])? pass trees=False" if pair
                                                 else "")) from None
    pairs = b.layout.visible_pairs()
    return b.num_tokens, pairs, b.num_tokens + pair_weight * pairs


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
        group_tokens: packed tokens of each input item.
        costs: with ``trees=True``, per rank the balanced cost (tokens + ``pair_weight`` · visible pairs, float);
            else ``None`` (the cost is the token count).
        group_costs: with ``trees=True``, each tree's cost (:func:`tree_cost`); else ``None``.
    """

    ranks: list
    indices: list
    tokens: list
    micro_batch_tokens: Optional[list] = None
    max_tokens: Optional[int] = None
    group_tokens: list = field(default_factory=list)
    costs: Optional[list] = None
    group_costs: Optional[list] = None

    def __len__(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:  # (the generated repr printed every group's token ids)
        return f"GroupBalance({self.summary()}; .ranks / .indices per rank)"

    def __getitem__(self, rank):
        return self.ranks[rank]

    def __iter__(self) -> Iterator[list]:
        return iter(self.ranks)

    @property
    def imbalance(self) -> float:
        """``max / mean`` load per rank (1.0 is perfect): packed tokens, or :attr:`costs` for trees."""
        load = self.costs if self.costs is not None else self.tokens
        mean = sum(load) / len(load)
        return max(load) / mean if mean > 0 else 1.0

    @property
    def lower_bound(self) -> float:
        """A lower bound on the best possible maximum rank load: ``max(mean, largest item)`` (tokens; costs for
        trees)."""
        load, items = (self.costs, self.group_costs) if self.costs is not None else (self.tokens, self.group_tokens)
        return max(sum(load) / len(load), max(items, default=0))

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0]) if self.max_tokens is not None and self.ranks else 1

    def summary(self) -> str:
        """One line: tokens per rank, ``max/mean``, and the micro-batch count."""
        mb = f", {self.num_micro_batches} micro-batches of <= {self.max_tokens} tokens per rank" \
            if self.max_tokens is not None else ""
        what = "trees" if self.costs is not None else "groups"
        cost = f", cost per rank {[round(c) for c in self.costs]}" if self.costs is not None else ""
        load = self.costs if self.costs is not None else self.tokens
        return (f"{len(self.group_tokens)} {what} on {len(self.tokens)} ranks: packed tokens per rank "
                f"{self.tokens}{cost} (max/mean {self.imbalance:.3f}; max/lower bound "
                f"{max(load) / max(self.lower_bound, 1):.3f}){mb}")


def _lpt(sizes: Sequence[int], order: Sequence[int], bins: int, cap: Optional[int] = None,
         weights: Optional[Sequence[float]] = None):
    """Longest-processing-time-first: each item (in ``order``, largest first) to the least-loaded bin (load: the
    sum of ``weights``, default ``sizes``) whose ``sizes`` still fit under ``cap``; returns (bins as lists of item
    ids, loads) or ``None`` when an item fits nowhere."""
    w = sizes if weights is None else weights
    heap = [(0, b) for b in range(bins)]
    out: list = [[] for _ in range(bins)]
    loads = [0] * bins
    used = [0] * bins
    for i in order:
        if cap is None:
            load, b = heapq.heappop(heap)
            out[b].append(i)
            loads[b] = load + w[i]
            heapq.heappush(heap, (loads[b], b))
        else:
            fits = [b for b in range(bins) if used[b] + sizes[i] <= cap]
            if not fits:
                return None
            b = min(fits, key=lambda k: (loads[k], k))
            out[b].append(i)
            loads[b] += w[i]
            used[b] += sizes[i]
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


def _micro_batches(sizes: Sequence[int], weight: Sequence[float], rank_items: list, max_tokens: int) -> list:
    """Each rank's items in micro-batches of at most ``max_tokens`` (by ``sizes``), every rank the same number
    (first-fit decreasing finds the count, longest-first by ``weight`` fills them), heaviest micro-batch first."""
    per_rank_order = [sorted(r, key=lambda i: (-weight[i], i)) for r in rank_items]
    ffd = [_ffd(sizes, sorted(r, key=lambda i: (-sizes[i], i)), max_tokens) for r in rank_items]
    m = max(1, max(len(b) for b in ffd))
    mbs = []
    for o, packed in zip(per_rank_order, ffd):
        lpt = _lpt(sizes, o, m, cap=max_tokens, weights=weight)
        bins = lpt[0] if lpt is not None else packed + [[] for _ in range(m - len(packed))]
        bins = [sorted(b) for b in bins]
        bins.sort(key=lambda b: -sum(weight[i] for i in b))
        mbs.append(bins)
    return mbs


def _micro_batches_counted(trees: list, sizes: Sequence[int], weight: Sequence[float], rank_items: list,
                           max_tokens: int, min_shared: int, rounds: int = 4) -> tuple:
    """:func:`_micro_batches` for trees packed with ``min_shared > 1``, where trees packed together can take more
    tokens than apart (a run two trees share cuts a run of one of them, and a piece shorter than ``min_shared`` is
    then copied into every branch): each micro-batch is packed to count it, and the trees of one over
    ``max_tokens`` are planned again with their share of the excess; after ``rounds`` such plans they are planned
    at ``max_tokens`` each (a micro-batch of their own, which fits: no tree alone is over). Returns
    ``(micro-batches, their packed tokens)``."""
    from .tree_packing import pack_trajectories

    plan = list(sizes)
    attempt = 0
    while True:  # ends: from round ``rounds`` on, every over micro-batch caps one more tree (a capped tree is alone)
        attempt += 1
        mbs = _micro_batches(plan, weight, rank_items, max_tokens)
        counted = [[pack_trajectories([s for i in b for s in trees[i]], min_shared=min_shared).num_tokens if b else 0
                    for b in r] for r in mbs]
        over = [(b, n) for r, c in zip(mbs, counted) for b, n in zip(r, c) if n > max_tokens]
        if not over:
            return mbs, counted
        for b, n in over:
            planned = sum(plan[i] for i in b)
            for i in b:
                plan[i] = max_tokens if attempt >= rounds else plan[i] + -(-(n - planned) * plan[i] // planned)


def balance_groups(groups: Sequence[Any], world_size: int, max_tokens: Optional[int] = None, *, trees: bool = False,
                   pair_weight: Optional[float] = None, min_shared: Optional[int] = None) -> GroupBalance:
    """Assign prompt groups (or prefix trees) to ``world_size`` ranks (and micro-batches) with balanced loads.

    Args:
        groups: ``[(prompt, [response, ...]), ...]``; prompt and responses as token counts (ints) or 1-D token
            sequences (lists of ids, tensors, arrays). A group costs ``P + Σ_i R_i`` packed tokens and is never split.
            With ``trees=True``: ``[tree, ...]``, each tree a list of trajectories (1-D id tensors, lists or NumPy
            arrays) or a 2-D tensor or array of them as rows, as :func:`kvtransform.tree_packing.pack_trajectories`
            takes them; a tree is never split and costs its packed tokens plus ``pair_weight`` · its visible
            attention pairs (:func:`tree_cost`).
        world_size: number of data-parallel ranks (>= 1).
        max_tokens: when given, each rank's items are packed into micro-batches of at most this many packed
            tokens; every rank gets the same number of micro-batches (the most any rank needs), so that all ranks
            run the same number of forward/backward passes (FSDP's collectives must match); micro-batch ``k`` of
            each rank is the ``k``-th largest (by cost for trees).
        trees: the items are prefix trees, not ``(prompt, [responses])`` groups (keyword only: the two shapes can
            coincide, see the module docstring).
        pair_weight: trees only (refused with ``trees=False``), a finite number >= 0 of token-equivalents per
            visible (query, key) pair (default :data:`PAIR_WEIGHT`, derived for hidden size 4096; ``0`` balances
            packed tokens only).
        min_shared: trees only (refused with ``trees=False``), the ``min_shared`` the ranks will pack with
            (:func:`kvtransform.tree_packing.pack_trajectories`; default 1): a prefix shorter than it is stored
            once per trajectory, so the plan must count it so for ``max_tokens`` to hold.

    Returns:
        :class:`GroupBalance`, a sequence of the ``world_size`` per-rank lists (``plan[r]``, ``for rank_groups in
        plan``), with ``ranks``, ``indices``, ``tokens``, ``imbalance``, ``summary()`` (and ``costs`` for trees).
        Ranks: greedy longest-first (LPT), max load <= mean + largest item. Ranks may get no item when there are
        fewer items than ranks (they must still run a filler step). Pack a rank's (micro-batch's) trees with
        ``kvt.pack_trajectories([s for tree in mb for s in tree])``; trees that share a prefix (one system prompt)
        merge there, so with ``min_shared=1`` its packed tokens can only be fewer than the plan's; with a larger
        ``min_shared`` merging can also add tokens, so each micro-batch is packed once to count it (and planned
        again while one is over ``max_tokens``): ``micro_batch_tokens`` are then the packed counts.

    Raises:
        ValueError: ``world_size`` < 1 or not an int, no groups, a malformed group or tree (a tree without
            ``trees=True`` and a group with it name the keyword), ``max_tokens`` < 1, ``trees`` not a bool,
            ``pair_weight`` negative / NaN / inf or given without ``trees=True``, ``min_shared`` given without
            ``trees=True`` or not an integer >= 1, an item larger than ``max_tokens`` (the message names it, its
            size and the fix).
    """
    world_size = as_int(world_size, "world_size", " >= 1 (the number of data-parallel ranks)")  # NumPy/torch too
    if world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (the number of data-parallel ranks); got {world_size!r}")
    if max_tokens is not None:
        max_tokens = as_int(max_tokens, "max_tokens", " >= 1 (packed tokens per micro-batch) or None")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (packed tokens per micro-batch) or None; "
                             f"got {max_tokens!r}")
    if not isinstance(trees, bool):
        raise ValueError(f"trees must be True (items are prefix trees) or False ((prompt, [responses]) groups); got "
                         f"{trees!r}")
    if pair_weight is None:
        pair_weight = PAIR_WEIGHT
    elif not trees:
        raise ValueError("pair_weight applies to prefix trees only: pass trees=True, or drop pair_weight (groups are "
                         "balanced by packed tokens)")
    pair_weight = _check_pair_weight(pair_weight)
    if min_shared is not None and not trees:
        raise ValueError("min_shared applies to prefix trees only: pass trees=True, or drop min_shared (a group's "
                         "prompt is always shared)")
    what = "tree" if trees else "group"
    items = "trees (each a list of trajectories)" if trees else "(prompt, [responses]) groups"
    if isinstance(groups, (dict, set, frozenset)):
        raise ValueError(f"balance_groups takes a list of {items}, not a {type(groups).__name__} (the plan gives "
                         f"each {what} by its index in the list: pass a list)")
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise ValueError(f"balance_groups needs a non-empty list of {items}")
    groups = list(groups)  # (a generator too)
    if not groups:
        raise ValueError(f"balance_groups needs a non-empty list of {items}")
    costs = None
    if trees:
        tc = [tree_cost(g, i, pair_weight, 1 if min_shared is None else min_shared) for i, g in enumerate(groups)]
        sizes, costs = [t[0] for t in tc], [t[2] for t in tc]
    else:
        sizes = [group_tokens(g, i) for i, g in enumerate(groups)]
    weight = costs if trees else sizes
    if max_tokens is not None:
        too_big = [(i, s) for i, s in enumerate(sizes) if s > max_tokens]
        if too_big:
            i, s = max(too_big, key=lambda t: t[1])
            more = f" (and {len(too_big) - 1} more {what}s)" if len(too_big) > 1 else ""
            why = ("its trajectories share the tree's prefixes' K/V); raise max_tokens to at least "
                   f"{s} or give that tree fewer/shorter trajectories") if trees else (
                f"its responses share the prompt's K/V); raise max_tokens to at least {s} or give that prompt "
                f"fewer/shorter responses")
            raise ValueError(f"{what} {i} packs to {s} tokens ({'its trie' if trees else 'prompt + all responses'}) > "
                             f"max_tokens={max_tokens}{more}: a {what} cannot be split across micro-batches ({why}")
    order = sorted(range(len(sizes)), key=lambda i: (-weight[i], i))
    rank_items, _ = _lpt(sizes, order, world_size, weights=weight)
    rank_tokens = [sum(sizes[i] for i in r) for r in rank_items]
    rank_costs = [sum(costs[i] for i in r) for r in rank_items] if trees else None
    if max_tokens is None:
        idx = [sorted(r) for r in rank_items]
        return GroupBalance([[groups[i] for i in r] for r in idx], idx, rank_tokens, None, None, sizes, rank_costs,
                            costs)

    if not trees or min_shared in (None, 1):
        mbs = _micro_batches(sizes, weight, rank_items, max_tokens)
        mb_tokens = [[sum(sizes[i] for i in b) for b in r] for r in mbs]
    else:
        mbs, mb_tokens = _micro_batches_counted(groups, sizes, weight, rank_items, max_tokens, min_shared)
    return GroupBalance([[[groups[i] for i in b] for b in r] for r in mbs], mbs, rank_tokens, mb_tokens,
                        max_tokens, sizes, rank_costs, costs)
