"""Tables derived from a packed layout's tensors, kept while those tensors live unchanged.

A model calls its attention op once per layer in the forward and once per layer in the backward, every call with
the same layout tensors; the prefix-tree op's planning (bounded offsets, context tokens, heaviest-first work tables,
the whole-block walk tables, the device-side structure check) is most of the ~290 kernels of a forward+backward step
at the 4x2x2 agentic tree of ``kvtransform bench tree-attn``, about 2 ms beside the attention kernels' 30.8
(docs/PREFIX_TREES.md, "Planning once per layout"). :func:`memo` gives each layout one dict for such tables, so they
are built on the first call and read afterwards.

An entry belongs to the exact tensor objects it was derived from: it is used only while each of them is alive (a
weak reference) and unmodified (its version counter). A layout whose tensors are changed in place, or freed and
others allocated in their place, gets a new entry. No entry is made or read for inference-mode tensors (no version
counter), during CUDA-graph capture (the graph must own what it reads) or when not running eagerly on real tensors.
Writes that bypass the version counter are not seen (through ``.data``, a NumPy view, another process or a custom
kernel): a layout is a description to build once (``PrefixTreeLayout.from_parents``), not a buffer to refill. The
CPU path (the PyTorch reference) plans nothing and reads no entry; the tables are for the Triton kernels.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

__all__ = ["memo", "clear", "MAX_ENTRIES"]

MAX_ENTRIES = 16  # layouts remembered at once (least recently used dropped first)
_ENTRIES: "OrderedDict[tuple, tuple]" = OrderedDict()
_LOCK = threading.Lock()  # the autograd engine runs backward ops on its own thread


def _cacheable(tensors) -> bool:
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.is_inference():  # FakeTensors and other subclasses: not remembered
            return False
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
    return True


def memo(*tensors: torch.Tensor, key=()) -> dict:
    """The dict of tables derived from ``tensors`` (and the hashable ``key``, e.g. the token count): the same dict
    on every call while those exact tensors live unmodified; a fresh, unremembered dict when they cannot be
    remembered (module docstring)."""
    if not _cacheable(tensors):
        return {}
    k = (key,) + tuple((id(t), t._version) for t in tensors)
    with _LOCK:
        hit = _ENTRIES.get(k)
        if hit is not None and all(ref() is t for ref, t in zip(hit[0], tensors)):
            _ENTRIES.move_to_end(k)
            return hit[1]
        tables: dict = {}
        _ENTRIES[k] = (tuple(weakref.ref(t) for t in tensors), tables)
        while len(_ENTRIES) > MAX_ENTRIES:
            _ENTRIES.popitem(last=False)
        return tables


def clear() -> None:
    """Forget every entry (their tables are freed once nothing else holds them)."""
    with _LOCK:
        _ENTRIES.clear()
