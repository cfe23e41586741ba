"""``kvtransform inspect [MODEL] [key=value ...]``: load MODEL, capture it with torch.export and print the attention
sites found (layer, kind, q/kv heads, head_dim, mask kind, the attention variants: sliding window, logit soft-cap,
learned sinks, and status). Nothing is rewritten or written."""
from __future__ import annotations

from typing import Sequence

from .errors import console as _console
from .keyvalue import check_model_dtype, key_value_main, parse_key_values

__all__ = ["main"]

HELP = """usage: kvtransform inspect [MODEL] [key=value ...]

Load MODEL (default smollm2-135m), capture it with torch.export and print the table of attention sites found
(layer, kind, q/kv heads, head_dim, mask kind, status; and per layer its sliding window, logit soft-cap and learned
sinks where the model has them: Gemma 2/3, gpt-oss, Mistral with a window). Nothing is rewritten or written.

keys:
  model.dtype=float32                 float32 | bfloat16 | float16 | auto
  model.attn_implementation=sdpa      sdpa | eager
  json=true|false                     print the report as JSON instead of tables (default false)

MODEL: a registry name (e.g. smollm2-135m), a local HF directory, a .gguf file or a hub id in the local HF cache
(or model.name=...)."""

KEYS = {"model.dtype": "float32", "model.attn_implementation": "sdpa", "json": False}

#: The flags of earlier releases and the key each became (still accepted, with a note).
_OLD_FLAGS = {"--dtype": "model.dtype", "--attn-implementation": "model.attn_implementation"}


def _translate_old_flags(args: Sequence[str]) -> list:
    """``--dtype X`` / ``--dtype=X`` / ``--attn-implementation X`` / ``--json`` as the keys they became, each with a
    deprecation note on stderr."""
    out, i, args = [], 0, list(args)
    while i < len(args):
        a = args[i]
        flag, sep, val = a.partition("=")
        if flag in _OLD_FLAGS:
            if not sep:
                i += 1
                val = args[i] if i < len(args) else ""
            key = _OLD_FLAGS[flag]
            _console(stderr=True).print(f"[yellow]note:[/yellow] {flag} is deprecated: use {key}={val}",
                                        soft_wrap=True)
            out.append(f"{key}={val}")
        elif a == "--json":
            _console(stderr=True).print("[yellow]note:[/yellow] --json is deprecated: use json=true", soft_wrap=True)
            out.append("json=true")
        else:
            out.append(a)
        i += 1
    return out


def run(args: Sequence[str]) -> None:
    import json

    import kvtransform as kvt
    from ..models import load_model
    from .errors import UsageError

    name, opts, _ = parse_key_values(_translate_old_flags(args), KEYS)
    if not isinstance(opts["json"], bool):
        raise UsageError(f"json must be true or false; got {opts['json']!r}")
    check_model_dtype(opts["model.dtype"])
    if opts["model.attn_implementation"] not in ("sdpa", "eager"):
        raise UsageError(f"model.attn_implementation must be sdpa or eager; got {opts['model.attn_implementation']!r}")
    model, _ = load_model(name, dtype=opts["model.dtype"], attn_implementation=opts["model.attn_implementation"])
    report = kvt.inspect(model, progress=not opts["json"])
    if opts["json"]:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        report.print(console=_console())


def main(args: Sequence[str]) -> int:
    """``kvtransform inspect [MODEL] [key=value ...]``."""
    return key_value_main(args, HELP, run)
