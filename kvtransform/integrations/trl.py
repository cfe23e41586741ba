"""TRL's GRPO trainer with shared-prefix log-prob passes and SpeContext rollouts (``docs/TRL.md``).

::

    from kvtransform.integrations.trl import GRPOConfig, GRPOTrainer     # drop-in for trl's

    args = GRPOConfig(output_dir="out", num_generations=8, shared_prefix=True,
                      rollout="specontext", rollout_budget=2048)
    GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds).train()

Subclasses of ``trl.GRPOConfig`` / ``trl.GRPOTrainer`` (trl 1.16): every TRL argument, dataset, reward function, PEFT
config, callback and metric is TRL's own. Two options:

* ``shared_prefix=True``: every per-token log-prob pass (policy, old policy where TRL computes one, reference model)
  runs one prompt + its completions per group in one packed row through ``kvt.dualkv_attention``
  (:func:`kvtransform.integrations.transformers.enable`; DualKV, arXiv 2605.15422): the prompt is computed once
  instead of ``num_generations`` times. The scores land in TRL's ``(B, C)`` layout, so the loss, metrics and
  gradients are TRL's (equal to the unpacked ones under the project's numerics rule;
  :mod:`kvtransform.integrations.trl_packing` says how a batch packs). A batch that does not pack (no two rows share
  a prompt, multimodal inputs, an MoE auxiliary loss) runs TRL's own pass, said once in the log.
  ``shared_prefix="tree"`` packs each pass's rows as one prefix tree instead (``kvt.pack_trajectories``; arXiv
  2511.00413): any prefix rows share is computed once, across prompts too (a system prompt or few-shot examples
  common to several prompts, identical turns), through ``kvt.prefix_tree_attention``.
* ``rollout="specontext"`` (``rollout_budget``, ``rollout_head``): completions are sampled by the SpeContext runtime
  (SpeContext, arXiv 2512.00722) over the trainer's live weights: the captured programs hold the model's own
  ``Parameter`` objects (LoRA adapters applied unmerged inside the captured graph), so an optimizer step reaches the
  next rollout with no copy; a parameter *replaced* since the transform (not updated in place) makes the trainer
  transform the model again before the next rollout. Each sampled token's log-prob under the distribution it was
  drawn from goes into TRL's importance-sampling correction for rollout/training mismatch (the correction TRL
  applies to vLLM rollouts: ``vllm_importance_sampling_correction``, ``vllm_importance_sampling_mode``, caps), so the
  update stays on-policy for the dense model in expectation.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import trl
from trl.extras.profiling import profiling_context, profiling_decorator

from ..utils import is_count
from .trl_packing import pack_chunk, pack_chunk_tree, plan_packing, scatter_back

__all__ = ["GRPOConfig", "GRPOTrainer", "ROLLOUTS"]

logger = logging.getLogger(__name__)

ROLLOUTS = (None, "specontext")
# generation settings the SpeContext sampler reproduces (temperature / top-k / top-p); anything else is refused
_ROLLOUT_GENERATION_KEYS = {"do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "eos_token_id",
                            "pad_token_id", "bos_token_id", "cache_implementation", "min_p", "repetition_penalty"}
# generation_kwargs at the value that changes nothing in sampling (transformers' defaults): taken with SpeContext
_ROLLOUT_NO_OP_GENERATION = {"num_beams": 1, "num_beam_groups": 1, "no_repeat_ngram_size": 0, "use_cache": True}


def _no_op(key: str, value) -> bool:
    """``generation_kwargs[key] = value`` changes nothing in sampling (a plain scalar equal to the default)."""
    want = _ROLLOUT_NO_OP_GENERATION.get(key)
    return want is not None and type(value) is type(want) and value == want


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """``trl.GRPOConfig`` plus kvtransform's options (every TRL field unchanged).

    Attributes:
        shared_prefix: run the per-token log-prob passes on packed shared-prefix batches (DualKV): True (one prompt
            + its completions per group), ``"tree"`` (all rows of a pass as one prefix tree: also prefixes shared
            across prompts) or False.
        rollout: None (TRL's own generation: transformers, or vLLM with ``use_vllm``) or ``"specontext"`` (sparse
            retrieval decode over the trainer's live weights, with importance-sampling correction).
        rollout_budget: SpeContext budget, tokens kept per KV head per decode step (a budget >= the longest
            prompt + completion decodes densely).
        rollout_head: SpeContext retrieval head (``kvt.SpeContextConfig.head``; ``"auto"``: the packaged distilled
            head where one fits the model, else ``"self"``).
        rollout_retrieval: where a trained head's weights come from (``kvt.SpeContextConfig.retrieval``): ``"self"``
            (the packaged distilled head) or a directory (a ``distilled`` head from ``kvtransform
            distill-retrieval-head``, an ``eagle3`` draft checkpoint).
        rollout_compile: on CUDA, the rollout's decode program through ``torch.compile``
            (``kvt.SpeContextConfig.compile``): faster decode steps for ~30 s of compiling per rollout batch size
            and cache-length bucket (8 per power of two), i.e. once or a few times per run, not once per step.
    """

    # typed str for HfArgumentParser / TrlParser (they parse a Union[bool, str] as a bool, refusing "tree"); True and
    # False are accepted as they are, and the strings true/false/yes/no/1/0 become them (__post_init__)
    shared_prefix: str = field(default=False, metadata={
        "nargs": "?", "const": True,  # a bare --shared_prefix is true, as TRL's bool flags
        "help": "Per-token log-prob passes on packed shared-prefix batches (kvtransform DualKV): true, 'tree' "
                "(prefix trees, also across prompts) or false."})
    rollout: Optional[str] = field(default=None, metadata={"help": "None (TRL's generation) or 'specontext'."})
    rollout_budget: int = field(default=2048, metadata={"help": "SpeContext budget (tokens per KV head)."})
    rollout_head: str = field(default="auto", metadata={"help": "SpeContext retrieval head."})
    rollout_retrieval: str = field(default="self", metadata={"help": "SpeContext trained head's weights: 'self' "
                                                                      "(packaged) or a directory."})
    rollout_compile: bool = field(default=False, metadata={"help": "SpeContext rollouts: compile the decode program "
                                                                    "(CUDA)."})

    def __post_init__(self):
        super().__post_init__()
        from transformers.hf_argparser import string_to_bool

        import numpy as np

        if isinstance(self.shared_prefix, str) and self.shared_prefix.strip().lower() == "tree":
            self.shared_prefix = "tree"
        elif isinstance(self.shared_prefix, (int, np.integer, np.bool_)) and self.shared_prefix in (0, 1):
            self.shared_prefix = bool(self.shared_prefix)  # 0 / 1 (a JSON or YAML config), NumPy's bool
        elif isinstance(self.shared_prefix, str):  # a command line's or YAML's
            try:
                self.shared_prefix = string_to_bool(self.shared_prefix.strip())
            except Exception:  # argparse's error for an unknown string: ours below names the choices
                pass
        if not isinstance(self.shared_prefix, bool) and not (isinstance(self.shared_prefix, str) and
                                                             self.shared_prefix == "tree"):
            raise ValueError(f"shared_prefix must be True, False or 'tree'; got {self.shared_prefix!r}")
        if self.shared_prefix and getattr(self, "use_transformers_continuous_batching", False):
            raise ValueError(f"shared_prefix={self.shared_prefix!r} switches the model's attention to kvtransform's "
                             "packed attention, which transformers' continuous batching cannot generate with: set "
                             "use_transformers_continuous_batching=False")
        if isinstance(self.rollout, str) and self.rollout.strip().lower() in ("none", "specontext"):
            # a command line or YAML spells None as a string; the names are case-insensitive as shared_prefix's
            self.rollout = None if self.rollout.strip().lower() == "none" else "specontext"
        if self.rollout not in ROLLOUTS:
            raise ValueError(f"rollout must be None (TRL's own generation; 'none' on a command line) or "
                             f"'specontext'; got {self.rollout!r}")
        if not is_count(self.rollout_budget, 1, numpy=True):
            raise ValueError(f"rollout_budget must be an integer >= 1 (tokens per KV head); got "
                             f"{self.rollout_budget!r}")
        self.rollout_budget = int(self.rollout_budget)  # (a NumPy integer: TRL writes the config as JSON)
        if isinstance(self.rollout_head, str):  # head names are lower case; case-insensitive as rollout's
            self.rollout_head = self.rollout_head.strip().lower()
        from kvtransform.config import SpeContextConfig

        try:
            SpeContextConfig(budget=self.rollout_budget, head=self.rollout_head, retrieval=self.rollout_retrieval,
                             compile=self.rollout_compile)
        except ValueError as e:
            from kvtransform.utils import rename_keys

            why = rename_keys(str(e), {k: f"rollout_{k}" for k in ("budget", "head", "retrieval", "compile")})
            raise ValueError(f"rollout_budget / rollout_head / rollout_retrieval / rollout_compile: {why}") from None
        if self.rollout != "specontext":
            unused = [f"{k}={getattr(self, k)!r}" for k, default in (("rollout_budget", 2048), ("rollout_head", "auto"),
                      ("rollout_retrieval", "self"), ("rollout_compile", False)) if getattr(self, k) != default]
            if unused:
                logger.warning("%s has no effect without rollout='specontext' (TRL generates the completions)",
                               ", ".join(unused))
            return
        for flag in ("use_vllm", "use_transformers_continuous_batching"):
            if getattr(self, flag, False):
                raise ValueError(f"rollout='specontext' generates the completions itself: set {flag}=False")
        if self.rollout_retrieval != "self" and not os.path.isdir(os.path.expanduser(str(self.rollout_retrieval))):
            raise ValueError(f"rollout_retrieval={self.rollout_retrieval!r} is not a directory: give 'self' (the "
                             f"packaged head) or the directory `kvtransform distill-retrieval-head` wrote")
        gen = dict(self.generation_kwargs or {})  # TRL lets these override the fields in its generation config
        if gen.get("repetition_penalty", self.repetition_penalty) not in (None, 1.0) or \
                gen.get("min_p", self.min_p) not in (None, 0.0):
            raise ValueError("rollout='specontext' samples with temperature / top_k / top_p only: set "
                             "repetition_penalty=1.0 and min_p=None (in generation_kwargs too)")
        extra = sorted(k for k in set(gen) - _ROLLOUT_GENERATION_KEYS if not _no_op(k, gen[k]))
        if extra:
            raise ValueError(f"rollout='specontext' does not take generation_kwargs {extra} (it samples with "
                             f"do_sample / temperature / top_k / top_p)")
        mode = str(getattr(self, "vllm_importance_sampling_mode", ""))
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction and mode.startswith("sequence"):
            # TRL's constructor refuses this for vLLM rollouts, but runs before the trainer turns use_vllm on
            raise ValueError(f"loss_type='vespo' needs token-level importance weights: set "
                             f"vllm_importance_sampling_mode='token_truncate' or 'token_mask' (got {mode!r})")


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with :class:`GRPOConfig`'s ``shared_prefix`` and ``rollout`` (the module docstring).

    Takes TRL's arguments unchanged; ``args`` may be a plain ``trl.GRPOConfig`` (then TRL's behaviour).

    Raises:
        ValueError (one line), at construction: ``shared_prefix`` on a model whose attention the packed layout cannot
            express (``kvt.integrations.transformers.enable`` names the feature), one that applies attention dropout
            in training, or a vision-language model;
            ``rollout="specontext"`` with tools, ``rollout_func``, ``environment_factory``, a vision-language model,
            DeepSpeed / FSDP sharded weights, greedy decoding at a temperature other than 1, a ``generation_kwargs``
            ``eos_token_id`` other than the trainer's EOS ids, or a model the
            SpeContext transform cannot capture (the message names the feature).
    """

    def __init__(self, *args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        if kwargs.get("processing_class") is None and len(args) < 6 and isinstance(model, torch.nn.Module) and \
                not getattr(getattr(model, "config", None), "name_or_path", None):
            raise ValueError("this model has no name_or_path to load its tokenizer from (e.g. kvt.tiny_model): pass "
                             "processing_class= a tokenizer whose vocabulary fits the model's")
        super().__init__(*args, **kwargs)
        a = self.args
        self._kvt_said: set = set()
        self._kvt_rollout = None
        self.shared_prefix = getattr(a, "shared_prefix", False)  # False, True or "tree"
        self.rollout = getattr(a, "rollout", None)
        vlm = bool(getattr(self, "_is_vlm", False))
        if self.rollout == "specontext":
            self._check_rollout_setup(vlm)
            self._kvt_rollout = self._build_rollout()
            # In trl 1.16, past __init__ ``use_vllm`` gates exactly "completions come from an external sampler with
            # per-token sampling log-probs": compute the old-policy log-probs and apply the importance-sampling
            # correction. The vLLM client itself was never created (use_vllm was False during __init__), and the
            # methods that would call it (_generate_single_turn; tools and rollout_func are refused) are ours.
            self.use_vllm = True
        if self.shared_prefix:
            if vlm:
                raise ValueError("shared_prefix=True packs text token rows; a vision-language model's image inputs "
                                 "cannot be packed: set shared_prefix=False")
            from kvtransform.integrations.transformers import enable

            _check_no_attention_dropout(self._kvt_base())
            self._kvt_pads_shift = _pads_shift_positions(self._kvt_base())
            for m in self._kvt_models():
                try:
                    enable(m, "dualkv")
                except ValueError as e:
                    raise ValueError(f"shared_prefix=True: {e}") from None

    # ---- models ----------------------------------------------------------------------------------------------
    def _kvt_base(self, model=None) -> torch.nn.Module:
        """The transformers model under accelerate / PEFT wrappers (LoRA layers stay inside it)."""
        m = self.accelerator.unwrap_model(self.model if model is None else model)
        return m.get_base_model() if hasattr(m, "get_base_model") else m

    def _kvt_models(self) -> list:
        """The transformers models the log-prob passes run: the policy's and, when TRL keeps one, the reference."""
        out = [self._kvt_base()]
        if getattr(self, "ref_model", None) is not None:
            out.append(self._kvt_base(self.ref_model))
        return out

    def _say_once(self, what: str, key: Optional[str] = None) -> None:
        """Log ``what`` once per run for its ``key`` (default: the message itself; a message that carries a number
        passes a fixed key, or every batch of another length would log it again)."""
        key = what if key is None else key
        if key not in self._kvt_said:
            self._kvt_said.add(key)
            logger.warning(what)

    # ---- shared-prefix log-prob passes -----------------------------------------------------------------------
    @profiling_decorator
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra):
        """TRL's per-token log-probs (and entropies) ``(B, C)``, computed on packed shared-prefix batches when
        ``shared_prefix`` is on and the batch packs (:func:`~kvtransform.integrations.trl_packing.plan_packing`);
        else TRL's own pass. Returns ``(logps, entropies or None, aux_loss or None)`` as TRL's."""
        plan, why = None, ""
        if self.shared_prefix:
            if any(v is not None for v in extra.values()):
                why = "multimodal inputs"
            elif compute_aux_loss:
                why = "an MoE load-balancing loss (it counts every row's prompt tokens)"
            else:
                plan, why = plan_packing(input_ids, attention_mask, logits_to_keep, batch_size,
                                         trees=self.shared_prefix == "tree", left_padding=not self._kvt_pads_shift)
        mode = "train" if self.model.training else "eval"
        if plan is None:
            if self.shared_prefix:
                self._say_once(f"shared_prefix: a batch runs unpacked (TRL's own pass): {why}")
                self._metrics[mode]["shared_prefix/token_fraction"].append(1.0)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)
        from kvtransform.integrations.transformers import packed_inputs

        logps, ents, tokens = [], [], 0
        pack = pack_chunk_tree if self.shared_prefix == "tree" else pack_chunk
        for chunk in plan.chunks:
            packed = pack(plan, chunk, input_ids.device)
            if packed is None:
                continue
            batch, labels, rows, cols, src = packed
            tokens += batch.num_tokens
            with self.accelerator.autocast():
                out = model(**packed_inputs(batch), shift_labels=labels, fused_lm_head=True)
            logps.append((out.log_probs, rows, cols, src))
            if compute_entropy:
                ents.append((out.entropy, rows, cols, src))
        # packed tokens / the padded rows' tokens TRL's own pass would run (logged as a mean per step)
        self._metrics[mode]["shared_prefix/token_fraction"].append(tokens / max(1, input_ids.numel()))
        dtype, device = logps[0][0].dtype, logps[0][0].device
        return (scatter_back(logps, plan, dtype, device),
                scatter_back(ents, plan, dtype, device) if compute_entropy else None, None)

    # ---- SpeContext rollouts ---------------------------------------------------------------------------------
    def _check_rollout_setup(self, vlm: bool) -> None:
        for what, on in (("tools", bool(getattr(self, "tools", None))),
                         ("rollout_func", getattr(self, "rollout_func", None) is not None),
                         ("environment_factory", getattr(self, "environment_factories", None) is not None),
                         ("a vision-language model", vlm),
                         ("DeepSpeed", bool(getattr(self, "is_deepspeed_enabled", False))),
                         ("FSDP", bool(getattr(self, "is_fsdp_enabled", False)))):
            if on:
                raise ValueError(f"rollout='specontext' does not support {what} (it decodes plain text prompts "
                                 f"over the full weights on one device): set rollout=None")
        gc = self.generation_config
        stop = gc.eos_token_id if isinstance(gc.eos_token_id, (list, tuple)) else [gc.eos_token_id]
        if set(stop) - {None} != set(self.eos_token_ids) - {None}:
            raise ValueError(f"rollout='specontext' stops at the trainer's EOS ids {list(self.eos_token_ids)}, not "
                             f"at generation_kwargs' eos_token_id={gc.eos_token_id!r}: drop it from generation_kwargs")
        if not gc.do_sample and float(self.temperature) != 1.0:
            raise ValueError(f"rollout='specontext' with greedy decoding reports temperature-1 log-probs, but the "
                             f"trainer scores at temperature {self.temperature}: set temperature=1.0 or sample")
        from kvtransform.runtime.requests import _check_request

        try:  # the sampler's own checks, before the transform rather than at the first rollout
            _check_request([torch.zeros(1)], gc.max_new_tokens, gc.temperature, gc.top_k or None, gc.top_p,
                           10 ** 9, bool(gc.do_sample))
        except ValueError as e:
            raise ValueError(f"rollout='specontext': {e}") from None

    def _build_rollout(self):
        """``kvt.transform(model, SpeContextConfig(budget, head))`` of the policy's transformers model (sharing its
        ``Parameter`` objects). Raises ValueError (one line) when the model cannot be captured."""
        import kvtransform as kvt

        base = self._kvt_base()
        cfg = kvt.SpeContextConfig(budget=self.args.rollout_budget, head=self.args.rollout_head,
                                   retrieval=self.args.rollout_retrieval, compile=self.args.rollout_compile)
        try:
            return kvt.transform(base, cfg, tokenizer=self._tokenizer, progress=False)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            from kvtransform.utils import rename_keys

            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # the fix as this config names it (the messages name the CLI's and SpeContextConfig's keys)
            first = rename_keys(first, {"retrieval": "rollout_retrieval", "head": "rollout_head"})
            raise ValueError(f"rollout='specontext' cannot transform {type(base).__name__}: {first}") from e

    def _rollout_module(self):
        """The SpeContext module over the live weights; transformed again when a parameter was replaced."""
        try:
            self._kvt_rollout.check_source_parameters()
        except ValueError as e:
            self._say_once(f"rollout='specontext': transforming the model again before this rollout ({e})")
            self._kvt_rollout = self._build_rollout()
        return self._kvt_rollout

    def _warn_sequence_weights(self, context: int) -> None:
        """Once per run: a rollout whose ``context`` (prompt + new tokens) passes the budget is sparse, and a
        sequence-level importance weight of a sparse rollout is the product of its token weights
        (docs/ROLLOUT_MISMATCH.md: e^-80 to e^-600 over 4K tokens)."""
        a = self.args
        mode = str(getattr(a, "vllm_importance_sampling_mode", ""))
        if mode.startswith("sequence") and getattr(a, "vllm_importance_sampling_correction", True) and \
                context > int(a.rollout_budget):
            self._say_once(f"rollout='specontext' with vllm_importance_sampling_mode={mode!r}: rollouts of up to "
                           f"{context} tokens pass rollout_budget={a.rollout_budget}, and a sequence-level weight of "
                           f"a sparse rollout is the product of its token weights (measured e^-80 to e^-600 over 4K "
                           f"tokens, docs/ROLLOUT_MISMATCH.md): it masks or shrinks most long rollouts; "
                           f"vllm_importance_sampling_mode='token_truncate' keeps them", key="sequence_weights")

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """``rollout="specontext"``: ``(completion_ids, logprobs)`` as lists per row (each completion up to and
        including its first EOS; logprobs: each token's log-prob under the distribution it was sampled from), the
        pair TRL's vLLM path returns. Otherwise TRL's own generation."""
        if self.rollout != "specontext":
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        sp = self._rollout_module()
        device = next(self._kvt_base().parameters()).device
        width = max(len(p) for p in prompt_ids)
        pad = self._tokenizer.pad_token_id
        pad = pad if pad is not None else self.eos_token_ids[0]
        ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        gc = self.generation_config
        self._warn_sequence_weights(width + int(gc.max_new_tokens))
        seed = int(torch.randint(0, 2 ** 62, ()).item()) if gc.do_sample else None  # from the seeded global RNG
        with profiling_context(self, "specontext.generate"):
            out = sp.generate(ids.to(device), mask.to(device), max_new_tokens=gc.max_new_tokens,
                              do_sample=bool(gc.do_sample), temperature=gc.temperature, top_k=gc.top_k or None,
                              top_p=gc.top_p, eos_token_id=list(self.eos_token_ids), pad_token_id=pad, seed=seed,
                              return_dict_in_generate=True, output_logprobs=True, progress=False)
        new, lps = out.sequences[:, width:].cpu(), out.logprobs.float().cpu()
        eos = torch.isin(new, torch.tensor(list(self.eos_token_ids)))
        ends = torch.where(eos.any(1), eos.int().argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["rollout/decode_tokens_per_s"].append(float(out.stats.decode_tokens_per_s))
        return ([new[i, :int(n)].tolist() for i, n in enumerate(ends)],
                [lps[i, :int(n)].tolist() for i, n in enumerate(ends)])


def _pads_shift_positions(model: torch.nn.Module) -> bool:
    """Whether left padding moves this model's input positions when no ``position_ids`` are given, as TRL scores its
    padded rows: learned absolute positions numbered by column (GPT-2, GPT-BigCode) do; RoPE models (positions enter
    the attention only) and mask-numbered ones (OPT) do not. Packed prompts start at position 0, so such a model's
    left-padded batches run TRL's own pass. Read from the embedding output (``hidden_states[0]``) of ``[x, y]`` and
    ``[pad, x, y]``; a model that cannot report it counts as unshifted."""
    dev = next(model.parameters()).device
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            run = lambda ids, mask: model(input_ids=torch.tensor([ids], device=dev),  # noqa: E731
                                          attention_mask=torch.tensor([mask], device=dev), output_hidden_states=True,
                                          use_cache=False).hidden_states[0][0, -2:]
            return not torch.equal(run([1, 2], [1, 1]), run([0, 1, 2], [0, 1, 1]))
    except Exception:  # (no hidden states, a vocabulary under 3 tokens: nothing to compare)
        return False
    finally:
        model.train(was)


def _check_no_attention_dropout(model: torch.nn.Module) -> None:
    """Refuse (one line, at construction) attention dropout the training passes would apply: packed attention applies
    none (it would fail at the first packed training forward); :func:`kvtransform.model_features.training_dropout`."""
    from kvtransform.model_features import training_dropout

    found = training_dropout(model, attention_only=True)
    if found is not None:
        where, p, module = found
        fix = "set disable_dropout=True (TRL zeroes dropout modules)" if module else \
            f"load the model with {where.rsplit('.', 1)[-1]}=0 in its config (disable_dropout=True does not reach it)"
        raise ValueError(f"shared_prefix: {type(model).__name__} applies attention dropout {p} in training "
                         f"({where}), which packed attention does not: {fix}")
