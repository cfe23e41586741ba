"""Projection fusion of a decode program: sibling linears -- ``aten.linear`` nodes that read the same input with
parameter weights -- become one GEMM over their concatenated weights, split back along the last dim. Which groups:

* ``"qkv"``: the groups whose linears feed an attention site (``kvt::sparse_decode_attention``'s query, new key or
  new value, walking up through RoPE, per-head norms, views): the q/k/v projections;
* ``"all"``: every sibling group (SwiGLU's gate/up as well);
* ``"none"``: no fusion.

Why: a decode step multiplies a few rows by every weight, so each projection is a skinny GEMM that streams its
weight once, and the narrow GQA k/v projections (``N = H_kv * head_dim``) stream it slowly (H200, Llama-8B shape,
25 requests: k/v projections at ~1.5 TB/s, q at ~2.9, the wide MLP GEMMs at ~3.8, copy bandwidth 4.2; BENCHMARKS.md,
decode throughput). vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` fuse the same way at load time.

The fused weight **takes the originals' place** where it can (``share=True``, the default): the source parameters
(the prefill program and the user's model read the same ``Parameter`` objects) become row views of the fused
buffer (``param.data = fused[a:b]``), so fusion costs no memory and every in-place update of a parameter -- an
optimizer step, ``param.data.copy_(new)``, ``load_state_dict`` -- lands in the fused buffer itself. A group is shared
when each member is a plain tensor that owns its whole storage and no other parameter or buffer of the program
aliases it, or when the members already are consecutive rows of one storage (a fused program saved with
``torch.export`` and reloaded, or a second fusion of the same program): that storage is then the buffer as it is. A
tensor subclass such as a ``DTensor`` or a weight tied by storage keeps the copy rule below. What changes for the
user: a tensor taken from the old storage before the transform (``w = layer.q_proj.weight.detach()``) no longer
aliases the parameter; Hugging Face ``save_pretrained`` and ``torch.save`` handle the views, while
``safetensors.torch.save_model`` refuses them. ``share=False`` keeps the originals.

A group that is not shared is a **copy**: it costs those weights' bytes once more of device memory (Llama-8B shape:
q/k/v 32 x 48 MiB = 1.5 GiB; gate/up 7.3 GiB), and it must follow the originals. :meth:`FusedProjections.refresh`
copies a group again when one of its parameters changed since the last copy (an in-place update under ``no_grad``
bumps ``Tensor._version``; a replaced parameter has another data pointer); ``refresh(force=True)`` copies every
copied group, because an update through ``param.data`` (``p.data.copy_(new)``, common in weight-sync code) bumps
nothing. A shared group whose parameter was replaced (``module.weight = nn.Parameter(new)``, ``model.to(...)``)
falls back to copying. The runtime forces a copy at the start of every ``generate`` / ``decode_from`` (under a
millisecond per GiB on an H200) and checks the stamps before every eager step, so a policy updated between
``generate`` calls decodes with its new weights however it was updated.

The result is numerically the unfused program up to the GEMM's summation order (a wider GEMM may pick another
kernel): not bitwise equal, within the rounding of the dtype.
"""
from __future__ import annotations

import operator
import weakref
from typing import Optional

import torch

from .manager import derived_program

aten = torch.ops.aten
LINEAR = aten.linear.default
CHOICES = ("none", "qkv", "all")


def _attr(root: torch.nn.Module, target: str) -> torch.Tensor:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _attention_projections(graph: torch.fx.Graph) -> set:
    """The linear nodes whose outputs reach an attention site's query, new key or new value without passing through
    another linear."""
    site = torch.ops.kvt.sparse_decode_attention.default
    found: set = set()
    for node in graph.nodes:
        if not (node.op == "call_function" and node.target is site):
            continue
        stack, seen = [node.args[i] for i in (0, 5, 6)], set()
        while stack:
            n = stack.pop()
            if not isinstance(n, torch.fx.Node) or n in seen:
                continue
            seen.add(n)
            if n.op == "call_function" and n.target is LINEAR:
                found.add(n)
            elif n.op == "call_function":
                stack.extend(n.all_input_nodes)
    return found


def _sibling_groups(gm: torch.fx.GraphModule, which: str) -> list:
    """Groups (in graph order, >= 2 members) of linears with the same input and parameter weights (``get_attr``) of
    one dtype and device, all with a bias or none."""
    groups: dict = {}
    for n in gm.graph.nodes:
        if not (n.op == "call_function" and n.target is LINEAR and not n.kwargs):
            continue
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        if not (isinstance(w, torch.fx.Node) and w.op == "get_attr") or \
                (b is not None and not (isinstance(b, torch.fx.Node) and b.op == "get_attr")):
            continue
        wt = _attr(gm, w.target)
        if not isinstance(wt, torch.Tensor) or wt.dim() != 2:
            continue
        groups.setdefault((x, wt.dtype, wt.device, wt.shape[1], b is None), []).append(n)
    out = [g for g in groups.values() if len(g) >= 2]
    if which == "qkv":
        attn = _attention_projections(gm.graph)
        out = [g for g in out if all(n in attn for n in g)]
    return out


class FusedProjections:
    """A decode program with its sibling projections fused (see the module docstring), and what keeps the fused
    weights equal to the originals.

    Args:
        gm: the decode program; which: :data:`CHOICES`; share: the source parameters become views of the fused
            buffers where the module docstring allows (False: every group is a copy).

    Attributes:
        program: the fused ``GraphModule`` (same signature and outputs as the source program; shares its other
            parameters); the source program itself when no group was found (``groups`` empty).
        groups: per fused group ``(buffer name, weight targets, bias targets or None)``; targets are attribute paths
            in the source program.
        shared: per group, whether its source parameters are views of the fused buffers (no copy to keep equal).
        extra_bytes: bytes the fused copies take (on the weights' device); shared groups take none.
    """

    def __init__(self, gm: torch.fx.GraphModule, which: str = "qkv", share: bool = True):
        if which not in CHOICES:
            raise ValueError(f"fuse_projections must be one of {CHOICES}; got {which!r}")
        self._source, self.which = weakref.ref(gm), which  # weak: gm holds this object (fused_program's cache)
        self.groups: list = []
        self.shared: list = []
        self.extra_bytes = 0
        self._seen: list = []
        found = _sibling_groups(gm, which) if which != "none" else []
        if not found:
            self.program = gm
            return
        graph = torch.fx.Graph()
        env: dict = {}
        graph.output(graph.graph_copy(gm.graph, env))
        buffers = {}
        owners = _storage_owners(gm) if share else {}
        for i, members in enumerate(found):
            name = f"_kvt_fused_proj_{i}"
            wts = [m.args[1].target for m in members]
            bts = [m.args[2].target for m in members] if len(members[0].args) > 2 and members[0].args[2] is not None \
                else None
            self.groups.append((name, wts, bts))
            members_t = [_attr(gm, t) for t in wts + (bts or [])]
            laid = [_concatenated([_attr(gm, t) for t in tg], owners) if tg else None for tg in (wts, bts)] \
                if share else [None, None]
            if laid[0] is not None and (laid[1] is not None) == bool(bts):
                # already consecutive rows of one storage (a reloaded artifact of a fused program): that is the buffer
                buffers[name] = tuple(laid)
                self.shared.append(True)
            elif share and all(_owns_storage(t, owners) for t in members_t):
                buffers[name] = _concat(gm, wts, bts)
                with torch.no_grad():
                    for targets, buf in zip((wts, bts), buffers[name]):
                        row = 0
                        for t in targets or []:
                            p = _attr(gm, t)
                            p.data = buf[row:row + p.shape[0]]  # same Parameter object, its storage now the buffer
                            row += p.shape[0]
                self.shared.append(True)
            else:
                buffers[name] = _concat(gm, wts, bts)
                self.shared.append(False)
                self.extra_bytes += sum(x.numel() * x.element_size() for x in buffers[name] if x is not None)
            sizes = [int(_attr(gm, t).shape[0]) for t in wts]
            new = [env[m] for m in members]
            with graph.inserting_before(new[0]):
                w = graph.get_attr(name + "_w")
                args = (new[0].args[0], w) + ((graph.get_attr(name + "_b"),) if bts else ())
                fused = graph.call_function(LINEAR, args)
                parts = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
                for j, m in enumerate(new):
                    piece = graph.call_function(operator.getitem, (parts, j))
                    m.replace_all_uses_with(piece)
            for m in new:
                attrs = [a for a in m.args[1:] if isinstance(a, torch.fx.Node)]
                graph.erase_node(m)
                for a in attrs:  # the original weight's get_attr, unless something else reads it
                    if not a.users:
                        graph.erase_node(a)
        graph.lint()
        attrs = {}  # what the new graph reads: the source program's parameters and modules, then the fused weights
        for name, (w, b) in buffers.items():
            attrs[name + "_w"] = w
            if b is not None:
                attrs[name + "_b"] = b
        for n in graph.nodes:
            if n.op in ("get_attr", "call_module") and n.target not in attrs:
                attrs[n.target] = _attr(gm, n.target)
        self.program = derived_program(gm, graph, attrs)
        self._seen = [self._stamp(g) for g in self.groups]

    @property
    def source(self) -> torch.fx.GraphModule:
        """The source program (alive as long as a runtime uses it)."""
        gm = self._source()
        if gm is None:  # pragma: no cover - the runtime holds its decode program
            raise RuntimeError("the source decode program of these fused projections was released")
        return gm

    def _stamp(self, group) -> tuple:
        _, wts, bts = group
        return tuple((t._version, t.data_ptr()) for t in (_attr(self.source, n) for n in wts + (bts or [])))

    def refresh(self, force: bool = False) -> int:
        """Copy again the groups whose source parameters changed since the last copy (``force``: every copied group;
        an update through ``param.data`` is invisible to the check; shared groups whose parameters are still the
        buffer's views never need one), in place: CUDA graphs and compiled programs that
        hold the fused buffers see the new values. Not during a CUDA graph capture. Returns the number of groups
        copied.

        Raises:
            ValueError: a source parameter changed shape, dtype or device (fuse the program again:
                build a new :class:`FusedProjections`).
        """
        done = 0
        for i, group in enumerate(self.groups):
            if self.shared[i] and self._still_views(group):
                continue  # the parameters are the buffer: nothing can differ
            stamp = self._stamp(group)
            if stamp == self._seen[i] and not force and not self.shared[i]:
                continue
            name, wts, bts = group
            extra = 0  # a shared group falling back: the bytes its replaced parameters now duplicate
            with torch.no_grad():
                for suffix, targets in (("_w", wts), ("_b", bts)):
                    if not targets:
                        continue
                    src = [_attr(self.source, t) for t in targets]
                    dst = getattr(self.program, name + suffix)
                    if sum(s.shape[0] for s in src) != dst.shape[0] or any(
                            s.shape[1:] != dst.shape[1:] or s.dtype != dst.dtype or s.device != dst.device
                            for s in src):
                        raise ValueError(f"the parameters of fused projection group {name} ({targets[0]}, ...) "
                                         f"changed shape, dtype or device since they were fused; build the runtime's "
                                         f"decode program again (a new transform, or fuse_projections='none')")
                    row = 0
                    for t in src:  # members still viewing their rows (a shared group) need no copy
                        piece = dst[row:row + t.shape[0]]
                        if t.data_ptr() != piece.data_ptr():
                            piece.copy_(t)
                            extra += t.numel() * t.element_size() if self.shared[i] else 0
                        row += t.shape[0]
            if self.shared[i]:  # a parameter was replaced: from now on this group follows the copy rule
                self.shared[i] = False
                self.extra_bytes += extra
            self._seen[i] = self._stamp(group)
            done += 1
        return done

    def _still_views(self, group) -> bool:
        """Whether each source parameter of a shared group is still its row view of the fused buffers."""
        name, wts, bts = group
        for sfx, targets in (("_w", wts), ("_b", bts)):
            if not targets:
                continue
            buf = getattr(self.program, name + sfx)
            row, step = 0, buf.stride(0) * buf.element_size()
            for t in targets:
                p = _attr(self.source, t)
                if p.data_ptr() != buf.data_ptr() + row * step or p.shape[1:] != buf.shape[1:] or \
                        p.dtype != buf.dtype or p.device != buf.device:
                    return False
                row += p.shape[0]
            if row != buf.shape[0]:
                return False
        return True


def _concat(gm, wts: list, bts: Optional[list]) -> tuple:
    """``(weights, biases or None)`` of a group concatenated into new tensors."""
    with torch.no_grad():
        return (torch.cat([_attr(gm, t) for t in wts]), torch.cat([_attr(gm, t) for t in bts]) if bts else None)


def _storage_owners(gm: torch.nn.Module) -> dict:
    """``{data_ptr: {id of each parameter / buffer object there}}`` over ``gm`` (duplicates included)."""
    owners: dict = {}
    for _, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        owners.setdefault(t.data_ptr(), set()).add(id(t))
    return owners


def _concatenated(tensors: list, owners: dict) -> Optional[torch.Tensor]:
    """The tensor the ``tensors`` already are the consecutive row blocks of (same storage, contiguous, in order:
    what a fused program's parameters look like after ``torch.export`` saved and reloaded them), viewed as one
    ``(sum of rows, ...)`` tensor; None otherwise (or when another parameter object aliases one of them)."""
    first = tensors[0]
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous() and t.dtype == first.dtype and
               t.device == first.device and t.shape[1:] == first.shape[1:] and
               owners.get(t.data_ptr()) == {id(t)} for t in tensors):
        return None
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    stride = first.stride() if first.dim() > 1 else (1,)
    view = torch.empty(0, dtype=first.dtype, device=first.device)
    return view.set_(storage, first.storage_offset(), (rows,) + tuple(first.shape[1:]), tuple(stride))


def _owns_storage(t: torch.Tensor, owners: dict) -> bool:
    """A plain tensor, contiguous, alone in its whole storage, and no other parameter or buffer object at its
    address (a tie by storage): re-pointing it at a fused buffer changes nothing else."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_contiguous() and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size() and owners.get(t.data_ptr()) == {id(t)}


class _Cache(dict):
    """``{which: FusedProjections}`` kept on the source program (so the fused copies die in the same garbage
    collection as the program); copying or pickling the program carries an empty one, not the fused weights."""

    def __reduce__(self):
        return (_Cache, ())

    def __deepcopy__(self, memo):
        return _Cache()


_ATTR = "_kvt_fused_projections"


def _cache(gm, create: bool = False) -> dict:
    per = gm.__dict__.get(_ATTR)
    if per is None and create:
        per = gm.__dict__[_ATTR] = _Cache()
    return per if per is not None else {}


def fused_program(gm: torch.fx.GraphModule, which: str, share: bool = True) -> Optional[FusedProjections]:
    """The :class:`FusedProjections` of ``gm`` for ``which`` and ``share``, built once per source program and kept on
    it (runtimes that share a decode program share its fused weights; they are freed with ``gm``); None for
    ``"none"`` or a program that is not a ``GraphModule``.

    Raises:
        ValueError: ``which`` not in :data:`CHOICES`.
    """
    if which not in CHOICES:
        raise ValueError(f"fuse_projections must be one of {CHOICES}; got {which!r}")
    if which == "none" or not isinstance(gm, torch.fx.GraphModule):
        return None
    per = _cache(gm, create=True)
    key = which if share else (which, "copy")
    if key not in per:
        per[key] = FusedProjections(gm, which, share)
    return per[key]


def fused_bytes(gm) -> int:
    """Memory held by the fused copies already built for ``gm`` (any ``which``), without building any."""
    per = _cache(gm) if isinstance(gm, torch.fx.GraphModule) else {}
    return sum(f.extra_bytes for f in per.values())


__all__ = ["FusedProjections", "fused_program", "fused_bytes", "CHOICES"]
