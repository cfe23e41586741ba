"""``[MODEL] key=value ...`` for the commands that are not Hydra apps (``generate``, ``inspect``): the same shape of
command line as the Hydra ones (a positional MODEL or ``model.name=``, then ``key=value``; values are YAML scalars),
and the same kind of error: an unknown key is one line naming the closest key and every valid one."""
from __future__ import annotations

import difflib
import math
from typing import Callable, Optional, Sequence

from .errors import UsageError, guard

__all__ = ["DEFAULT_MODEL", "parse_key_values", "key_value_main", "check_model_dtype"]

DEFAULT_MODEL = "smollm2-135m"  # conf/model/smollm2-135m.yaml: the Hydra commands' default model too


def parse_key_values(args: Sequence[str], defaults: dict, raw_keys: Sequence[str] = (), prefixes: Sequence[str] = (),
                     hint: Optional[Callable[[str], Optional[str]]] = None) -> tuple[str, dict, dict]:
    """Split ``[MODEL] key=value ...`` into ``(model, options, prefixed)``.

    Args:
        args: the command's arguments.
        defaults: every accepted key with its default (``model.name`` is always accepted and is the MODEL).
        raw_keys: keys whose value is kept as the text given (``prompt=``), not read as YAML.
        prefixes: key prefixes collected into ``prefixed`` without checking (``transform.`` → ``{"budget": 8}``).
        hint: ``hint(key)`` for an unknown key: the key the user probably meant, or None (then the closest of
            ``defaults`` by spelling is named).

    Returns:
        the model (positional, else ``model.name=``, else :data:`DEFAULT_MODEL`), ``defaults`` updated by the
        command line, and the prefixed keys without their prefix.

    Raises:
        UsageError: a second MODEL, an unknown key, or an argument that starts with ``-``.
    """
    import yaml

    model, opts, extra = None, dict(defaults), {}
    for a in args:
        key, sep, raw = a.partition("=")
        if not sep:
            if a.startswith("-"):
                raise UsageError(f"unknown option {a!r}: settings are key=value (keys: {', '.join(defaults)})")
            if model is not None:
                raise UsageError(f"unexpected argument {a!r}: give one MODEL, then key=value settings")
            model = a
            continue
        value = raw if key in raw_keys else _number(yaml.safe_load(raw)) if raw else None
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if key == "model.name":
            model = str(value)
        elif prefix is not None:
            extra[key[len(prefix):]] = value
        elif key in opts:
            opts[key] = value
        else:
            close = (hint(key) if hint else None) or next(iter(difflib.get_close_matches(key, list(opts), n=1)), None)
            more = "".join(f", {p}<key>" for p in prefixes)
            raise UsageError(f"unknown key {key!r}{f' (did you mean {close!r}?)' if close else ''}; keys: "
                             f"{', '.join(opts)}, model.name{more}")
    return model or DEFAULT_MODEL, opts, extra


def check_model_dtype(value) -> None:
    """UsageError (one line) for a ``model.dtype=`` value the model loader does not take, an empty one included
    (``model.dtype=`` reads as None, which the Python API takes as float32: on a command line it is a slip)."""
    from ..models import resolve_dtype

    if value is None:
        raise UsageError("model.dtype is empty: give float32, bfloat16, float16 or auto")
    try:
        resolve_dtype(value)
    except ValueError as e:
        raise UsageError(f"model.dtype: {e}") from None


def key_value_main(args: Sequence[str], help_text: str, run: Callable[[Sequence[str]], object]) -> int:
    """The ``main`` of a key=value command: ``-h``/``--help`` prints ``help_text``; otherwise ``run(args)`` under
    :func:`~kvtransform.cli.errors.guard` (a usage or input error is one line and exit status 2). Returns 0."""
    if any(a in ("-h", "--help") for a in args):
        print(help_text)
        return 0
    guard(run, args)
    return 0


def _number(value):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string: a string that is a finite float literal becomes the float, as
    Hydra's overrides read it."""
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            return value
        if math.isfinite(f) and any(c in value for c in "eE."):
            return f
    return value
