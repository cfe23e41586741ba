"""Every decode program the SpeContext runtime runs, derived from the one the transform captured and rewrote.

The SpeContext transform (``kvtransform/transforms/specontext.py``) builds one :class:`DecodePrograms` around the
rewritten decode step and hands it to the runtime; the runtime only calls its methods and never touches a graph
(``docs/ARCHITECTURE.md``, floor "runtime"). Each variant is derived lazily, on first use, by a function of this
package:

* the **gather** program: the captured step itself, or its sibling projections fused into one GEMM each
  (:mod:`.fuse_projections`, per :attr:`DecodePrograms.fuse_projections` / :attr:`~DecodePrograms.share_fused_weights`);
* the **slot-mode** program the ``dense`` head runs (:func:`.sparse_decode.slot_mode_program`: every attention
  bounded by ``cache_seqlens``, no index per token), derived from the gather program and passed through
  :attr:`DecodePrograms.slot_rewrite` when one is set;
* the **per-layer split** KV offload runs (:func:`.layer_split.split_decode_inputs`: one cache/indices triple per
  layer), derived from the gather program.

SpeContext, arXiv 2512.00722 §4–6.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .fuse_projections import CHOICES, FusedProjections, fused_bytes, fused_program
from .layer_split import split_decode_inputs
from .sparse_decode import KVT_SPARSE_DECODE, slot_mode_program

__all__ = ["DecodePrograms"]


class DecodePrograms:
    """The captured decode step and the variants derived from it (module docstring).

    Args:
        decode: the rewritten decode step (``(input_ids (B, 1), cache_seqlens (B,) int32, indices (B, H_kv, W) int32,
            k_cache, v_cache) -> (logits (B, vocab), k_new (L, B, H_kv, D), v_new, queries (L, B, H, D))``): a
            ``GraphModule`` from the sparse-decode pass (or a reloaded ``.pt2``).
        num_layers: L, the model's layers (the per-layer split).
        fuse_projections: ``"qkv"``, ``"all"`` or ``"none"`` (:data:`.fuse_projections.CHOICES`).
        share_fused_weights: the fused weights take the model's parameters' place (True) or are a copy.

    Attributes:
        source: the captured decode step (what the artifact's ``decode.pt2`` holds).
        num_layers: L.

    Raises:
        ValueError: ``fuse_projections`` not in :data:`CHOICES`, ``share_fused_weights`` not a bool.
    """

    slot_capable = True  # the slot-mode variant exists (the runtime's stand-in for a plain callable says False)

    def __init__(self, decode: torch.fx.GraphModule, num_layers: int, fuse_projections: str = "all",
                 share_fused_weights: bool = True):
        if not isinstance(decode, torch.fx.GraphModule):
            raise ValueError(f"DecodePrograms needs the rewritten decode GraphModule; got {type(decode).__name__}")
        self.source, self.num_layers = decode, int(num_layers)
        self._fuse, self._share, self._slot_rewrite = "all", True, None
        self._slot: Optional[torch.fx.GraphModule] = None
        self._splits: dict = {}  # (ready factory, id of the gather program split) -> split program
        self.fuse_projections = fuse_projections
        self.share_fused_weights = share_fused_weights

    def _changed(self) -> None:
        self._slot = None  # derived again on next use (a holder of a compiled program sees another object)

    # ---- settings ------------------------------------------------------------------------------------------------
    @property
    def fuse_projections(self) -> str:
        """``"qkv"``, ``"all"`` or ``"none"``; setting it drops the derived slot variant (rebuilt on next use)."""
        return self._fuse

    @fuse_projections.setter
    def fuse_projections(self, which: str) -> None:
        if which not in CHOICES:
            raise ValueError(f"fuse_projections must be one of {CHOICES}; got {which!r}")
        self._fuse = which
        self._changed()

    @property
    def share_fused_weights(self) -> bool:
        """Fused projections become the model's parameters (views of the fused weights) rather than a copy
        (:mod:`.fuse_projections`). Parameters that an earlier shared fusion turned into views stay views."""
        return self._share

    @share_fused_weights.setter
    def share_fused_weights(self, share: bool) -> None:
        if not isinstance(share, bool):
            raise ValueError(f"share_fused_weights must be true or false; got {share!r}")
        self._share = share
        self._changed()

    @property
    def slot_rewrite(self) -> Optional[Callable]:
        """``GraphModule -> GraphModule`` applied to the slot-mode program each time it is derived (None: none), e.g.
        the decode benchmark's ``flashinfer`` method, which swaps the attention kernel
        (:func:`kvtransform.bench.flashinfer_decode.flashinfer_program`); it survives a change of
        :attr:`fuse_projections`."""
        return self._slot_rewrite

    @slot_rewrite.setter
    def slot_rewrite(self, fn: Optional[Callable]) -> None:
        if fn is not None and not callable(fn):
            raise ValueError(f"slot_rewrite must be a callable GraphModule -> GraphModule or None; got {fn!r}")
        self._slot_rewrite = fn
        self._changed()

    # ---- derived programs ----------------------------------------------------------------------------------------
    def fused(self) -> Optional[FusedProjections]:
        """The :class:`~.fuse_projections.FusedProjections` of :attr:`source` for the current settings (built once
        per source program and kept on it; None for ``"none"``)."""
        return fused_program(self.source, self._fuse, self._share)

    def program(self, slot: bool = False) -> torch.fx.GraphModule:
        """The program to run: the gather program (fused per :attr:`fuse_projections`; its fused weights refreshed
        from the originals, except during a CUDA-graph capture), or with ``slot`` its slot-mode variant (whose
        ``indices`` input is unused).

        Raises:
            ValueError: :attr:`slot_rewrite` returned something that is not callable (a failing hook fails again at
                the next call: only a finished rewrite is kept).
        """
        fused = self.fused()
        fn = self.source if fused is None else fused.program
        if fused is not None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            fused.refresh()
        if not slot:
            return fn
        if self._slot is None:
            slot_fn = slot_mode_program(fn)
            if self._slot_rewrite is not None:
                slot_fn = self._slot_rewrite(slot_fn)
                if not callable(slot_fn):
                    raise ValueError(f"slot_rewrite returned {type(slot_fn).__name__}, not a program: it must "
                                     f"return the rewritten GraphModule")
            self._slot = slot_fn
        return self._slot

    def refresh(self, force: bool = False) -> int:
        """Copy the model's weights into the fused copies (:meth:`FusedProjections.refresh
        <kvtransform.passes.fuse_projections.FusedProjections.refresh>`; ``force``: every copied group, since an
        update through ``param.data`` is invisible to its check); returns the bytes the fused copies take (0 when
        nothing is fused or every group took the parameters' place)."""
        fused = self.fused()
        if fused is None:
            return 0
        fused.refresh(force=force)
        return fused.extra_bytes

    def layer_split(self, ready: Callable[[], torch.nn.Module] = torch.nn.Identity) -> torch.fx.GraphModule:
        """The gather program (fused per :attr:`fuse_projections`, as resident steps run it, so both give the same
        bits) split per layer for KV offload (:func:`~.layer_split.split_decode_inputs`), built once per ``ready``
        factory and program; it shares that program's weights (the fused copies are refreshed by :meth:`refresh`).

        Raises:
            ValueError: the step has sliding-window layers (an offloaded layer's slots are not cache positions).
        """
        fused = self.fused()
        base = self.source if fused is None else fused.program
        key = (ready, id(base))
        if key not in self._splits:
            windows = sorted({n.kwargs["window"] for n in self.source.graph.nodes if n.op == "call_function"
                              and n.target is KVT_SPARSE_DECODE and n.kwargs.get("window") is not None})
            if windows:  # an offloaded layer's slot buffer is indexed by slot, not by position: no window there
                raise ValueError(f"KV offload does not support sliding-window layers yet (window {windows[0]}): run "
                                 f"this model with runtime.offload off")
            self._splits[key] = split_decode_inputs(base, self.num_layers, ready)
        return self._splits[key]

    def fused_bytes(self) -> int:
        """Bytes of the fused copies already built for :attr:`source` (any setting), without building any."""
        return fused_bytes(self.source)
