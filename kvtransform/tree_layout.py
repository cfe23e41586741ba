"""The packed prefix-tree token layout: trajectories that share prefixes at any depth, each shared run stored once.

The packed token axis (length ``T``) is a sequence of ``N`` *nodes* (segments). Node ``n`` is the contiguous token
range ``[cu_seqlens[n], cu_seqlens[n+1])`` and has a parent node ``parent[n]`` that comes before it in the packing
(``-1`` for a root). Several trees (several roots) can share one batch::

    [system+task (root 0)][turn 1a (parent 0)][turn 2a (parent 1)][turn 2b (parent 1)][turn 1b (parent 0)] [root 5]..

Attention: a token attends to every token of every ancestor node and causally within its own node, so a root→leaf
path of nodes computes exactly what that path as one causal sequence computes (Tree Training, arXiv 2511.00413;
the one-level case ``[P][R_1..R_N]`` is DualKV, arXiv 2605.15422, §2–3, :class:`kvtransform.layout.DualKVLayout`).

Tensors (flash-attention style int32, on the layout's device):

* ``cu_seqlens`` ``(N+1,)``: node boundaries; ``cu_seqlens[0] == 0``, strictly increasing, ``cu_seqlens[-1] == T``;
* ``parent`` ``(N,)``: parent node index, ``-1`` for a root, ``parent[n] < n``;
* ``ancestor_ptr`` ``(N+1,)``, ``ancestors`` ``(A,)``: CSR, node ``n``'s ancestors root→parent are
  ``ancestors[ancestor_ptr[n]:ancestor_ptr[n+1]]`` (what the forward and dQ visit);
* ``descendant_ptr`` ``(N+1,)``, ``descendants`` ``(A,)``: CSR, node ``n``'s descendants in packing order (what
  dK/dV visit);
* ``key_range_ptr`` ``(N+1,)``, ``key_ranges`` ``(RK, 2)``: the ancestors as token ranges ``[lo, hi)``, adjacent
  ones merged (a first child packed right after its parent continues its range): what the kernels read;
* ``query_range_ptr`` ``(N+1,)``, ``query_ranges`` ``(RQ, 2)``: the descendants as merged token ranges (one range
  per node when the packing is depth-first, as :func:`kvtransform.tree_packing.pack_trajectories` packs).

Python lists ``lengths`` and ``parents`` mirror the tensors (the host-side code reads them, never the tensors).
"""
from __future__ import annotations

import operator
from collections.abc import Mapping, Set
from typing import Optional, Sequence, Union

import torch

from .layout import _as_device, _has_data, _int32_on
from .utils import is_integer_dtype

__all__ = ["PrefixTreeLayout"]

_I32_MAX = 2 ** 31 - 1


def _as_index(x, what: str) -> int:
    """``x`` as a python int (python / NumPy / 0-d torch integers); ValueError for floats, bools and the rest."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and (x.dim() != 0 or x.dtype == torch.bool
                                                                 or x.dtype.is_floating_point)):
        raise ValueError(f"{what} must be an integer; got {x!r}")
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool_", "bool"):
        raise ValueError(f"{what} must be an integer; got {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise ValueError(f"{what} must be an integer; got {x!r} ({type(x).__name__})") from None


def _int_list(name: str, x) -> list:
    """A 1-D sequence or integer tensor as python ints; ValueError for floats, bools, 2-D input, meta tensors or
    values outside int32."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D; got a tensor of shape {tuple(x.shape)}")
        if not is_integer_dtype(x.dtype):
            raise ValueError(f"{name} must hold integers (int32); got dtype {x.dtype}")
        if not _has_data(x):
            raise ValueError(f"{name} has no data to read ({x.device} device, a fake tensor, or inside "
                             f"torch.compile): build the layout from real tensors before compiling")
        vals = [int(v) for v in x.tolist()]
    else:
        if isinstance(x, (str, bytes, Mapping, Set)) or not hasattr(x, "__iter__"):
            raise ValueError(f"{name} must be an ordered sequence of integers (a list, tuple or 1-D integer tensor); "
                             f"got {type(x).__name__}")
        vals = [_as_index(v, f"{name}[{i}]") for i, v in enumerate(x)]
    for i, v in enumerate(vals):
        if not -2 ** 31 <= v <= _I32_MAX:
            raise ValueError(f"{name}[{i}] = {v} is outside int32: the prefix-tree kernels index tokens and nodes with "
                             f"int32 (at most 2**31 - 1 tokens per batch)")
    return vals


def _check_parents(parents: list) -> None:
    """ValueError (one line) unless every ``parents[i]`` is ``-1`` or a node before ``i``."""
    n = len(parents)
    for i, p in enumerate(parents):
        if p == -1 or 0 <= p < i:
            continue
        if p == i:
            raise ValueError(f"node {i} is its own parent (parent[{i}] = {i})")
        if p < -1 or p >= n:
            raise ValueError(f"parent[{i}] = {p} is not a node index (expected -1 for a root or 0..{i - 1})")
        # p > i: a cycle, or a parent packed after its child
        seen, j = [i], p
        while 0 <= j < n and j not in seen and parents[j] != -1:
            seen.append(j)
            j = parents[j]
        if j in seen:
            cyc = seen[seen.index(j):] + [j]
            raise ValueError(f"the parents form a cycle: {' -> '.join(map(str, cyc))}")
        raise ValueError(f"node {i}'s parent {p} comes after it in the packing: a parent must precede its children")


def _merged_ranges(ptr: torch.Tensor, flat: torch.Tensor, cu: torch.Tensor):
    """CSR rows of node indices (int64 ``ptr`` ``(R+1,)``, ``flat``) -> CSR rows of token ranges ``[lo, hi)``
    (``rptr`` ``(R+1,)``, ``ranges`` ``(RR, 2)``), a node adjacent to the previous one of its row merged into its
    range. Tensor ops only: a deep tree has ~N * depth entries."""
    rows = ptr.numel() - 1
    row = torch.repeat_interleave(torch.arange(rows), ptr.diff())
    lo, hi = cu[flat], cu[flat + 1]
    first = torch.ones(flat.numel(), dtype=torch.bool)
    first[1:] = (row[1:] != row[:-1]) | (hi[:-1] != lo[1:])
    last = torch.ones(flat.numel(), dtype=torch.bool)
    last[:-1] = first[1:]
    rptr = torch.zeros(rows + 1, dtype=torch.long)
    rptr[1:] = torch.bincount(row[first], minlength=rows).cumsum(0)
    return rptr, torch.stack([lo[first], hi[last]], 1)


def _derive(lengths: list, parents: list) -> dict:
    """Every derived list and CSR tensor (int64 CPU) of the layout (see the module docstring)."""
    n = len(lengths)
    cu = [0]
    for ln in lengths:
        cu.append(cu[-1] + ln)
    anc = []
    for i, p in enumerate(parents):
        anc.append([] if p < 0 else anc[p] + [p])
    aptr = torch.zeros(n + 1, dtype=torch.long)
    aptr[1:] = torch.tensor([len(a) for a in anc], dtype=torch.long).cumsum(0)
    aflat = torch.tensor([a for row in anc for a in row], dtype=torch.long)
    # descendants: the (ancestor, node) pairs regrouped by ancestor, nodes in packing order (a stable sort)
    dflat = torch.repeat_interleave(torch.arange(n), aptr.diff())[torch.sort(aflat, stable=True).indices]
    dptr = torch.zeros(n + 1, dtype=torch.long)
    dptr[1:] = torch.bincount(aflat, minlength=n).cumsum(0)
    cu_cpu = torch.tensor(cu, dtype=torch.long)
    kptr, kranges = _merged_ranges(aptr, aflat, cu_cpu)
    qptr, qranges = _merged_ranges(dptr, dflat, cu_cpu)
    start = []
    for i, p in enumerate(parents):
        start.append(0 if p < 0 else start[p] + lengths[p])
    return dict(cu=cu, cu_cpu=cu_cpu, anc=anc, aptr=aptr, aflat=aflat, dptr=dptr, dflat=dflat, kptr=kptr, kranges=kranges,
                qptr=qptr, qranges=qranges, start=start)


class PrefixTreeLayout:
    """Packed layout of one or more prefix trees of nodes in one token axis (see the module docstring).

    Attributes (tensors int32 on :attr:`device`):
        cu_seqlens ``(N+1,)``, parent ``(N,)``, ancestor_ptr ``(N+1,)``, ancestors ``(A,)``, descendant_ptr
        ``(N+1,)``, descendants ``(A,)``, key_range_ptr ``(N+1,)``, key_ranges ``(RK, 2)``, query_range_ptr
        ``(N+1,)``, query_ranges ``(RQ, 2)``.
        lengths, parents: python lists (node lengths in tokens, parent indices).
        trajectory_nodes: python list of the nodes the trajectories end in, when the packer knows them
            (``kvt.pack_trajectories`` sets it: a trajectory can end inside the tree, as a prefix of another);
            ``None``: the leaves.

    Build it with :meth:`from_parents` or :meth:`from_tensors`; both validate and raise ``ValueError`` with one
    line naming the problem: no nodes, a node of length <= 0, a parent that is not ``-1`` or an earlier node (a
    self-parent, a cycle, a parent packed after its child, an index out of range), non-integer or out-of-int32
    values, offsets that do not start at 0 / increase / sum to ``total_tokens``.
    """

    _TENSORS = ("cu_seqlens", "parent", "ancestor_ptr", "ancestors", "descendant_ptr", "descendants",
                "key_range_ptr", "key_ranges", "query_range_ptr", "query_ranges")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_parents(cls, lengths: Sequence[int], parents: Sequence[int], total_tokens: Optional[int] = None,
                     device: Union[str, torch.device, None] = None) -> "PrefixTreeLayout":
        """Layout from node lengths (tokens, each >= 1) and parent indices (``-1`` or an earlier node), in packing
        order. ``total_tokens``, when given, must equal ``sum(lengths)``. Python ints, NumPy / torch integer scalars
        or 1-D integer tensors."""
        lengths = _int_list("lengths", lengths)
        parents = _int_list("parents", parents)
        if len(lengths) == 0:
            raise ValueError("the prefix-tree layout has no nodes: pass at least one node length")
        if len(parents) != len(lengths):
            raise ValueError(f"{len(lengths)} node lengths but {len(parents)} parents: give one parent per node")
        for i, ln in enumerate(lengths):
            if ln <= 0:
                raise ValueError(f"node {i} has length {ln}; every node needs at least one token")
        _check_parents(parents)
        t = sum(lengths)
        if t > _I32_MAX:
            raise ValueError(f"{t} tokens do not fit int32 offsets (at most 2**31 - 1 tokens per batch)")
        if total_tokens is not None and t != _as_index(total_tokens, "total_tokens"):
            raise ValueError(f"the node lengths sum to {t} tokens but there are {int(total_tokens)} tokens (T)")
        return cls._build(lengths, parents, _as_device(device))

    @classmethod
    def from_tensors(cls, cu_seqlens: torch.Tensor, parent: torch.Tensor,
                     total_tokens: Optional[int] = None) -> "PrefixTreeLayout":
        """Layout from int32 ``cu_seqlens`` ``(N+1,)`` and ``parent`` ``(N,)`` (a host read of both); the derived
        tensors are built on their device. Raises ValueError as :meth:`from_parents`, plus for float offsets,
        offsets not starting at 0 or not strictly increasing, tensors on different devices, or meta/fake tensors."""
        for name, x in (("cu_seqlens", cu_seqlens), ("parent", parent)):
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"{name} must be a 1-D int32 tensor; got {type(x).__name__} (or use "
                                 f"PrefixTreeLayout.from_parents)")
        if cu_seqlens.device != parent.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but parent on {parent.device}")
        cu = _int_list("cu_seqlens", cu_seqlens)
        par = _int_list("parent", parent)
        if len(cu) <= 1 and not par:
            raise ValueError("the prefix-tree layout has no nodes (cu_seqlens needs N+1 >= 2 entries)")
        if len(cu) != len(par) + 1:
            raise ValueError(f"cu_seqlens must have len(parent) + 1 = {len(par) + 1} entries; got {len(cu)}")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0; got {cu[0]}")
        for i in range(len(par)):
            if cu[i + 1] <= cu[i]:
                raise ValueError(f"node {i} has length {cu[i + 1] - cu[i]} (cu_seqlens[{i}] = {cu[i]}, "
                                 f"cu_seqlens[{i + 1}] = {cu[i + 1]}): offsets must strictly increase")
        return cls.from_parents([cu[i + 1] - cu[i] for i in range(len(par))], par, total_tokens,
                                device=cu_seqlens.device)

    @classmethod
    @torch.inference_mode(False)  # a layout packed during a rollout is trained on later: its tensors stay normal
    def _build(cls, lengths: list, parents: list, device) -> "PrefixTreeLayout":
        d = _derive(lengths, parents)
        obj = cls.__new__(cls)
        obj.lengths, obj.parents = list(lengths), list(parents)
        obj.trajectory_nodes = None
        obj._starts = d["start"]
        obj._anc = d["anc"]
        obj._cu = d["cu"]
        obj._cu_cpu = d["cu_cpu"]  # int64 CPU offsets for path_index
        obj.cu_seqlens = _int32_on(d["cu"], device)
        obj.parent = _int32_on(parents, device)
        obj.ancestor_ptr = _int32_on(d["aptr"], device)
        obj.ancestors = _int32_on(d["aflat"], device)
        obj.descendant_ptr = _int32_on(d["dptr"], device)
        obj.descendants = _int32_on(d["dflat"], device)
        obj.key_range_ptr = _int32_on(d["kptr"], device)
        obj.key_ranges = _int32_on(d["kranges"], device)
        obj.query_range_ptr = _int32_on(d["qptr"], device)
        obj.query_ranges = _int32_on(d["qranges"], device)
        return obj

    def __init__(self, *args, **kwargs):
        raise TypeError("build a PrefixTreeLayout with PrefixTreeLayout.from_parents(lengths, parents) or "
                        "PrefixTreeLayout.from_tensors(cu_seqlens, parent)")

    # ------------------------------------------------------------------ properties
    @property
    def num_nodes(self) -> int:
        return len(self.lengths)

    @property
    def num_trees(self) -> int:
        return sum(1 for p in self.parents if p < 0)

    @property
    def total_tokens(self) -> int:
        return self._cu[-1]

    @property
    def max_seqlen(self) -> int:
        """Longest single node (tokens): the longest causal (own-node) run of any query."""
        return max(self.lengths)

    @property
    def max_context(self) -> int:
        """Longest root→node path (tokens): the most keys any query sees."""
        return max(s + ln for s, ln in zip(self._starts, self.lengths))

    @property
    def depth(self) -> int:
        """Nodes on the longest root→node path (1: every node is a root)."""
        return 1 + max(len(a) for a in self._anc)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def node_starts(self) -> list:
        """Python list: the position (in its root→node path) of each node's first token."""
        return list(self._starts)

    def leaves(self) -> list:
        """Python list of the nodes without children (one trajectory each, root→leaf), in packing order."""
        has_child = {p for p in self.parents if p >= 0}
        return [n for n in range(self.num_nodes) if n not in has_child]

    def trajectory_lengths(self) -> list:
        """Python list: tokens of each trajectory (root→node path of :attr:`trajectory_nodes`, else of each leaf in
        :meth:`leaves` order)."""
        nodes = self.trajectory_nodes if self.trajectory_nodes is not None else self.leaves()
        return [self._starts[n] + self.lengths[n] for n in nodes]

    def _node(self, node) -> int:
        """``node`` as an index in ``0..N-1``: ValueError for a non-integer, IndexError (one line) outside."""
        i = _as_index(node, "node")
        if not 0 <= i < self.num_nodes:
            raise IndexError(f"node {i} is out of range: valid nodes are 0..{self.num_nodes - 1}")
        return i

    def ancestors_of(self, node: int) -> list:
        """Python list of ``node``'s ancestors, root first (``node`` in ``0..N-1``, else IndexError)."""
        return list(self._anc[self._node(node)])

    @torch.inference_mode(False)  # a copy made during a rollout still trains (as the packers' tensors)
    def to(self, device) -> "PrefixTreeLayout":
        obj = PrefixTreeLayout.__new__(PrefixTreeLayout)
        obj.__dict__.update(self.__dict__)
        obj.__dict__.pop("_dualkv", None)
        for name in self._TENSORS:
            setattr(obj, name, getattr(self, name).to(device))
        return obj

    def as_dualkv(self):
        """This layout as a :class:`~kvtransform.layout.DualKVLayout` when it is one level deep (every tree a root
        whose children are leaves: a prompt and its responses, DualKV arXiv 2605.15422), else None. The DualKV
        kernels plan their work tables on the GPU and are faster on that shape, so the frontends run one-level trees
        through them (BENCHMARKS.md, "Prefix-tree attention"). Cached; on this layout's device."""
        if "_dualkv" not in self.__dict__:
            self.__dict__["_dualkv"] = self._one_level()
        return self.__dict__["_dualkv"]

    @torch.inference_mode(False)  # cached: built under inference_mode its tensors could not be saved for a backward
    def _one_level(self):
        """:meth:`as_dualkv`'s layout, built as normal tensors whatever the caller's inference mode."""
        groups, ok = [], self.depth <= 2
        for i, (n, p) in enumerate(zip(self.lengths, self.parents)):
            if not ok:
                break
            if p < 0:
                groups.append((n, []))
            elif p == i - 1 - len(groups[-1][1]) and self.parents[p] < 0:  # children right after their root
                groups[-1][1].append(n)
            else:
                ok = False
        from .layout import DualKVLayout

        return DualKVLayout.from_lengths(groups, device=self.device) if ok else None

    def kernel_tensors(self) -> tuple:
        """``(cu_seqlens, parent, key_range_ptr, key_ranges, query_range_ptr, query_ranges)``: the op's layout
        inputs (``torch.ops.kvt.prefix_tree_attention``)."""
        return (self.cu_seqlens, self.parent, self.key_range_ptr, self.key_ranges, self.query_range_ptr,
                self.query_ranges)

    def __repr__(self) -> str:
        return (f"PrefixTreeLayout(nodes={self.num_nodes}, trees={self.num_trees}, tokens={self.total_tokens}, "
                f"depth={self.depth}, device={self.device})")

    # ------------------------------------------------------------------ checks
    def validate(self, total_tokens: Optional[int] = None) -> None:
        """Check the tensors (dtype, device, values) against the python lists and ``total_tokens``. ValueError."""
        for name in self._TENSORS:
            t = getattr(self, name)
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32; got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but cu_seqlens on {self.device}")
        if total_tokens is not None and _as_index(total_tokens, "total_tokens") != self.total_tokens:
            raise ValueError(f"the layout's nodes sum to {self.total_tokens} tokens but there are {int(total_tokens)} "
                             f"tokens (T): cu_seqlens must end at T")
        if _has_data(self.cu_seqlens):
            other = PrefixTreeLayout.from_tensors(self.cu_seqlens, self.parent)
            if other.lengths != self.lengths or other.parents != self.parents:
                raise ValueError("cu_seqlens/parent disagree with the layout's python lengths/parents")
            for name in self._TENSORS[2:]:
                if not torch.equal(getattr(self, name).cpu(), getattr(other, name).cpu()):
                    raise ValueError(f"{name} does not match cu_seqlens/parent: build the layout with "
                                     f"PrefixTreeLayout.from_parents or from_tensors")

    # ------------------------------------------------------------------ derived index tensors
    def position_ids(self) -> torch.Tensor:
        """int64 ``(T,)``: each node's positions continue its parent's (a root starts at 0)."""
        return torch.cat([torch.arange(s, s + ln) for s, ln in zip(self._starts, self.lengths)]).to(self.device)

    def path_index(self, node: int) -> torch.Tensor:
        """int64 packed positions of the root→``node`` path's tokens, in sequence order (CPU); ``node`` in
        ``0..N-1``, else IndexError."""
        node = self._node(node)
        path = torch.tensor(self._anc[node] + [node], dtype=torch.long)  # a few ops whatever the depth
        lo, ln = self._cu_cpu[path], self._cu_cpu[path + 1] - self._cu_cpu[path]
        ends = ln.cumsum(0)
        idx = torch.arange(int(ends[-1]))
        return idx + (lo - (ends - ln))[torch.searchsorted(ends, idx, right=True)]

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs the tree mask lets through (for FLOP counts)."""
        return sum(ln * s + ln * (ln + 1) // 2 for s, ln in zip(self._starts, self.lengths))

    def dense_mask(self) -> torch.Tensor:
        """bool ``(T, T)``: ``mask[i, j]`` is True iff query token ``i`` sees key token ``j`` (tests; small T)."""
        t = self.total_tokens
        node = torch.repeat_interleave(torch.arange(self.num_nodes), torch.tensor(self.lengths))
        vis = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for i, a in enumerate(self._anc):
            vis[i, a] = True
        idx = torch.arange(t)
        same = (node[:, None] == node[None, :]) & (idx[None, :] <= idx[:, None])
        return (vis[node][:, node] | same).to(self.device)
