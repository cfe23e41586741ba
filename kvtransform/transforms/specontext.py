"""The SpeContext transform: sparse retrieval decode for long generation (SpeContext, arXiv 2512.00722 §4–5).

Two captured programs and a runtime::

    sp = kvt.transform(model, kvt.SpeContextConfig(budget=1024, head="quest"))
    ids = sp.generate(input_ids, attention_mask=am, max_new_tokens=256)          # (batch, prompt + new)
    out = sp.generate(input_ids, max_new_tokens=256, return_dict_in_generate=True); out.sequences, out.stats
    sp.save("out_sp/"); kvt.load("out_sp/").generate(input_ids, max_new_tokens=8)

* **decode step** (:func:`kvtransform.capture.capture_decode_step`): one token per row over an explicit static KV
  cache; the sparse_decode pass proves every attention is causal attention over the cache and rewrites it into
  ``kvt::sparse_decode_attention(q, k_cache[l], v_cache[l], indices, cache_seqlens, k_new, v_new)`` -- one
  selection (``indices``) per step shared by every layer (§4.3);
* **prefill** (:func:`kvtransform.capture.capture_prefill`): the prompts packed on one token axis without padding,
  each its own causal segment (the canonical + dualkv passes: ``kvt.dualkv_attention`` with no responses is
  varlen causal attention), returning every layer's post-RoPE K/V for the cache;
* **decode programs** (:class:`kvtransform.passes.programs.DecodePrograms`): every variant of the decode step the
  runtime runs (fused projections, slot mode, the per-layer split of KV offload), derived on first use;
* **runtime** (:mod:`kvtransform.runtime`): cache, retrieval head, step loop, sampling, CUDA graphs.

The gate (:func:`verify_decode`) runs a ragged batch of real prompts through the packed prefill and a few
teacher-forced decode steps that select every cached token, and compares the logits with the original model.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch.export import Dim

from kvtransform.capture import capture_decode_step, capture_prefill, decode_example, export_dynamic, \
    max_positions, prefill_example
from kvtransform.config import SpeContextConfig
from kvtransform.model_features import check_equal_kv_head_dims
from kvtransform.passes.attention import AttentionPass
from kvtransform.passes.cleanup import CleanupPass
from kvtransform.passes.dualkv import DualKVPass
from kvtransform.passes.manager import keyword_optional_args_all
from kvtransform.passes.programs import DecodePrograms
from kvtransform.passes.sparse_decode import SparseDecodePass, count_cache_copies, drop_input_guards, \
    selection_layers
from kvtransform.report import Report
from kvtransform.runtime.generate import GenerateOutput, ModelInfo, SpeContextRuntime
from kvtransform.runtime.heads import HEADS, make_head
from kvtransform.utils import device_of
from kvtransform.verify import verify_decode

from . import register_transform
from .artifact_files import load_artifact_file
from .base import OptimizedModule, _ExportWrapper, capture_and_rewrite, new_report

__all__ = ["SpeContextModule", "specontext_transform", "verify_decode"]


class SpeContextModule(OptimizedModule):
    """A model transformed for sparse retrieval decode: :meth:`generate` (HF ``generate`` semantics), and
    ``opt(input_ids, attention_mask=None) -> logits (batch, vocab)`` of each prompt's last token (the packed
    prefill).

    Attributes:
        core: ``ModuleDict`` with the ``prefill`` and ``decode`` programs (rewritten FX graphs, or reloaded ``.pt2``).
        head: the :class:`~kvtransform.runtime.heads.RetrievalHead` of ``config.head``.
        info: :class:`~kvtransform.runtime.generate.ModelInfo`.
    """

    def __init__(self, prefill: torch.nn.Module, decode: torch.nn.Module, config: SpeContextConfig, report: Report,
                 info: ModelInfo, scale: Optional[float] = None, model: Optional[torch.nn.Module] = None,
                 head_name: Optional[str] = None, head_state: Optional[dict] = None):
        super().__init__(torch.nn.ModuleDict({"prefill": prefill, "decode": decode}), config, report,
                         max_seq_len=info.max_positions)
        self.info = info
        name = head_name or config.head
        if name == "auto":
            from kvtransform.runtime.distilled import auto_head

            name = auto_head(model if model is not None else decode, config.retrieval)
        self.head = make_head(name, config, scale)
        if isinstance(decode, torch.fx.GraphModule):  # heads score with the layers that read the selection
            self.head.score_layers = selection_layers(decode, config.budget)
        if head_state:
            try:
                self.head.load_state_dict(head_state)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:  # (head.pt of a damaged artifact)
                why = (str(e).strip().splitlines() or [""])[0][:160]
                raise ValueError(f"the saved state of the {name!r} retrieval head does not load ({type(e).__name__}: "
                                 f"{why}): save the artifact again") from None
        self.head.bind(model if model is not None else decode)
        rc = config.runtime  # the runtime settings (RuntimeConfig); every decode variant comes from DecodePrograms
        programs = DecodePrograms(decode, info.num_layers, rc.fuse_projections, rc.share_fused_weights)
        self.runtime = SpeContextRuntime(prefill, programs, self.head, info, cuda_graphs=rc.cuda_graphs,
                                          offload=rc.offload, compile=rc.compile)
        if model is not None:
            self.link_source(model)

    def export_onnx(self, path, verify: bool = True, tokenizer=None, overwrite: bool = False,
                    progress: bool = True):
        """Not available: the decode step's retrieval top-k and sparse attention run in the SpeContext runtime.

        Raises:
            kvtransform.onnx_export.UnsupportedOpError: always, naming those ops (before any work).
        """
        from kvtransform.onnx_export import refuse_ops

        refuse_ops(["retrieval_topk", "sparse_decode_attention"])

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def code(self) -> str:
        """Readable Python of the rewritten decode step."""
        dec = self.core["decode"]
        return getattr(dec, "code", repr(dec))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Next-token logits ``(batch, vocab)`` after each prompt (the packed prefill; padding dropped).

        Raises:
            ValueError: as :meth:`generate` for the prompts.
        """
        self.check_source_parameters()
        rows = self.runtime._rows(input_ids, attention_mask)
        _, logits = self.runtime.prefill(rows, max(int(r.numel()) for r in rows), device_of(self))
        return logits

    @torch.no_grad()
    def probe(self, inputs) -> torch.Tensor:
        """What the CLI's reload check compares: 8 greedy tokens generated from ``inputs`` (ids ``(batch, 8)``)."""
        out = self.generate(inputs, max_new_tokens=8, eos_token_id=None, progress=False)
        return out[:, inputs.shape[1]:]

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Union[int, Sequence[int], None, str] = "default", pad_token_id: Optional[int] = None,
                 seed: Optional[int] = None, return_dict_in_generate: bool = False,
                 progress: Optional[bool] = None, output_logprobs: bool = False,
                 **unsupported) -> Union[torch.Tensor, GenerateOutput]:
        """Generate with sparse retrieval decode (HF ``generate`` semantics).

        Args:
            input_ids: int64 ``(batch, seq)``, prompts of different lengths left-padded (any 0/1 mask works).
            attention_mask: 0/1 ``(batch, seq)``; default all ones.
            max_new_tokens: tokens to generate per row (>= 1).
            do_sample, temperature, top_k, top_p, seed: sampling (greedy by default). Unset ``top_k``/``top_p``
                are off (HF's ``generate`` would apply the model's ``generation_config`` or ``top_k=50``): pass
                them explicitly to sample as HF does.
            eos_token_id: stop id(s) per row; ``"default"`` = the model's generation config; None = never stop.
            pad_token_id: written after a row's EOS (default the model's pad id, else its EOS).
            return_dict_in_generate: return :class:`~kvtransform.runtime.generate.GenerateOutput` (``.sequences``,
                ``.stats``) instead of the ids.
            progress: tqdm bar over decode steps (default: ``max_new_tokens >= 256``).
            output_logprobs: with ``return_dict_in_generate``, ``GenerateOutput.logprobs`` float32 ``(batch, new)``:
                each generated token's log-probability under the distribution it was drawn from
                (:meth:`SpeContextRuntime.generate <kvtransform.runtime.generate.SpeContextRuntime.generate>`).

        Returns:
            int64 ``(batch, seq + new)`` (new = steps until the last row stopped), or :class:`GenerateOutput`.

        Raises:
            ValueError: a parameter of the model replaced since the transform (:meth:`check_source_parameters`),
                ``output_logprobs`` without ``return_dict_in_generate``, an empty prompt row, ids or
                ``eos_token_id`` outside the vocabulary, ``max_new_tokens < 1``, prompt + ``max_new_tokens`` beyond
                the model's positions, a bad sampling parameter.
            TypeError: a keyword this generate does not take (HF options such as ``num_beams``, ``max_length``,
                ``streamer``): the message lists the ones it takes and the closest name.
        """
        if unsupported:
            raise TypeError(_unsupported_generate_kwargs(unsupported))
        if not isinstance(return_dict_in_generate, bool):  # ("no" is truthy: it returned a GenerateOutput)
            raise ValueError(f"return_dict_in_generate must be True or False; got {return_dict_in_generate!r}")
        if progress is not None and not isinstance(progress, bool):
            raise ValueError(f"progress must be True, False or None (the transform's setting); got {progress!r}")
        if output_logprobs is True and return_dict_in_generate is not True:  # (ids alone would drop them)
            raise ValueError("output_logprobs=True returns the log-probs in GenerateOutput.logprobs: pass "
                             "return_dict_in_generate=True too")
        self.check_source_parameters()
        out = self.runtime.generate(input_ids, attention_mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                    temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                                    pad_token_id=pad_token_id, seed=seed, device=device_of(self),
                                    progress=progress, output_logprobs=output_logprobs)
        return out if return_dict_in_generate else out.sequences

    # ---- emission --------------------------------------------------------------------------------------------
    def _programs(self):
        """``[(file name, module, example args, dynamic shapes)]`` of the two programs."""
        dev = device_of(self)
        info = self.info
        example = _ExampleModel(info, dev)
        ids, lens, idx, kc, vc = decode_example(example)
        batch = Dim("batch", min=1, max=1024)
        s_max = Dim("s_max", min=4, max=info.max_positions)
        budget = Dim("budget", min=2, max=info.max_positions)
        dec_dyn = ({0: batch}, {0: batch}, {0: batch, 2: budget}, {1: batch, 3: s_max}, {1: batch, 3: s_max})
        tok = Dim("tokens", min=2, max=1 << 20)
        seg = Dim("segments", min=2, max=1 << 20)
        seg1 = Dim("segments_plus_1", min=3, max=(1 << 20) + 1)
        pre_dyn = ({1: tok}, {1: tok}, {0: seg1}, {0: seg}, {0: seg})
        return [("prefill.pt2", self.core["prefill"], prefill_example(example), pre_dyn),
                ("decode.pt2", self.core["decode"], (ids, lens, idx, kc, vc), dec_dyn)]

    def write_artifact(self, directory: Path) -> dict:
        """Write ``decode.pt2`` and the prefill program (the rewritten programs), ``decode_graph.py`` and ``head.pt``
        (the head's state); returns ``meta.json`` entries (the model facts the runtime needs).

        The two programs share the model's weights, but ``torch.export`` saves each program's weights on its own: the
        prefill program is written as ``prefill_shared.pt2``, its weights that equal the decode program's (all of
        them, for a model transformed here) stored as one-element placeholders and listed in
        ``meta["prefill_weights_from_decode"]``; :meth:`from_artifact` binds them to the decode program's tensors. So
        an artifact holds the weights once (an 8B model: ~16 GB instead of ~32). The file name differs from the
        full ``prefill.pt2`` so that a kvtransform without this rule refuses the artifact instead of running with
        the placeholders."""
        eps = {}
        for fname, module, args, dyn in self._programs():
            eps[fname] = export_dynamic(_ExportWrapper(module), tuple(args), None, {"args": tuple(dyn)},
                                        f"the SpeContext {fname[:-4]} program")
        shared = _strip_shared_weights(eps["prefill.pt2"], eps["decode.pt2"])
        with warnings.catch_warnings():
            # fused projections (passes/fuse_projections.py) leave a group's parameters as row views of one
            # storage; torch saves that storage once, rebuilt from the views' ranges, and says so. The reload
            # gives the same views back (FusedProjections then uses them without a copy). The placeholders of the
            # shared weights are stride-0 views of one element: torch says the same of them.
            warnings.filterwarnings("ignore", message="No complete tensor found in the group")
            torch.export.save(eps["decode.pt2"], directory / "decode.pt2")
            torch.export.save(eps["prefill.pt2"], directory / ("prefill_shared.pt2" if shared else "prefill.pt2"))
        (directory / "decode_graph.py").write_text(self.code)
        torch.save({"name": self.head.name, "state": self.head.state_dict()}, directory / "head.pt")
        return {"model_info": dataclasses.asdict(self.info), "softmax_scale": self.head.scale,
                "retrieval_head": self.head.name, "prefill_weights_from_decode": shared}

    @classmethod
    def from_artifact(cls, path: Path, config: SpeContextConfig, report: Report, meta: dict) -> "SpeContextModule":
        # meta.json names the shared weights of a prefill_shared.pt2 artifact: a missing file is then that one
        shared_file = (path / "prefill_shared.pt2").is_file() or bool(meta.get("prefill_weights_from_decode"))
        prefill_file = "prefill_shared.pt2" if shared_file else "prefill.pt2"
        missing = [f for f in (prefill_file, "decode.pt2", "head.pt") if not (path / f).is_file()]
        if missing or "model_info" not in meta:
            raise FileNotFoundError(f"{str(path)!r} is not a complete specontext artifact (missing "
                                    f"{missing or ['meta.json model_info']})")
        info = ModelInfo.from_meta(meta["model_info"], str(path / "meta.json"))  # (before the long loads)
        scale = meta.get("softmax_scale")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not 0 < scale < float("inf")):
            raise ValueError(f"{path / 'meta.json'} is damaged (softmax_scale {str(scale)[:40]!r} is not a positive "
                             f"number): save the artifact again")
        prefill = load_artifact_file(path / prefill_file, torch.export.load).module()
        decode_program = load_artifact_file(path / "decode.pt2", torch.export.load)
        info.check_decode_program(decode_program, str(path / "meta.json"))
        decode = decode_program.module()
        _drop_input_guards(decode)  # as after the capture (transform_specontext)
        for program in (prefill, decode):  # window/softcap/sinks by keyword, as the passes read them
            keyword_optional_args_all(program)
        if prefill_file == "prefill_shared.pt2":
            _bind_shared_weights(decode, prefill, meta.get("prefill_weights_from_decode"), path)
        else:  # an artifact written before prefill_shared.pt2: share what is equal
            _share_weights(decode, prefill)
        head = load_artifact_file(path / "head.pt", lambda f: torch.load(f, weights_only=True))
        if not (isinstance(head, dict) and isinstance(head.get("name"), str) and isinstance(head.get("state"), dict)):
            raise ValueError(f"{path / 'head.pt'} is damaged (not a retrieval head's name and state): save the "
                             f"artifact again")
        if head["name"] not in HEADS:  # (an empty name would fall back to the config's head)
            raise ValueError(f"{path / 'head.pt'} is damaged (head name {head['name'][:60]!r} is not a retrieval "
                             f"head: {', '.join(sorted(HEADS))}): save the artifact again")
        return cls(prefill, decode, config, report, info, scale, head_name=head["name"],
                   head_state=head["state"])


_GENERATE_KWARGS = ("attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                    "pad_token_id", "seed", "return_dict_in_generate", "progress", "output_logprobs")
_GENERATE_HINTS = {"max_length": "max_new_tokens (tokens generated per row, not counting the prompt)",
                   "generator": "seed (an int)", "topk": "top_k", "topp": "top_p"}


def _unsupported_generate_kwargs(given: dict) -> str:
    """The message for keywords :meth:`SpeContextModule.generate` does not take: each with the closest name it
    takes (or what it does instead), then the full list."""
    import difflib

    parts = []
    for key in sorted(given):
        hint = _GENERATE_HINTS.get(key) or next(iter(difflib.get_close_matches(key, _GENERATE_KWARGS, n=1,
                                                                               cutoff=0.6)), None)
        parts.append(f"{key!r}" + (f" (did you mean {hint}?)" if hint else ""))
    return (f"SpeContext generate() got keyword(s) it does not take: {', '.join(parts)}. It takes "
            f"{', '.join(_GENERATE_KWARGS)}; beam search, streamers and logits processors are not supported "
            f"(greedy or sampled decode only)")


def _drop_input_guards(gm: torch.fx.GraphModule) -> None:
    """:func:`~kvtransform.passes.sparse_decode.drop_input_guards` on ``gm``'s graph, recompiled."""
    drop_input_guards(gm.graph)
    gm.recompile()


def _same_weight(a: torch.Tensor, b: Optional[torch.Tensor]) -> bool:
    """``b`` is ``a`` as far as a saved program can tell: shape, stride, dtype, device and values."""
    if b is None or a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride() or a.device != b.device:
        return False
    return (a.data_ptr() == b.data_ptr() and a.storage_offset() == b.storage_offset()) or torch.equal(a, b)


def _strip_shared_weights(prefill_ep, decode_ep) -> list:
    """Replace, in ``prefill_ep.state_dict`` (an export made for saving only), every weight equal to the decode
    program's of the same name by a one-element stride-0 placeholder of its shape; return those names (sorted)."""
    theirs = decode_ep.state_dict
    names = sorted(n for n, w in prefill_ep.state_dict.items() if _same_weight(w, theirs.get(n)))
    for n in names:
        w = prefill_ep.state_dict[n]
        stub = torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)
        prefill_ep.state_dict[n] = torch.nn.Parameter(stub, requires_grad=False) \
            if isinstance(w, torch.nn.Parameter) else stub
    return names


def _named_tensors(m: torch.nn.Module) -> dict:
    """``{name: tensor}`` of ``m``'s parameters and buffers, tied names included."""
    return {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers(remove_duplicate=False))}


def _bind_shared_weights(src: torch.nn.Module, dst: torch.nn.Module, names, path) -> None:
    """Make ``dst``'s parameters/buffers ``names`` (an artifact's ``prefill_weights_from_decode``) the tensors of
    ``src`` of the same names.

    Raises:
        ValueError: the list is missing, a name is absent from either program, or shapes/dtypes differ (a damaged
            or mixed artifact: running on the placeholders would be silently wrong).
    """
    if not isinstance(names, list) or not names:
        raise ValueError(f"{str(path)!r}: prefill_shared.pt2 needs meta.json's 'prefill_weights_from_decode' list; "
                         f"the artifact is damaged: write it again with save()")
    theirs, mine = _named_tensors(src), _named_tensors(dst)
    for name in names:
        a, b = mine.get(name), theirs.get(name)
        why = ("is not in decode.pt2" if b is None else "is not in the prefill program" if a is None else
               "differs in shape or dtype" if a.shape != b.shape or a.dtype != b.dtype else None)
        if why:
            raise ValueError(f"{str(path)!r}: the prefill program's weight {name!r} should come from decode.pt2 but "
                             f"{why}; the artifact is damaged or mixed: write it again with save()")
        owner, _, leaf = name.rpartition(".")
        setattr(dst.get_submodule(owner) if owner else dst, leaf, b)
    left = [n for n, t in _named_tensors(dst).items() if t.numel() > 1 and all(st == 0 for st in t.stride())]
    if left:  # a placeholder the list does not name: running on it would be silently wrong
        raise ValueError(f"{str(path)!r}: the prefill program's weight(s) {left[:3]} are placeholders that meta.json's "
                         f"'prefill_weights_from_decode' does not list; the artifact is damaged: write it again with "
                         f"save()")


def _share_weights(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Make ``dst``'s parameters and buffers the very tensors of ``src`` wherever the name, shape, stride, dtype,
    device and values agree, and return the bytes that frees. An artifact's two programs were exported from one
    model and share its weights, but ``torch.export`` saves each program's weights on its own, so a reload would
    otherwise hold two copies (two 15 GB copies for an 8B model). ``src`` keeps its tensors (the decode program:
    its fused projections' row layout stays as saved); weights tied inside ``dst`` stay tied when they are tied in
    ``src``."""
    freed = 0
    for kind in ("parameters", "buffers"):
        theirs = dict(getattr(src, f"named_{kind}")(remove_duplicate=False))
        for name, mine in list(getattr(dst, f"named_{kind}")(remove_duplicate=False)):
            other = theirs.get(name)
            if other is mine or not _same_weight(mine, other):
                continue
            owner, _, leaf = name.rpartition(".")
            setattr(dst.get_submodule(owner) if owner else dst, leaf, other)
            freed += mine.numel() * mine.element_size()
    return freed


class _ExampleModel:
    """Just enough of a model (``config`` and ``parameters()``) for :func:`decode_example` /
    :func:`prefill_example` when re-exporting the programs."""

    def __init__(self, info: ModelInfo, device):
        from types import SimpleNamespace

        self.config = SimpleNamespace(num_key_value_heads=info.num_kv_heads, num_attention_heads=info.num_kv_heads,
                                      head_dim=info.head_dim, num_hidden_layers=info.num_layers,
                                      vocab_size=info.vocab_size, hidden_size=info.head_dim * info.num_kv_heads)
        self._p = torch.empty(0, dtype=getattr(torch, info.dtype), device=device)

    def parameters(self):
        return iter([self._p])


@torch.no_grad()
def head_summary(opt: SpeContextModule) -> str:
    """One line: the retrieval head in use and, for a packaged or trained head, the accuracy its ``head.json``
    records (``kvtransform eval-sparse`` on documents it never saw)."""
    head = opt.head
    line = f"retrieval head: {head.name} (budget {head.budget} tokens per KV head)"
    ev = getattr(head, "meta", {}).get("eval") if isinstance(getattr(head, "meta", None), dict) else None
    if ev:
        line += (f"; measured at budget {ev['budget']} on {ev['documents']} unseen documents of {ev['cached']} "
                 f"tokens: recall {ev['recall_mean']:.3f} (worst layer {ev['recall_worst']:.3f}), NLL "
                 f"+{ev['nll_increase']:.4f} nats/token, greedy agreement {100 * ev['agreement']:.1f}% "
                 f"({ev['command']})")
    return line


@register_transform(SpeContextConfig, module_type=SpeContextModule)
def specontext_transform(model, cfg: SpeContextConfig, tokenizer=None, progress: bool = True) -> SpeContextModule:
    """SpeContext transform: decode-step capture → sparse_decode pass → cleanup; packed prefill capture →
    canonical → dualkv (varlen causal) → cleanup; gate (:func:`verify_decode`).

    Raises:
        ValueError: not a causal LM, an unknown head, or an attention the passes cannot prove causal over the cache
            (sliding window, cross-attention, unknown mask): the message names the site and the fix.
        kvtransform.verify.VerificationError: the programs differ from the original model beyond tolerance.
    """
    check_equal_kv_head_dims(model, "the SpeContext transform")
    from kvtransform.runtime.distilled import auto_head

    chosen = auto_head(model, cfg.retrieval) if cfg.head == "auto" else cfg.head  # (as SpeContextModule chooses)
    head = make_head(chosen, cfg)  # an unknown head fails before any capture
    if (chosen in ("distilled", "eagle3") and cfg.retrieval != "self") or chosen == "self":
        head.bind(model)  # so do a missing head directory, a head of another model (a small file read) and a
        # model whose query projection the self head cannot borrow
    report = new_report(model, cfg)
    dec, ctx, cap = capture_and_rewrite(model, capture_decode_step, [SparseDecodePass, CleanupPass], report,
                                        progress, what="capturing the decode step (torch.export)")
    # the captured input guards check the export's Dim ranges (batch <= 1024, cache length >= 4, budget <= the
    # model's positions), not what the program needs: the runtime sizes these inputs itself (a 1-token prompt, a
    # budget past the positions, 1025 rows all decode correctly without them)
    _drop_input_guards(dec)
    copies = count_cache_copies(dec)
    if copies:
        raise ValueError(f"{copies} copies of the KV cache (cat(k_cache, k_new)) are left in the rewritten decode "
                         f"step; refusing a step that reads the whole cache")
    pre_report = Report()
    pre, _, _ = capture_and_rewrite(model, capture_prefill, [AttentionPass, DualKVPass, CleanupPass], pre_report,
                                    progress, what="capturing the packed prefill (torch.export)")
    rec = pre_report.pass_record("dualkv")
    if rec.skipped or rec.rewritten == 0:
        reasons = "; ".join(sorted({s["reason"] for s in rec.skipped})) or "no attention found"
        raise ValueError(f"the specontext prefill cannot be packed: {reasons}")
    for p in pre_report.passes:
        p.name = f"prefill/{p.name}"
        report.passes.append(p)
    report.timings.update({f"prefill/{k}": t for k, t in pre_report.timings.items()})
    scale = next((float(n.args[7]) for n in dec.graph.nodes if n.op == "call_function"
                  and n.target is torch.ops.kvt.sparse_decode_attention.default), None)
    opt = SpeContextModule(pre, dec, cfg, report, ModelInfo.from_model(model, max_positions(model)), scale, model=model)
    verify_decode(model, opt, cfg, tokenizer, report, progress)
    return opt
