"""What the runtime asks of its decode programs, and the stand-in for a plain callable.

The SpeContext transform hands :class:`~kvtransform.runtime.generate.SpeContextRuntime` an object that owns the
captured decode step and derives every variant the runtime runs (``kvtransform.passes.programs.DecodePrograms``;
``docs/ARCHITECTURE.md``, floor "runtime"). The runtime calls only these members of it:

* ``source``: the captured step (its parameters size the offload memory plan);
* ``slot_capable``: whether a slot-mode variant exists;
* ``program(slot) -> callable``: the program of one step (gather mode, or slot mode with ``slot``; another object
  once a setting changed, so a compiled copy is rebuilt);
* ``refresh(force) -> int``: copy the model's weights into fused copies; the bytes those copies take;
* ``layer_split(ready) -> GraphModule``: the step with one (cache, indices) triple per layer (KV offload);
* ``fused_bytes() -> int``; ``fused()``; the settings ``fuse_projections``, ``share_fused_weights``,
  ``slot_rewrite``.

:class:`CallableDecode` gives a plain callable step that shape: gather mode only, nothing fused, no offload.
"""
from __future__ import annotations

from typing import Callable, Optional

__all__ = ["CallableDecode"]


class CallableDecode:
    """A decode step given as a plain callable (same signature as the captured step): run as it is.

    Raises (:meth:`layer_split`):
        ValueError: offload needs the programs of the SpeContext transform.
    """

    slot_capable = False

    def __init__(self, fn: Callable, fuse_projections: str = "none", share_fused_weights: bool = True):
        self.source = fn
        self.fuse_projections, self.share_fused_weights, self.slot_rewrite = fuse_projections, share_fused_weights, None

    def program(self, slot: bool = False) -> Callable:
        return self.source

    def fused(self) -> None:
        return None

    def refresh(self, force: bool = False) -> int:
        return 0

    def fused_bytes(self) -> int:
        return 0

    def layer_split(self, ready: Optional[Callable] = None):
        raise ValueError("offload runs the per-layer split of the transform's decode program; this runtime was "
                         "built around a plain callable: build it with kvt.transform(model, SpeContextConfig(...))")
