"""What every transform shares: the :class:`OptimizedModule` it returns (call, save, load), and the front half
``capture → passes`` (:func:`capture_and_rewrite`).

A transform is one file in this package (``canonical.py`` is the smallest to copy): a handler
``fn(model, config, tokenizer=None, progress=True) -> OptimizedModule`` registered for its config type with
:func:`kvtransform.transforms.register_transform`. See ``docs/ARCHITECTURE.md``.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch.export import Dim

from kvtransform.capture import MAX_BATCH, Captured, export_dynamic, tie_aliased_parameters
from kvtransform.config import TransformConfig
from kvtransform.passes.manager import KVPass, PassContext, keyword_optional_args_all, run_passes
from kvtransform.report import Report
from kvtransform.utils import UMASK, check_free_space, device_of, is_integer_dtype, model_name, stage, timed

from .artifact_files import check_output_dir, config_keys, load_artifact_file, replace_directory


class _SourceLink:
    """What :meth:`OptimizedModule.check_source_parameters` compares: a weak reference to the transformed model and
    ``{parameter name: the Parameter object the captured programs hold}``. A deep copy (or pickle) of the module
    gets none: its programs hold copies that are not the model's, so there is nothing to check."""

    def __init__(self, model, held: dict):
        self.model, self.held = weakref.ref(model), held

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


class OptimizedModule(torch.nn.Module):
    """A transformed model: an ``nn.Module`` holding the rewritten graph, its config and its report.

    This base class is the canonical transform's module. Call it as ``opt(input_ids, attention_mask=None) ->
    logits`` with ``input_ids`` int64 ``(B, S)`` and ``attention_mask`` int/bool ``(B, S)`` (1 = real token; left
    padding supported); logits are ``(B, S, vocab)`` in the model's dtype. Other transforms subclass it (their own
    ``forward``, and :meth:`export_example` / :meth:`write_artifact` / :meth:`from_artifact` when their artifact
    differs).

    Attributes:
        core: the module that computes the logits (the rewritten FX graph, or the reloaded ``.pt2`` module).
        config: the resolved transform config (dataclass).
        report: :class:`~kvtransform.report.Report`.
        max_seq_len: the longest input the captured program accepts (tokens).
    """

    def __init__(self, core: torch.nn.Module, config: TransformConfig, report: Report, max_seq_len: int = 4096):
        super().__init__()
        self.core = core
        self.config = config
        self.report = report
        self.max_seq_len = int(max_seq_len)
        self._captured_dtype = self._weight_dtype()
        self._source = None  # _SourceLink (link_source): the model and the Parameters the program holds

    def link_source(self, model: torch.nn.Module) -> None:
        """Remember ``model``'s parameters that the captured program holds (by every name, so untying a tied
        weight is seen), for :meth:`check_source_parameters`."""
        held = {id(p): p for _, p in self.core.named_parameters(remove_duplicate=False)}
        self._source = _SourceLink(model, {n: held[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
                                           if id(p) in held})

    def check_source_parameters(self) -> None:
        """Raise ``ValueError`` when a parameter of the transformed model is no longer the ``Parameter`` object the
        captured program holds (``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(new)``, a
        PEFT adapter injected after the transform): the program would silently go on with the old weights and send
        its gradients to them. In-place updates (optimizer steps, ``load_state_dict`` without ``assign``,
        ``p.data.copy_``) are followed and pass. Weights cast to another dtype since the transform
        (``model.to(torch.bfloat16)``) are refused too (:meth:`refuse_recast`). Called by every forward (and
        ``generate``); for a reloaded artifact or once the model is gone only the cast is checked."""
        self.refuse_recast()
        if self._source is None:
            return
        model, held = self._source.model(), self._source.held
        if model is None:
            return
        live = dict(model.named_parameters(remove_duplicate=False))
        replaced = [n for n, p in held.items() if live.get(n) is not p]
        if replaced:
            more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
            raise ValueError(f"the model's parameter {replaced[0]!r}{more} was replaced after the transform "
                             f"(load_state_dict(assign=True)? module.weight = nn.Parameter(...)? a PEFT adapter?): "
                             f"the transformed program still holds the old one. Update the weights in place instead "
                             f"(load_state_dict without assign, p.data.copy_(new)), or transform the model again")

    def train(self, mode: bool = True) -> "OptimizedModule":
        """Record the mode only: the captured programs have no train/eval behaviour (captured in eval semantics; the
        DualKV module refuses a model whose dropout train mode would turn on), and a reloaded ``.pt2`` program
        raises on ``train()`` (``eval()`` too), which a trainer or a container module calls."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean; got {type(mode).__name__}")
        self.training = mode
        return self

    def refuse_sharded(self, what: str) -> None:
        """Raises ValueError (one line) when the parameters are FSDP2 shards (``kvt.distributed.shard_dualkv``):
        ``what`` (an artifact, an ONNX file) needs whole weights, which a shard holds a slice of."""
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # a torch without distributed: nothing can be sharded
            return
        if any(isinstance(p, DTensor) for p in self.parameters()):
            raise ValueError(f"this {type(self).__name__} is sharded (shard_dualkv: FSDP2), so each rank holds a slice "
                             f"of every weight: write {what} from the module before sharding it (or from the model "
                             f"with its full state dict gathered, torch.distributed.checkpoint)")

    def _weight_dtype(self) -> Optional[torch.dtype]:
        return next((p.dtype for p in self.core.parameters() if p.is_floating_point()), None)

    def refuse_recast(self) -> None:
        """Raises ValueError (one line) when the module's weights were cast to another dtype after the transform
        (``opt.to(torch.bfloat16)``): the captured program bakes its dtypes at capture, and would fail inside with a
        dtype mismatch."""
        now = self._weight_dtype()
        if now != self._captured_dtype:
            raise ValueError(f"this {type(self).__name__} was captured in {self._captured_dtype} and its weights are "
                             f"now {now}: the program keeps the dtypes of its capture; cast the model before "
                             f"kvt.transform (or transform the cast model)")

    def refuse_autocast(self, device_type: str, alternative: str = "") -> None:
        """Raises ValueError (one line) while ``torch.autocast`` is on for ``device_type``: the captured program
        bakes the dtypes of its conversions at capture (export's ``_to_copy`` and its metadata asserts), so it runs in
        the model's dtype, not under autocast; ``alternative`` names another way in, if any."""
        if torch.is_autocast_enabled(device_type):
            name = type(self).__name__
            raise ValueError(f"{'an' if name[0] in 'AEIOU' else 'a'} {name} runs the program captured in the model's "
                             f"dtype, not under torch.autocast: cast the model (e.g. model.to(torch.bfloat16)) before "
                             f"kvt.transform" + (f", or {alternative}" if alternative else ""))

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, S, vocab)``.

        Raises:
            ValueError: ``input_ids`` not an integer ``(B, S)`` tensor with ``B >= 1`` and ``1 <= S <= max_seq_len``,
                token ids outside the vocabulary, an ``attention_mask`` that is not 0/1 of the same shape, or a call
                under ``torch.autocast`` (:meth:`refuse_autocast`) or after a cast of the weights
                (:meth:`refuse_recast`). More rows than the captured batch bound (``MAX_BATCH``) run in slices.
        """
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"{type(self).__name__} takes input_ids as an integer tensor (batch, seq); got "
                             f"{type(input_ids).__name__}" + (" — a PackedBatch needs kvt.transform(model, "
                                                              "'dualkv')" if type(input_ids).__name__ ==
                                                              "PackedBatch" else ""))
        if input_ids.dim() != 2 or not is_integer_dtype(input_ids.dtype):
            raise ValueError(f"input_ids must be an integer tensor of shape (batch, seq); got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        self.refuse_autocast(input_ids.device.type)
        self.check_source_parameters()
        b, s = input_ids.shape
        if b < 1 or not 1 <= s <= self.max_seq_len:
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)}: need batch >= 1 and 1 <= seq <= "
                             f"{self.max_seq_len} (the model's maximum positions, captured as the dynamic bound)")
        vocab = self.vocab_size
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or (vocab is not None and hi >= vocab):
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab})")
        input_ids = input_ids.to(torch.long)  # any integer dtype (the embedding takes int64 / int32 only)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        elif tuple(attention_mask.shape) != (b, s) or attention_mask.dtype.is_floating_point or \
                not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError(f"attention_mask must be 0/1 (int or bool) of shape {(b, s)} like input_ids; got "
                             f"{attention_mask.dtype} {tuple(attention_mask.shape)}")
        if b > MAX_BATCH:  # the captured program's batch bound: rows are independent, so run it in slices
            return torch.cat([self.core(input_ids[i:i + MAX_BATCH], attention_mask[i:i + MAX_BATCH].to(torch.long))
                              for i in range(0, b, MAX_BATCH)])
        return self.core(input_ids, attention_mask.to(torch.long))

    @property
    def vocab_size(self) -> Optional[int]:
        """Rows of the input embedding (token ids must be below it), or None if not found."""
        if not hasattr(self, "_vocab_size"):
            self._vocab_size = next((int(p.shape[0]) for n, p in self.core.named_parameters(remove_duplicate=False)
                                     if n.endswith(("embed_tokens.weight", "wte.weight")) and p.dim() == 2), None)
        return self._vocab_size

    @property
    def code(self) -> str:
        """Readable Python of the rewritten graph."""
        gm = getattr(self.core, "gm", self.core)
        return getattr(gm, "code", repr(gm))

    # ---- probing (the CLI's reload check compares a saved artifact with the module that wrote it) ------------------
    def probe_inputs(self, tokenizer=None):
        """A small real input for this module: a tokenised sentence ``(1, S)`` (random ids without a tokenizer).
        Subclasses whose forward takes something else (a packed batch, a prompt to generate from) override it."""
        text = "kvtransform rewrites attention in causal language models into fused kernels."
        if tokenizer is not None:
            if not callable(tokenizer):
                raise ValueError(f"tokenizer must be a tokenizer object (e.g. transformers.AutoTokenizer."
                                 f"from_pretrained(path)); got {type(tokenizer).__name__}")
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            if self.vocab_size and ids.numel() and int(ids.max()) >= self.vocab_size:
                raise ValueError(f"the tokenizer gives token id {int(ids.max())}, outside the model's vocabulary of "
                                 f"{self.vocab_size}: pass the model's own tokenizer (or none: random ids)")
        else:
            ids = torch.randint(0, self.vocab_size or 2, (1, 16), generator=torch.Generator().manual_seed(0))
        return ids.to(device_of(self))

    @torch.no_grad()
    def probe(self, inputs) -> torch.Tensor:
        """What the reload check compares: the logits of ``self(inputs)`` (subclasses: e.g. generated ids)."""
        return self(inputs)

    # ---- emission --------------------------------------------------------------------------------------------------
    #: names of ``core``'s positional inputs (the ONNX graph inputs); subclasses with another signature override it
    core_input_names: tuple = ("input_ids", "attention_mask")

    def core_inputs(self, inputs) -> tuple:
        """``core``'s positional inputs for a probe input of :meth:`probe_inputs` (here ``(ids, all-ones mask)``)."""
        return inputs, torch.ones_like(inputs)

    def export_onnx(self, path: str | os.PathLike, verify: bool = True, tokenizer=None,
                    overwrite: bool = False, progress: bool = True) -> Path:
        """Write ``core`` as one ONNX file (opset 23, every ``kvt`` op translated into standard ONNX: ``Attention``
        with the mask built in the graph; :mod:`kvtransform.onnx_export`), with the dynamic dims of
        :meth:`export_example` (batch and sequence; the packed token and segment axes for DualKV). Inputs are named
        :attr:`core_input_names`, the output ``logits``. Written atomically (a temporary file renamed into place).

        Args:
            path: the ``.onnx`` file. An existing file is replaced only with ``overwrite`` (as :meth:`save`).
            verify: before writing, run the file in onnxruntime on :meth:`probe_inputs` and compare its logits with
                this module (relative tolerance ``config.verify.tolerance``; fp32 default 1e-4).
            tokenizer: for a real-text probe.
            overwrite: replace an existing ``path`` (default false).
            progress: say on stderr what runs (the export and the check take seconds to minutes), as :meth:`save`.

        Returns:
            the path written.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is false, or ``path`` is a directory (checked before
                the export; nothing written).
            kvtransform.onnx_export.UnsupportedOpError: a ``kvt`` op with no ONNX translation (the SpeContext sparse
                decode ops), named in the message.
            kvtransform.verify.VerificationError: onnxruntime's logits differ beyond tolerance.
            RuntimeError: torch.export or the ONNX exporter failed.
        """
        from kvtransform import onnx_export
        from kvtransform.verify import default_tolerance

        if not isinstance(verify, bool):
            raise ValueError(f"verify must be True or False; got {verify!r}")
        self.refuse_sharded("an ONNX file")
        path = onnx_export.check_onnx_target(path, overwrite)  # before the export, which takes seconds
        probe = self.probe_inputs(tokenizer) if verify else None  # (a wrong tokenizer is named before it too)
        with stage(progress, onnx_stage_text(path, verify)):
            args, dyn = self.export_example()
            ep = export_dynamic(_ExportWrapper(self.core), tuple(args), None, {"args": tuple(dyn)},
                                "the transformed module")
            check = None
            if verify:
                feeds = dict(zip(self.core_input_names, self.core_inputs(probe)))
                dtype = next(self.core.parameters()).dtype
                tol = default_tolerance(dtype, self.config.verify.tolerance)

                def check(tmp_path):
                    onnx_export.compare_onnx(tmp_path, self.core, feeds, tolerance=tol)

            return onnx_export.export_onnx(ep, path, self.core_input_names, check=check, overwrite=overwrite)

    def export_example(self):
        """``(args, dynamic_shapes)`` for exporting ``core`` as ``.pt2``: example positional inputs of ``core`` and
        their dynamic dimensions (a tuple matching ``args``). Subclasses with another ``core`` signature override
        this."""
        ids = torch.ones(2, 8, dtype=torch.long, device=device_of(self))
        am = torch.ones_like(ids)
        seq = Dim("seq", min=2, max=self.max_seq_len)
        batch = Dim("batch", min=1, max=1024)
        return (ids, am), ({0: batch, 1: seq}, {0: batch, 1: seq})

    def write_artifact(self, directory: Path) -> dict:
        """Write the transform-specific files into the (temporary) artifact ``directory``: here ``model.pt2`` (the
        exported ``core``) and ``graph.py``. Returns extra entries for ``meta.json``. Subclasses whose artifact
        holds more (several programs, a retrieval head) override this and :meth:`from_artifact`."""
        args, dyn = self.export_example()
        ep = export_dynamic(_ExportWrapper(self.core), tuple(args), None, {"args": tuple(dyn)},
                            "the transformed module")
        torch.export.save(ep, directory / "model.pt2")
        (directory / "graph.py").write_text(self.code)
        return {}

    @classmethod
    def from_artifact(cls, path: Path, config: TransformConfig, report: Report, meta: dict) -> "OptimizedModule":
        """Rebuild the module from an artifact directory written by :meth:`save` (``kvt.load`` calls this on the
        class registered for the config's type)."""
        if not (path / "model.pt2").is_file():
            raise FileNotFoundError(f"{str(path)!r} has no model.pt2: not a complete {config.name} artifact")
        gm = load_artifact_file(path / "model.pt2", torch.export.load).module()
        tie_aliased_parameters(gm)  # a tied embedding / LM head is one trained Parameter, as in the model
        keyword_optional_args_all(gm)  # window/softcap/sinks by keyword, as the passes read them
        return cls(gm, config, report, max_seq_len=meta.get("max_seq_len", 4096))

    def weight_bytes(self) -> int:
        """Bytes of the distinct tensors (parameters and buffers, a shared storage once) the programs hold: what an
        artifact stores at least."""
        seen, total = set(), 0
        for t in itertools.chain(self.parameters(), self.buffers()):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def save(self, path: str | os.PathLike, overwrite: bool = False, progress: bool = True) -> Path:
        """Write the artifact into directory ``path``, atomically (a temporary sibling directory renamed into
        place): :meth:`write_artifact`'s files, ``config.yaml`` (resolved config), ``report.json`` and ``meta.json``
        (transform name, maximum sequence length, torch version). ``progress``: say on stderr what is written and
        how long it took (serialising the exported programs takes minutes on a small CPU).

        Raises:
            FileExistsError: ``path`` exists and is not empty, and ``overwrite`` is false; or ``path`` is a file, the
                current directory or one of its parents, or a non-empty directory that is not a kvtransform artifact
                (never replaced, whatever ``overwrite`` says).
            OSError: the disk has less free space than the weights (:func:`kvtransform.utils.check_free_space`).
            ValueError: the module is sharded (:meth:`refuse_sharded`).
        """
        self.refuse_sharded("an artifact")
        path = check_output_dir(path, overwrite)
        check_free_space(path, self.weight_bytes())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            with stage(progress, f"saving the {self.config.name} artifact to {path}"):
                extra = self.write_artifact(tmp)
            config_yaml = self.config.to_yaml()
            (tmp / "config.yaml").write_text(config_yaml)
            (tmp / "report.json").write_text(self.report.to_json())
            meta = {"transform": self.config.name, "max_seq_len": self.max_seq_len, "torch": torch.__version__,
                    "config_keys": config_keys(config_yaml), **extra}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            os.chmod(tmp, 0o777 & ~UMASK)  # mkdtemp makes it 0700; an artifact is as readable as any new directory
            replace_directory(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path


def onnx_stage_text(path: Path, verify: bool) -> str:
    """The progress line of an ONNX export (:meth:`OptimizedModule.export_onnx`)."""
    return f"exporting {path}" + (" and checking it in onnxruntime" if verify else "")


class _ExportWrapper(torch.nn.Module):
    """What ``.pt2`` holds: ``core`` with its positional signature (``kvt.load`` wraps the module back)."""

    def __init__(self, core: torch.nn.Module):
        super().__init__()
        self.core = core

    def forward(self, *args):
        return self.core(*args)


class Logits(torch.nn.Module):
    """Adapter: ``(input_ids, attention_mask) -> logits`` around a graph captured by
    :func:`kvtransform.capture.capture` (which returns the model's output pytree)."""

    def __init__(self, gm: torch.fx.GraphModule):
        super().__init__()
        self.gm = gm

    def forward(self, input_ids, attention_mask):
        out = self.gm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits if hasattr(out, "logits") else out[0]


def capture_and_rewrite(model: torch.nn.Module, capture_fn: Callable[[torch.nn.Module], Captured],
                        passes: Sequence[Callable[[PassContext], KVPass]], report: Report, progress: bool,
                        what: str = "capturing the model with torch.export"):
    """The front half of every transform: model check, capture, passes.

    Args:
        model: a transformers causal LM.
        capture_fn: ``model -> Captured`` (:func:`kvtransform.capture.capture`, ``capture_packed``, ...).
        passes: pass factories ``ctx -> KVPass`` (usually the pass classes themselves), run in order under
            torch.fx's ``PassManager``.
        report: the transform's report (timings and pass records are appended).
        progress: show progress.
        what: the capture stage's progress text.

    Returns:
        ``(graph_module, ctx, captured)``.

    Raises:
        ValueError: ``model`` is not a decoder-only causal LM, or a pass refused the graph.
        RuntimeError: torch.export could not capture the model.
    """
    from kvtransform.models import check_causal_lm

    check_causal_lm(model)
    with stage(progress, what), timed(report.timings, "capture"):
        cap = capture_fn(model)
    ctx = PassContext(report, model.config, cap.max_seq_len)
    with stage(progress, "running passes") as st:
        gm = run_passes(cap.graph_module, [make(ctx) for make in passes],
                        progress=(lambda n: st.update(f"running pass {n}")) if st else None)
    return gm, ctx, cap


def new_report(model, config: TransformConfig) -> Report:
    """An empty report for transforming ``model`` with ``config``."""
    return Report(model=model_name(model), transform=config.name)
