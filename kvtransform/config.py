"""Transform configurations: dataclasses with a JSON/YAML round trip and strict keys.

Every transform is described by one dataclass, a subclass of :class:`TransformConfig` (``CanonicalConfig``,
``DualKVConfig``, ``SpeContextConfig``). They are
registered as Hydra structured configs (``kvtransform.cli``) so a misspelt key on the command line is an error, and
:func:`config_from_dict` applies the same strictness to plain dicts / YAML / JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from .utils import is_count


@dataclass
class VerifyConfig:
    """Verification gate: run the original and the rewritten module on the same real inputs.

    Attributes:
        enabled: run the gate (turning it off is only for debugging; the report then says ``passed: null``).
        lengths: sequence lengths (tokens) of the tokenised verification texts.
        batch_size: rows per verification batch; rows after the first are left-padded when ``padding`` is true.
        padding: also verify a left-padded batch (exercises the attention mask).
        tolerance: maximum allowed relative error ``max|a-b| / max|b|`` on the logits; ``None`` picks by dtype
            (fp32: 1e-4, fp16: 2e-2, bf16: 5e-2).
        seed: seed for anything random in the gate.
    """

    enabled: bool = True
    lengths: list = field(default_factory=lambda: [9, 37])
    batch_size: int = 2
    padding: bool = True
    tolerance: Optional[float] = None
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError (naming the key and the fix) for values the gate cannot run with."""
        if self.enabled and not list(self.lengths):
            raise ValueError("verify.lengths is empty: give at least one length (>= 2 tokens), or set "
                             "verify.enabled=false to skip verification explicitly")
        for n in self.lengths:
            if not is_count(n, 2):
                raise ValueError(f"verify.lengths must be integers >= 2 tokens; got {n!r}")
        if not is_count(self.batch_size, 1):
            raise ValueError(f"verify.batch_size must be an integer >= 1; got {self.batch_size!r}")
        if self.tolerance is not None and not (math.isfinite(self.tolerance) and self.tolerance > 0):
            raise ValueError(f"verify.tolerance must be a finite number > 0 (or null for the dtype's default); "
                             f"got {self.tolerance!r}")


@dataclass
class TransformConfig:
    """Base of every transform config (torchao ``quantize_`` style: the config's *type* selects the transform).

    A transform is registered for its config type (:func:`kvtransform.transforms.register_transform`); ``name`` is
    the string used on the command line and in artifacts, ``version`` the config schema version written into
    artifacts (a newer schema than this installation knows is refused on load).

    Attributes:
        name: the transform's name (``canonical``, ``dualkv``, ``specontext``); fixed per subclass.
        version: config schema version.
        verify: the verification gate (:class:`VerifyConfig`).
    """

    name: str = "abstract"
    version: int = 1
    verify: VerifyConfig = field(default_factory=VerifyConfig)

    def __post_init__(self) -> None:
        """Invalid values are refused at construction (and again by :meth:`validate` after later changes).
        The abstract base itself is not checked here (:meth:`validate` refuses it)."""
        if type(self) is not TransformConfig:
            self.validate()

    def validate(self) -> None:
        """Raises ValueError for invalid values (subclasses extend it)."""
        if type(self) is TransformConfig:
            raise TypeError("TransformConfig is abstract: use CanonicalConfig, DualKVConfig or SpeContextConfig")
        if not is_count(self.version, 1):
            raise ValueError(f"version must be an integer >= 1; got {self.version!r}")
        if self.version > CONFIG_VERSION:
            raise ValueError(f"config version {self.version} is newer than this kvtransform understands "
                             f"({CONFIG_VERSION}): upgrade kvtransform")
        if isinstance(self.verify, dict):  # verify={"enabled": False}: the same strict keys as config_from_dict
            unknown = sorted(set(self.verify) - {f.name for f in dataclasses.fields(VerifyConfig)})
            if unknown:
                raise ValueError(f"unknown verify key(s) {unknown}; valid keys: "
                                 f"{[f.name for f in dataclasses.fields(VerifyConfig)]}")
            self.verify = VerifyConfig(**self.verify)
        if not isinstance(self.verify, VerifyConfig):
            raise ValueError(f"verify must be a VerifyConfig (or a dict of its keys); got {type(self.verify).__name__}")
        self.verify.validate()

    # ---- serialisation -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))


CONFIG_VERSION = 1


@dataclass
class CanonicalConfig(TransformConfig):
    """Rewrite every standard attention into ``kvt.attention`` (the canonical op) and verify."""

    name: str = "canonical"


@dataclass
class DualKVDemoConfig:
    """The GRPO-like demo ``kvtransform optimize transform=dualkv`` runs after the transform.

    Attributes:
        enabled: run it.
        num_responses: N responses sampled from the model itself for one real prompt of the shipped text.
        max_new_tokens: longest sampled response (a response stops after EOS).
        min_new_tokens: shortest sampled response (EOS is suppressed before it).
        prompt_index: which line of ``kvtransform/data/prompts.txt`` is the prompt.
        temperature: sampling temperature.
        repeats: timed forward+backward repetitions of each (interleaved; median reported, after one warm-up).
        seed: seed of sampling and advantages.
    """

    enabled: bool = True
    num_responses: int = 8
    max_new_tokens: int = 48
    min_new_tokens: int = 4
    prompt_index: int = 0
    temperature: float = 1.0
    repeats: int = 3
    seed: int = 0


@dataclass
class DualKVConfig(TransformConfig):
    """Shared-prefix packed training attention (DualKV, arXiv 2605.15422).

    Attributes:
        verify_groups: (prompt length, response lengths) used by the exactness check against the replicated batch.
        verify_backward: the gate also compares every parameter gradient of ``Σ advantage_i · Σ logprobs_i``.
        verify_grad_tolerance: maximum ``‖g − g_ref‖₂ / ‖g_ref‖₂`` over all parameters; ``None`` picks by dtype
            (fp64: 1e-6, as transformers' norms run in fp32 there; fp32: 1e-4, fp16/bf16: 5e-2: on the H200, a
            4-layer Qwen3-8B-shaped bf16 model's own gradients differ from fp32 by 2.3e-2, so two equal bf16
            computations can differ by more than fp16's 2e-2 logits tolerance).
        demo: the demo ``kvtransform optimize transform=dualkv`` runs (not used by ``kvt.transform``).
    """

    name: str = "dualkv"
    verify_groups: list = field(default_factory=lambda: [[11, [5, 9, 3]], [6, [4, 1]]])
    verify_backward: bool = True
    verify_grad_tolerance: Optional[float] = None
    demo: DualKVDemoConfig = field(default_factory=DualKVDemoConfig)

    def validate(self) -> None:
        super().validate()
        d = self.demo
        for key, low in (("num_responses", 1), ("max_new_tokens", 1), ("min_new_tokens", 0), ("repeats", 1)):
            v = getattr(d, key)  # (a min_new_tokens above max_new_tokens is clamped to it)
            if not is_count(v, low):
                raise ValueError(f"demo.{key} must be an integer >= {low}; got {v!r}")
        t = d.temperature  # logits / t in float32 stay finite and meaningful within these bounds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 1e-3 <= t <= 1e3:
            raise ValueError(f"demo.temperature must be a number from 0.001 to 1000; got {t!r}")
        if not is_count(d.seed, 0, 2 ** 63 - 1):
            raise ValueError(f"demo.seed must be an integer from 0 to 2**63 - 1; got {d.seed!r}")
        if self.verify.enabled and not list(self.verify_groups):
            raise ValueError("verify_groups is empty: give at least one [prompt_length, [response_lengths...]] "
                             "group, or set verify.enabled=false")
        for g in self.verify_groups:  # here, not when the gate packs them after the model has loaded
            ok = isinstance(g, (list, tuple, ListConfig)) and len(g) == 2 and is_count(g[0], 1) and isinstance(
                g[1], (list, tuple, ListConfig)) and len(g[1]) >= 1 and all(is_count(r, 1) for r in g[1])
            if not ok:
                raise ValueError(f"verify_groups entries must be [prompt_length, [response_lengths...]] with "
                                 f"integers >= 1 (tokens) and at least one response; got {_plain(g)!r}")
        g = self.verify_grad_tolerance
        if g is not None and not (math.isfinite(g) and g > 0):
            raise ValueError(f"verify_grad_tolerance must be a finite number > 0 (or null); got {g!r}")


def _plain(v):
    """``v`` without OmegaConf containers (for messages)."""
    return OmegaConf.to_container(v) if isinstance(v, (ListConfig, DictConfig)) else v


#: The built-in retrieval heads that hold no trained weights (``SpeContextConfig.retrieval`` means nothing to them).
HEADS_WITHOUT_WEIGHTS = ("self", "quest", "oracle", "recent", "dense")


_EAGLE3_NEEDS_DRAFT = "head=eagle3 needs the draft: retrieval=<EAGLE-3 checkpoint directory>"


def check_retrieval(heads, retrieval) -> None:
    """``retrieval`` (a trained head's weights) checked for runs of ``heads`` before any model loads: a directory
    that one of them reads (``auto``, ``distilled``, ``eagle3`` or a registered head), or ``"self"`` / empty.

    Raises:
        ValueError: a directory that none of ``heads`` reads, ``eagle3`` without one. FileNotFoundError: a directory
            that does not exist.
    """
    from pathlib import Path

    if retrieval is None or str(retrieval).strip() in ("", "self"):
        if "eagle3" in heads:
            raise ValueError(_EAGLE3_NEEDS_DRAFT)
        return
    if all(h in HEADS_WITHOUT_WEIGHTS for h in heads):
        raise ValueError(f"retrieval={retrieval} gives a trained head's weights, which no head of {list(heads)} "
                         f"reads: add head distilled (or eagle3 for an EAGLE-3 draft), or leave retrieval unset")
    if not Path(str(retrieval)).expanduser().is_dir():
        raise FileNotFoundError(f"retrieval={retrieval}: no such directory (a head written by `kvtransform "
                                f"distill-retrieval-head`, or an EAGLE-3 draft for head=eagle3)")


def retrieval_for(head: str, retrieval: str) -> str:
    """``retrieval`` for a head that reads trained weights, ``"self"`` (unused) for one of
    :data:`HEADS_WITHOUT_WEIGHTS`: what each head gets in a run that compares several with one ``retrieval=``."""
    return "self" if head in HEADS_WITHOUT_WEIGHTS else retrieval


#: The retrieval heads kvtransform ships (``kvtransform.runtime`` registers one class per name;
#: ``tests/test_config.py`` checks the two agree). Kept here so that checking a config imports no runtime.
HEAD_NAMES = ("dense", "distilled", "eagle3", "oracle", "quest", "recent", "self")

#: ``fuse_projections`` values (``passes/fuse_projections.py``'s ``CHOICES``; ``tests/test_config.py`` checks them).
FUSE_CHOICES = ("none", "qkv", "all")


def _known_heads() -> set:
    """:data:`HEAD_NAMES` plus heads a user registered with ``kvtransform.runtime.register_head`` (read from the
    registry when ``kvtransform.runtime`` is loaded, never imported from here: a head can only have been
    registered once it is)."""
    import sys

    heads = getattr(sys.modules.get("kvtransform.runtime.heads"), "HEADS", {})
    return set(HEAD_NAMES) | set(heads)


@dataclass
class RuntimeConfig:
    """How the SpeContext runtime runs its decode programs (SpeContext, arXiv 2512.00722 §5–6). Set them as
    :class:`SpeContextConfig` keys (``kvt.SpeContextConfig(compile=True)``, ``transform.compile=true`` on the
    command line); ``SpeContextConfig.runtime`` returns them as one ``RuntimeConfig``.

    Attributes:
        cuda_graphs: on CUDA, capture the whole decode step (retrieval head + LLM) in a CUDA graph and replay it.
        offload: keep the full KV cache of some layers on CPU with elastic loading (memory model decides which);
            on CUDA the offloaded step is a CUDA-graph replay too, captured again after each layer move (Llama-8B
            shape, 16 rows: 10.55 ms a step against 8.50 resident; BENCHMARKS.md, SpeContext runtime).
        compile: on CUDA, compile the decode program with ``torch.compile`` (Inductor fuses the element-wise work
            between the projections; the ``kvt`` ops stay opaque) before the CUDA graph is captured: faster steps
            for a one-time compile of ~30 s per batch size and cache length (H200, Llama-8B shape, 25 requests,
            8K context: 10.3 → 8.0 ms per step; BENCHMARKS.md, decode throughput). ``generate`` rounds the cache
            length (prompt + max_new_tokens) up to one of 8 buckets per power of two, so requests of nearby lengths
            (e.g. a GRPO run's rollouts) share one compile, for at most 1/8 more KV memory from 2,048 tokens up (at
            least 256 tokens a row). Off by default because
            each new batch size or bucket compiles again; worth it for long generations.
        fuse_projections: the decode program's sibling projections as one GEMM each
            (:mod:`kvtransform.passes.fuse_projections`): ``"all"`` (default: the attention's q/k/v projections,
            whose narrow GQA k/v GEMMs stream their weights slowly at decode batch sizes, and SwiGLU's gate/up),
            ``"qkv"`` or ``"none"``. The model's parameters become views of the fused weights (no extra memory;
            every in-place update reaches the fused program); where they cannot (tensor subclasses, weights tied
            by storage) the fused weights are a copy (Llama-8B shape: q/k/v 1.5 GiB, gate/up 7.3 GiB), copied again
            at the start of every ``generate`` and when a parameter changes between eager steps.
        share_fused_weights: False keeps the model's parameters as they are and fuses into copies (the copy rule
            above for every group): for code that holds the parameters' storage (e.g. CUDA IPC handles taken before
            the transform) or saves the model with ``safetensors.torch.save_model``, which refuses parameters that
            are row views of one storage (``save_pretrained`` and ``torch.save`` handle them).
    """

    cuda_graphs: bool = True
    offload: bool = False
    compile: bool = False
    fuse_projections: str = "all"
    share_fused_weights: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError for a runtime key that is not a bool where one is needed, or an unknown fuse choice."""
        for key in ("cuda_graphs", "offload", "compile", "share_fused_weights"):
            v = getattr(self, key)
            if not isinstance(v, bool):
                raise ValueError(f"{key} must be true or false; got {v!r}")
        if self.fuse_projections not in FUSE_CHOICES:
            raise ValueError(f"fuse_projections must be one of {list(FUSE_CHOICES)}; got {self.fuse_projections!r}")


@dataclass
class SpeContextConfig(TransformConfig):
    """Sparse retrieval decode (SpeContext, arXiv 2512.00722, §4–5): once per decode step a retrieval head picks
    ``budget`` cached tokens per KV head and every layer attends only to those.

    Attributes:
        head: the retrieval head (``kvtransform.runtime``): ``auto`` (default: ``distilled`` when a packaged
            trained head fits the model -- SmolLM2-135M --, the head in ``retrieval``'s directory when one is given
            (:func:`kvtransform.runtime.distilled.auto_head`), else ``self``),
            ``distilled`` (a head trained by ``kvtransform distill-retrieval-head``), ``self`` (training-free: the
            model's early-layer queries from the token embedding against its real keys), ``eagle3`` (an EAGLE-3
            draft's attention), ``quest`` (16-token pages scored with per-page min/max keys), ``oracle`` (the LLM's
            own attention of the previous step: an accuracy upper bound), ``recent`` (sink + window), ``dense``
            (every token, budget ignored: the baseline), or a head registered with
            ``kvtransform.runtime.register_head``.
        budget: B, tokens kept per KV head per decode step (``quest`` rounds up to whole pages).
        num_sink: always-kept first tokens (0 = off, as in the paper).
        num_recent: always-kept most recent tokens (0 = off, as in the paper).
        page_size: tokens per page of the ``quest`` head.
        retrieval: where a trained head's weights come from (not a head name: ``retrieval="self"`` is unrelated to
            ``head="self"``): ``"self"`` (``distilled``: the packaged head for this model) or a directory
            (``distilled``: one written by ``kvtransform distill-retrieval-head``; ``eagle3``: an EAGLE-3 draft
            checkpoint). A head without weights (:data:`HEADS_WITHOUT_WEIGHTS`) refuses a directory.
        cuda_graphs, offload, compile, fuse_projections, share_fused_weights: the runtime settings, documented in
            :class:`RuntimeConfig` (:attr:`runtime` returns them as one).
    """

    name: str = "specontext"
    head: str = "auto"
    budget: int = 2048
    num_sink: int = 0
    num_recent: int = 0
    page_size: int = 16
    cuda_graphs: bool = RuntimeConfig.cuda_graphs
    retrieval: str = "self"
    offload: bool = RuntimeConfig.offload
    compile: bool = RuntimeConfig.compile
    fuse_projections: str = RuntimeConfig.fuse_projections
    share_fused_weights: bool = RuntimeConfig.share_fused_weights

    @property
    def runtime(self) -> RuntimeConfig:
        """The runtime settings (:class:`RuntimeConfig`) of this config's keys of the same names."""
        return RuntimeConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RuntimeConfig)})

    def validate(self) -> None:
        super().validate()
        if self.retrieval is None or not str(self.retrieval).strip():  # (an empty command-line value)
            self.retrieval = "self"
        for key in ("budget", "num_sink", "num_recent", "page_size"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{key} must be an integer number of tokens; got {v!r}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1 token per KV head; got {self.budget} (SpeContextConfig(budget=...) "
                             f"in Python, transform.budget=... on the command line; e.g. 2048)")
        if self.num_sink < 0 or self.num_recent < 0 or self.num_sink + self.num_recent > self.budget:
            raise ValueError(f"num_sink and num_recent must be >= 0 with num_sink + num_recent <= budget; got "
                             f"{self.num_sink}, {self.num_recent}, budget {self.budget}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 token; got {self.page_size}")
        RuntimeConfig.validate(self)  # the runtime keys, by RuntimeConfig's rules
        heads = _known_heads()
        if self.head not in heads and self.head != "auto":
            raise ValueError(f"unknown retrieval head {self.head!r}; choose one of {['auto'] + sorted(heads)} "
                             f"(auto, the default: the packaged distilled head when one fits the model, else self)")
        if self.head == "eagle3" and self.retrieval == "self":
            raise ValueError(_EAGLE3_NEEDS_DRAFT)
        if self.head in HEADS_WITHOUT_WEIGHTS and self.retrieval != "self":
            raise ValueError(f"retrieval={self.retrieval!r} gives a trained head's weights, which head={self.head!r} "
                             f"does not read: set head=distilled (a distill-retrieval-head directory) or head=eagle3 "
                             f"(an EAGLE-3 draft), or leave retrieval unset")


CONFIG_TYPES: dict[str, type] = {
    "canonical": CanonicalConfig,
    "dualkv": DualKVConfig,
    "specontext": SpeContextConfig,
}


def _unknown_transform(name) -> str:
    """The one-line refusal of an unknown transform name, with the closest known name when one is close."""
    import difflib

    close = difflib.get_close_matches(str(name).lower().replace("_", ""), sorted(CONFIG_TYPES), n=1, cutoff=0.6)
    return (f"unknown transform {name!r}" + (f": did you mean {close[0]!r}?" if close else "") +
            f" (choose one of {sorted(CONFIG_TYPES)})")


def config_from_dict(d: dict[str, Any]) -> TransformConfig:
    """Build the config dataclass named by ``d["name"]`` (default ``canonical``), rejecting unknown keys.

    Raises:
        ValueError: unknown transform name, or a key that the config does not have (the message lists valid keys).
    """
    d = dict(d)
    name = d.get("name", "canonical")
    if not isinstance(name, str) or name not in CONFIG_TYPES:
        raise ValueError(_unknown_transform(name))
    cls = CONFIG_TYPES[name]
    for k in [k for k in d if isinstance(k, str) and "." in k]:   # {"verify.lengths": [9]}: the nested key
        head, _, rest = k.partition(".")
        node = d.setdefault(head, {}) if isinstance(d.get(head, {}), dict) else None
        if node is None:
            raise ValueError(f"invalid {name} config: {k!r} and {head!r} both given; set {head} as one mapping")
        d[head] = node = dict(node)
        for part in rest.split(".")[:-1]:
            node[part] = dict(node.get(part) or {})
            node = node[part]
        node[rest.split(".")[-1]] = d.pop(k)
    bad = [k for k in d if not isinstance(k, str)]
    if bad:
        raise ValueError(f"invalid {name} config: keys must be strings; got {bad[0]!r}. "
                         f"Valid keys: {[f.name for f in dataclasses.fields(cls)]}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(d))
        cfg = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf.errors.ConfigKeyError / ValidationError and friends
        from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

        if isinstance(e, ValueError) and not isinstance(e, OmegaConfBaseException):
            raise  # the config's own check at construction (__post_init__): it names the key and the fix

        key = getattr(e, "full_key", None)
        owner = cls                                             # the (nested) config the key belongs to
        for part in (str(key).split(".")[:-1] if key else []):
            types = {f.name: f.type for f in dataclasses.fields(owner)}
            t = types.get(part)
            t = t if dataclasses.is_dataclass(t) else getattr(owner(), part, None).__class__
            if not dataclasses.is_dataclass(t):
                break
            owner = t
        valid = [f.name for f in dataclasses.fields(owner)]
        first = str(getattr(e, "msg", None) or e).splitlines()[0]
        if isinstance(e, ConfigKeyError) or not key:            # a typo: name the valid keys (and the closest)
            import difflib

            close = difflib.get_close_matches(str(key).split(".")[-1], valid, n=1) if key else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"invalid {name} config: {first}{hint}. Valid keys: {valid}") from None
        raise ValueError(f"invalid {name} config: {key}: {first}") from None   # a bad value of a valid key
    cfg.validate()
    return cfg


def config_from_yaml(text: str) -> TransformConfig:
    """Parse YAML text written by :meth:`TransformConfig.to_yaml`."""
    return config_from_dict(OmegaConf.to_container(OmegaConf.create(text)))


def config_from_json(text: str) -> TransformConfig:
    """Parse JSON text written by :meth:`TransformConfig.to_json`."""
    return config_from_dict(json.loads(text))


def resolve_config(config: "str | TransformConfig | dict") -> TransformConfig:
    """Accept a transform name, a config dataclass or a dict, return the dataclass.

    Raises:
        ValueError: unknown name or invalid keys.
        TypeError: anything else.
    """
    if isinstance(config, TransformConfig):
        config.validate()
        return config
    if isinstance(config, str):
        if config not in CONFIG_TYPES:
            raise ValueError(_unknown_transform(config))
        return CONFIG_TYPES[config]()
    if isinstance(config, dict):
        return config_from_dict(config)
    raise TypeError(f"config must be a transform name, a config dataclass or a dict, not {type(config).__name__}")
