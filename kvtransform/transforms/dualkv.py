"""The DualKV transform: shared-prefix packed training for GRPO/DAPO-style RL (DualKV, arXiv 2605.15422, §2–3).

N responses that share one prompt are packed as ``[P][R_1]...[R_N]`` (:mod:`kvtransform.packing`): every per-token op
(embeddings, projections, MLP, norms, LM head) runs once on the prompt, and every attention becomes
``kvt.dualkv_attention``, in which a response token sees its group's prompt and its own response so far, never
another response. Log-probabilities and gradients equal those of the N separate sequences (the gate in
:func:`kvtransform.verify.verify_packed` checks both before the module is returned)::

    opt = kvt.transform(model, "dualkv")                        # or kvt.DualKVConfig(...)
    batch = kvt.pack_shared_prefix(prompt_ids, [r1, r2, r3])
    logprobs = batch.response_logprobs(opt(batch))              # [ (R_i,) ... ]
    loss = -sum(a * lp.sum() for a, lp in zip(advantages, logprobs)); loss.backward()   # grads on model's params

Prefix trees (multi-turn / agentic rollouts, any depth of shared prefix; Tree Training, arXiv 2511.00413) go through
the same module: ``opt(kvt.pack_trajectories(seqs, loss_masks=...))`` runs a second program, the packed one with every
``kvt.dualkv_attention`` rewritten into ``kvt.prefix_tree_attention`` (:mod:`kvtransform.passes.prefix_tree`). It is
derived at transform time from the same capture (no second ``torch.export``: the packed capture is layout-agnostic,
only the attention differs; ~0.1 s) and verified by the same gate before the module is returned. An artifact stores
the one-level program; a loaded module derives the tree program from it with the same pass on its first tree batch.

The transformed module's parameters are the original model's ``Parameter`` objects, so an optimiser built on
``model.parameters()`` trains it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch.export import Dim

from kvtransform.capture import capture_packed
from kvtransform.config import DualKVConfig
from kvtransform.layout import DualKVLayout
from kvtransform.model_features import check_attention_only_mixing, position_limits, refuse_training_dropout
from kvtransform.packing import (PackedBatch, PackedLayoutMask, check_packed, check_rope_lengths,
                                 pack_shared_prefix)
from kvtransform.passes.attention import AttentionPass
from kvtransform.passes.cleanup import CleanupPass
from kvtransform.passes.dualkv import DualKVPass, count_square_tensors
from kvtransform.passes.manager import PassContext
from kvtransform.passes.prefix_tree import prefix_tree_program
from kvtransform.report import Report
from kvtransform.tree_layout import PrefixTreeLayout
from kvtransform.tree_packing import TreeBatch, pack_trajectories
from kvtransform.utils import device_of, is_integer_dtype, stage
from kvtransform.verify import verify_packed

from . import register_transform
from .base import OptimizedModule, _ExportWrapper, capture_and_rewrite, new_report, onnx_stage_text

__all__ = ["DualKVModule", "dualkv_transform"]


class _PackedLogits(torch.nn.Module):
    """Adapter: ``(input_ids (1, T), position_ids (1, T), cu_seqlens, segment_prefix) -> logits (1, T, V)``
    around the rewritten packed graph; a reloaded ``.pt2`` has the same signature."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, input_ids, position_ids, cu_seqlens, segment_prefix):
        return self.gm(input_ids, position_ids, cu_seqlens, segment_prefix)


class DualKVModule(OptimizedModule):
    """A model transformed for packed shared-prefix batches (trainable; parameters are the original model's).

    Call it as ``opt(batch) -> logits (1, T, vocab)`` with a :class:`PackedBatch` (one shared level) or a
    :class:`~kvtransform.tree_packing.TreeBatch` (prefix trees, any depth), or ``opt(input_ids (1, T),
    cu_seqlens=..., segment_prefix=..., position_ids=None)`` with the DualKV layout tensors (int32; ``position_ids``
    derived from the layout when omitted), or ``opt(input_ids, layout)`` with a
    :class:`~kvtransform.layout.DualKVLayout` or a :class:`~kvtransform.tree_layout.PrefixTreeLayout`. Use
    :meth:`PackedBatch.response_logprobs` / :meth:`TreeBatch.trajectory_logprobs` on the logits.

    Attributes:
        core: the one-level program ``(input_ids, position_ids, cu_seqlens, segment_prefix) -> logits``.
        tree_core: the prefix-tree program ``(input_ids, position_ids, *PrefixTreeLayout.kernel_tensors()) ->
            logits``, sharing ``core``'s parameters (derived from ``core`` on first use in a loaded module). It is not
            a registered submodule, so ``parameters()``, ``state_dict()`` and FSDP2 see each parameter once.

    Raises (forward):
        ValueError: a plain ``(B, S)`` batch without a layout, a layout whose offsets do not sum to ``T`` or are
            malformed, ``position_ids`` that disagree with the layout, token ids outside the vocabulary, or a call
            under ``torch.autocast`` (the program runs in the dtype it was captured in).
    """

    def __init__(self, core: torch.nn.Module, config: DualKVConfig, report: Report, max_seq_len: int = 1 << 20,
                 tree_core: Optional[torch.nn.Module] = None):
        super().__init__(core, config, report, max_seq_len=max_seq_len)
        self.__dict__["_tree_core"] = tree_core  # not registered: the same parameters as core
        self.rope_limits: dict = {}  # RoPE / learned position limits (model_features.position_limits)

    @property
    def tree_core(self) -> torch.nn.Module:
        if self.__dict__.get("_tree_core") is None:  # a loaded artifact: derive it from the one-level program
            self.__dict__["_tree_core"] = prefix_tree_program(self.core, PassContext(Report()))
        return self.__dict__["_tree_core"]

    def forward(self, batch: Union[PackedBatch, TreeBatch, torch.Tensor, None] = None,
                layout: Union[DualKVLayout, PrefixTreeLayout, None] = None, *, input_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                segment_prefix: Optional[torch.Tensor] = None, **hf_kwargs) -> torch.Tensor:
        layout = self._hf_keywords(layout, hf_kwargs)
        input_ids, position_ids, lay = self._normalise(batch, layout, input_ids, position_ids, cu_seqlens,
                                                       segment_prefix)
        self.refuse_autocast(input_ids.device.type, "train through kvt.integrations.transformers.enable(model, "
                                                    "'dualkv'), which takes autocast")
        self.check_source_parameters()
        source = self._source.model() if self._source is not None else None
        if source is not None:  # switched to train mode since the transform: the program applies no dropout
            refuse_training_dropout(source, before="calling the DualKV module")
        check_packed(input_ids, position_ids, lay, self.vocab_size)
        check_rope_lengths(self.rope_limits, lay)
        if isinstance(lay, PrefixTreeLayout):
            # One level deep: the DualKV program (its kernels are faster on that shape); it was captured for at
            # least two segments, so a lone sequence stays on the tree program.
            if lay.as_dualkv() is None or lay.num_nodes < 2:
                return self.tree_core(input_ids, position_ids, *lay.kernel_tensors())
            lay = lay.as_dualkv()
        return self.core(input_ids, position_ids, lay.cu_seqlens, lay.segment_prefix)

    @staticmethod
    def _hf_keywords(layout, hf_kwargs: dict):
        """The keywords of an HF call (``model(**packed_inputs(batch))``, the other frontend's form):
        ``prefix_tree_layout`` is the layout, ``use_cache`` must be off, ``attention_mask`` is packed_inputs' marker
        (:class:`~kvtransform.packing.PackedLayoutMask`) or None; anything else is refused in one line."""
        tree = hf_kwargs.pop("prefix_tree_layout", None)
        mask = hf_kwargs.pop("attention_mask", None)
        if mask is not None and not isinstance(mask, PackedLayoutMask):
            hf_kwargs["attention_mask"] = mask  # refused below with the other HF keywords
        if hf_kwargs.pop("use_cache", False):
            raise ValueError("use_cache=True: a packed call has no KV cache (leave use_cache out or set it False)")
        if hf_kwargs:
            names = ", ".join(k + "=" for k in sorted(hf_kwargs))
            raise ValueError(f"a kvt.transform module is called as opt(batch) or opt(input_ids, layout); it takes "
                             f"no {names} (those are for a Hugging Face model under "
                             f"kvt.integrations.transformers.enable)")
        if tree is not None:
            if layout is not None:
                raise ValueError("pass the layout once: layout= or prefix_tree_layout=, not both")
            layout = tree
        return layout

    def _normalise(self, batch, layout, input_ids, position_ids, cu_seqlens, segment_prefix):
        dev = device_of(self)
        if isinstance(batch, (PackedBatch, TreeBatch)):
            if any(x is not None for x in (layout, input_ids, position_ids, cu_seqlens, segment_prefix)):
                raise ValueError(f"pass either a {type(batch).__name__} or input_ids with a layout, not both")
            b = batch.to(dev) if batch.device != dev else batch
            return b.input_ids, b.position_ids, b.layout
        if batch is not None:
            if input_ids is not None:
                raise ValueError("input_ids given twice (positionally and as a keyword)")
            input_ids = batch
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError("DualKVModule takes a PackedBatch (kvt.pack_shared_prefix / pack_shared_prefix_groups), a "
                             "TreeBatch (kvt.pack_trajectories) or input_ids (1, T) with cu_seqlens and "
                             f"segment_prefix; got {type(batch).__name__}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if layout is None:
            if cu_seqlens is None or segment_prefix is None:
                raise ValueError(
                    f"this module expects a packed shared-prefix batch but got input_ids of shape "
                    f"{tuple(input_ids.shape)} without a layout: build one with kvt.pack_shared_prefix(prompt, "
                    f"responses) (or kvt.pack_trajectories(seqs) for prefix trees), or pass cu_seqlens= and "
                    f"segment_prefix= (int32)")
            for name, t in (("cu_seqlens", cu_seqlens), ("segment_prefix", segment_prefix)):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
                    raise ValueError(f"{name} must be a 1-D int32 tensor")
            try:
                layout = DualKVLayout.from_tensors(cu_seqlens, segment_prefix)
            except ValueError as e:
                raise ValueError(f"invalid packed layout: {e}") from None
        elif not isinstance(layout, (DualKVLayout, PrefixTreeLayout)):
            raise ValueError(f"layout must be a DualKVLayout or a PrefixTreeLayout; got {type(layout).__name__}")
        elif cu_seqlens is not None or segment_prefix is not None:
            raise ValueError("pass either a layout or cu_seqlens/segment_prefix, not both")
        layout = layout.to(dev) if layout.device != dev else layout
        # int16 / uint8 ids too (the embedding takes int64 / int32 only); other dtypes are refused further on
        input_ids = input_ids.to(dev, torch.long) if is_integer_dtype(input_ids.dtype) else input_ids.to(dev)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"packed input_ids must be (1, T); got shape {tuple(input_ids.shape)}")
        if layout.total_tokens != input_ids.shape[1]:
            raise ValueError(f"layout mismatch: the layout describes {layout.total_tokens} tokens but input_ids has "
                             f"{input_ids.shape[1]}")
        position_ids = layout.position_ids()[None] if position_ids is None else position_ids.to(dev)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        return input_ids, position_ids.long(), layout

    def probe_inputs(self, tokenizer=None) -> PackedBatch:
        """One prompt and two responses cut from the base class's probe sentence (a :class:`PackedBatch`)."""
        ids = super().probe_inputs(tokenizer)[0]
        n = ids.numel()
        return pack_shared_prefix(ids[: n // 2], [ids[n // 2: 3 * n // 4], ids[3 * n // 4:]], device=device_of(self))

    core_input_names = ("input_ids", "position_ids", "cu_seqlens", "segment_prefix")

    def core_inputs(self, inputs: PackedBatch) -> tuple:
        """The one-level program's inputs from a :class:`PackedBatch`. Raises ValueError for anything else (a
        :class:`TreeBatch` runs through ``opt(batch)``, which picks the program its layout needs)."""
        if not isinstance(inputs, PackedBatch):
            raise ValueError(f"core_inputs takes a PackedBatch (the one-level program's inputs); got "
                             f"{type(inputs).__name__}: call the module itself, opt(batch), for a TreeBatch")
        return inputs.input_ids, inputs.position_ids, inputs.cu_seqlens, inputs.segment_prefix

    def export_example(self):
        dev = device_of(self)
        b = pack_shared_prefix([1, 2, 3, 4, 5], [[6, 7, 8], [9, 10, 11, 12]], device=dev)
        tok = Dim("tokens", min=2, max=self.max_seq_len)
        seg = Dim("segments", min=2, max=self.max_seq_len)
        seg1 = Dim("segments_plus_1", min=3, max=self.max_seq_len + 1)
        args = (b.input_ids, b.position_ids, b.cu_seqlens, b.segment_prefix)
        return args, ({1: tok}, {1: tok}, {0: seg1}, {0: seg})

    def write_artifact(self, directory: Path) -> dict:
        return {**super().write_artifact(directory), "rope_limits": self.rope_limits}

    @classmethod
    def from_artifact(cls, path: Path, config: DualKVConfig, report: Report, meta: dict) -> "DualKVModule":
        opt = super().from_artifact(path, config, report, meta)
        limits = meta.get("rope_limits") or {}
        if not isinstance(limits, dict) or not all(isinstance(v, int) for v in limits.values()):
            raise ValueError(f"{path / 'meta.json'} is damaged (rope_limits must map a RoPE type to a position "
                             f"count): save the artifact again")
        opt.rope_limits = dict(limits)
        return opt

    tree_input_names = ("input_ids", "position_ids", "cu_seqlens", "parent", "key_range_ptr", "key_ranges",
                        "query_range_ptr", "query_ranges")

    def export_onnx(self, path: Union[str, os.PathLike], verify: bool = True, tokenizer=None, overwrite: bool = False,
                    tree: bool = False, progress: bool = True) -> Path:
        """Write one program as one ONNX file (opset 23, masks built in the graph; :mod:`kvtransform.onnx_export`).

        ``tree=False`` (default): the one-level program :attr:`core`, inputs :attr:`core_input_names`
        (``input_ids``, ``position_ids`` int64 ``(1, T)``, ``cu_seqlens`` int32 ``(S+1,)``, ``segment_prefix``
        int32 ``(S,)``), fed from a :class:`PackedBatch`, as :meth:`OptimizedModule.export_onnx`. ``tree=True``: the
        prefix-tree program :attr:`tree_core` (derived first on a loaded module), inputs :attr:`tree_input_names`
        (``input_ids``, ``position_ids`` int64 ``(1, T)`` and the six int32 ``PrefixTreeLayout.kernel_tensors()``),
        fed from a :class:`TreeBatch` as ``(b.input_ids, b.position_ids, *b.layout.kernel_tensors())``; the tree
        mask is computed in the graph from ``cu_seqlens`` and the key ranges (``docs/PREFIX_TREES.md``); ``parent``
        and the query ranges are graph inputs that inference does not read. A tree graph also runs a one-level
        batch given as a depth-2 :class:`PrefixTreeLayout`. Output ``logits`` ``(1, T, vocab)``; dynamic tokens,
        nodes and ranges. One file per program: export both for both batch kinds.

        Args:
            path, verify, tokenizer, overwrite, progress: as :meth:`OptimizedModule.export_onnx`; with ``tree=True`` the
                onnxruntime check runs on a depth-3 tree cut from the probe sentence.
            tree: export the prefix-tree program instead of the one-level one.

        Raises:
            as :meth:`OptimizedModule.export_onnx` (``FileExistsError``, ``VerificationError``, ``RuntimeError``).
        """
        for name, flag in (("tree", tree), ("verify", verify)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False; got {flag!r}")
        if not tree:
            return super().export_onnx(path, verify=verify, tokenizer=tokenizer, overwrite=overwrite, progress=progress)
        from kvtransform import onnx_export
        from kvtransform.capture import export_dynamic
        from kvtransform.verify import default_tolerance

        self.refuse_sharded("an ONNX file")
        path = onnx_export.check_onnx_target(path, overwrite)
        probe = self.probe_inputs(tokenizer) if verify else None  # (a wrong tokenizer is named before the export)
        with stage(progress, onnx_stage_text(path, verify)):
            dev = device_of(self)
            ex = pack_trajectories([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 3, 7, 9, 10, 11], [12, 13]], device=dev)
            tok, nod = Dim("tokens", min=2, max=self.max_seq_len), Dim("nodes", min=2, max=self.max_seq_len)
            rk, rq = Dim("key_ranges", min=1, max=self.max_seq_len), Dim("query_ranges", min=1, max=self.max_seq_len)
            args = (ex.input_ids, ex.position_ids, *ex.layout.kernel_tensors())
            dyn = ({1: tok}, {1: tok}, {0: nod + 1}, {0: nod}, {0: nod + 1}, {0: rk}, {0: nod + 1}, {0: rq})
            ep = export_dynamic(_ExportWrapper(self.tree_core), args, None, {"args": dyn}, "the prefix-tree program")
            check = None
            if verify:
                (prompt, (r1, r2)), = probe.groups  # a depth-3 tree of the probe sentence
                seqs = [torch.cat([prompt, r1]), torch.cat([prompt, r2]), torch.cat([prompt, r1[:1], r2[-2:]])]
                b = pack_trajectories(seqs, device=dev)
                feeds = dict(zip(self.tree_input_names, (b.input_ids, b.position_ids, *b.layout.kernel_tensors())))
                tol = default_tolerance(next(self.core.parameters()).dtype, self.config.verify.tolerance)

                def check(tmp_path):
                    onnx_export.compare_onnx(tmp_path, self.tree_core, feeds, tolerance=tol)

            return onnx_export.export_onnx(ep, path, self.tree_input_names, check=check, overwrite=overwrite)


@register_transform(DualKVConfig, module_type=DualKVModule)
def dualkv_transform(model, cfg: DualKVConfig, tokenizer=None, progress: bool = True) -> DualKVModule:
    """DualKV transform: packed capture → canonical attention (mask proven causal) → ``kvt.dualkv_attention`` →
    cleanup; the prefix-tree program derived from it (``kvt.prefix_tree_attention``); exactness gate on the
    replicated batch for both.

    Raises:
        ValueError: not a causal LM, a layer that mixes tokens outside attention (convolutions, recurrent state,
            chunked attention: :func:`kvtransform.model_features.check_attention_only_mixing`), or an attention the packed
            layout cannot express (a custom mask; a window, soft-cap or sinks the installed op does not take): the
            message lists the refused sites.
        kvtransform.verify.VerificationError: the packed module differs from the original beyond tolerance.
    """
    refuse_training_dropout(model)
    check_attention_only_mixing(model, "the DualKV transform")
    report = new_report(model, cfg)
    gm, ctx, cap = capture_and_rewrite(model, capture_packed, [AttentionPass, DualKVPass, CleanupPass], report,
                                       progress, what="capturing the model (packed, torch.export)")
    rec = report.pass_record("dualkv")
    if rec.skipped or rec.rewritten == 0:
        reasons = "; ".join(sorted({f"site {s['site']}: {s['reason']}" for s in rec.skipped})) or \
            "no attention found"
        raise ValueError(f"the dualkv transform cannot rewrite this model: {reasons}. Packed shared-prefix "
                         f"attention supports causal attention, within a window or not, with soft-capping or sinks "
                         f"where the installed op takes them (no custom masks)")
    remaining = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in
                    (torch.ops.kvt.attention.default, torch.ops.aten.scaled_dot_product_attention.default))
    if remaining:
        raise ValueError(f"{remaining} attention nodes were left unrewritten; refusing to build a packed module")
    rec.notes.append(f"mask construction gone ({report.pass_record('cleanup').nodes_removed} dead nodes removed); "
                     f"{count_square_tensors(gm)} (T,T) tensors left")
    tree = prefix_tree_program(gm, ctx)  # same capture, attention rewired to the tree layout (passes/prefix_tree.py)
    opt = DualKVModule(_PackedLogits(gm), cfg, report, max_seq_len=cap.max_seq_len, tree_core=tree)
    opt.link_source(model)
    opt.rope_limits = position_limits(model)
    verify_packed(model, opt, cfg, tokenizer, report, progress)  # the one-level program, then the tree program
    return opt
