"""Override diagnosis shared by the Hydra commands: turn a typo or a bad value into one message naming the fix.

:func:`check_overrides` composes the config once with Hydra's Compose API; an unknown key names the valid keys (and
the group choice when the typo is close to a group name: ``transfrom=x`` suggests ``transform=x``), a value of the
wrong type names the key, what it accepts and what was given, and an unknown group option (``transform=dualk``)
names the closest option and all of them.
"""
from __future__ import annotations

import difflib
import itertools
import math
import re
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from .errors import UsageError

__all__ = ["check_overrides", "split_args", "group_choices", "sweep_points"]


#: a -m sweep of at most this many jobs has every job checked before the first runs (composing one takes ~0.05 s)
MAX_CHECKED_JOBS = 256

_HYDRA_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                      "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def split_args(args: Sequence[str]) -> tuple[list[str], list[str], bool]:
    """Turn ``[MODEL] [key=value ...] [hydra flags]`` into Hydra's argv (flags first, then the overrides: argparse
    takes the positional overrides in one run, so an override after ``-m`` would be left unrecognised); return
    (argv, overrides, multirun)."""
    out: list[str] = []
    overrides: list[str] = []
    model: Optional[str] = None
    multirun = False
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            out.append(a)
            if a in ("-m", "--multirun"):
                multirun = True
            if a in _HYDRA_VALUE_FLAGS and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
            elif a == "--info" and i + 1 < len(args) and args[i + 1] in _INFO_CHOICES:
                out.append(args[i + 1])
                i += 1
        elif "=" in a or a.startswith("~"):
            overrides.append(a)
        elif model is None:
            model = a
        else:
            raise UsageError(f"unexpected argument {a!r}: give one MODEL, then overrides as key=value")
        i += 1
    if model is not None:
        from importlib.resources import files

        if files("kvtransform.conf").joinpath("model", f"{model}.yaml").is_file():
            ov = f"model={model}"
        else:
            ov = "model.name='" + model.replace("\\", "\\\\").replace("'", "\\'") + "'"
        overrides.insert(0, ov)
    return out + overrides, overrides, multirun


def _leaf_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for k in cfg.keys():
        node = cfg._get_node(k)
        path = f"{prefix}{k}"
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
            keys.extend(_leaf_keys(node, path + "."))
        else:
            keys.append(path)
    return keys


def group_choices(group: str) -> list[str]:
    """The options of a config group (``conf/<group>/*.yaml``), sorted."""
    from importlib.resources import files

    d = files("kvtransform.conf").joinpath(group)
    return sorted(f.name[: -len(".yaml")] for f in d.iterdir() if f.name.endswith(".yaml")) if d.is_dir() else []


_GROUPS = ("model", "transform")


def _other_transform_with(key: str) -> Optional[str]:
    """The transform (a ``transform`` group choice) whose config has the top-level field of ``transform.<field>...``
    in ``key``, or None: ``transform.budget`` without ``transform=specontext`` is that transform's key."""
    import dataclasses

    from kvtransform.config import resolve_config

    field = key.split(".")[1] if key.count(".") >= 1 else ""
    for choice in group_choices("transform"):
        try:
            cfg = resolve_config(choice)
        except ValueError:
            continue
        if field in {f.name for f in dataclasses.fields(cfg)}:
            return choice
    return None


def _override_value(overrides: list[str], key: str) -> Optional[str]:
    """The value given for ``key`` on the command line (last one wins), or None."""
    val = None
    for o in overrides:
        k, sep, v = o.partition("=")
        if sep and k.lstrip("+~") == key:
            val = v
    return val


def _expected(node) -> str:
    """What an OmegaConf value node accepts, in words (for an invalid-value message)."""
    from omegaconf import ListConfig
    from omegaconf.nodes import BooleanNode, EnumNode, FloatNode, IntegerNode, StringNode

    if isinstance(node, ListConfig):
        items = OmegaConf.to_container(node) if not node._is_none() and not node._is_missing() else []
        ints = bool(items) and all(isinstance(x, int) and not isinstance(x, bool) for x in items)
        example = "[" + ",".join(str(x) for x in items) + "]" if items else "[...]"
        return f"a list{' of integers' if ints else ''}, e.g. {example}"
    if isinstance(node, DictConfig):
        return "a group of keys (set its keys one by one: key.subkey=value)"
    if isinstance(node, BooleanNode):
        return "true or false"
    if isinstance(node, IntegerNode):
        return "an integer"
    if isinstance(node, FloatNode):
        return "a number" + (" or null" if node._is_optional() else "")
    if isinstance(node, EnumNode):
        return "one of " + ", ".join(m.name for m in node.enum_type)
    if isinstance(node, StringNode):
        return "a string"
    return "a valid value"


def _node(cfg: DictConfig, key: str):
    parent, _, leaf = key.rpartition(".")
    try:
        container = OmegaConf.select(cfg, parent) if parent else cfg
        return container._get_node(leaf) if isinstance(container, DictConfig) else None
    except Exception:
        return None


def parse_overrides(overrides: Sequence[str]):
    """``overrides`` parsed by Hydra's override grammar (a list of ``Override``), or None when they do not parse
    (:func:`check_overrides` names the syntax error)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return None


def sweep_points(overrides: Sequence[str]) -> tuple[list[list[str]], bool]:
    """The override lists :func:`check_overrides` (and the command's settings check) checks for a ``-m`` sweep:
    every job's (``a,b``, ``range(...)``, ``glob(...)`` over a config group's options) when the sweep has at most
    :data:`MAX_CHECKED_JOBS`, else each value of each sweep once with the other sweeps at their first value; so a
    typo'd key or a bad value in any job is named before the first job runs. Overrides that do not parse come back
    as they are (:func:`check_overrides` names the syntax error).

    Returns:
        ``(points, every_job)``: the override lists, and whether they are every job in Hydra's order (point ``i``
        is job number ``i``).

    Raises:
        UsageError: ``glob(...)`` on a key that is not a config group (Hydra would run no job) or matching no
            option; ``interval(...)`` (only sweeper plugins take it).
    """
    from hydra.core.override_parser.types import ChoiceSweep, Glob, RangeSweep

    parsed = parse_overrides(overrides)
    if parsed is None:
        return [list(overrides)], False
    values = []  # per override: the override texts it contributes, one per value
    for o in parsed:
        key, value = o.get_key_element(), o.value()
        if o.is_sweep_override() and isinstance(value, (ChoiceSweep, RangeSweep)):
            values.append([f"{key}={v}" for v in o.sweep_string_iterator()] or [o.input_line])
        elif isinstance(value, Glob):
            choices = group_choices(key.lstrip("+~"))
            if not choices:  # (Hydra would run no job at all for it)
                raise UsageError(f"{o.input_line}: glob() picks the options of a config group "
                                 f"({', '.join(_GROUPS)}), and {key} is a setting: list its values ({key}=a,b) or "
                                 f"use range(start,stop[,step])")
            picked = value.filter(choices)
            if not picked:
                raise UsageError(f"{o.input_line} matches no {key} option; choices: {', '.join(choices)}")
            values.append([f"{key}={c}" for c in picked])
        elif o.is_sweep_override():  # interval(): only sweeper plugins (Optuna, Ax) take it
            raise UsageError(f"{o.input_line}: interval() needs a sweeper plugin (Optuna, Ax), which kvtransform "
                             f"does not use: list the values ({key}=a,b) or use range(start,stop[,step])")
        else:
            values.append([o.input_line])
    if math.prod(len(v) for v in values) <= MAX_CHECKED_JOBS:  # every job: a value bad only beside another
        return [list(p) for p in itertools.product(*values)], True
    first = [v[0] for v in values]
    points = [first]
    for i, vs in enumerate(values):
        for v in vs[1:]:
            points.append([v if j == i else w[0] for j, w in enumerate(values)])
    return points, False


def check_overrides(overrides: list[str], config_name: str = "config", hydra_node: bool = False) -> DictConfig:
    """Compose the config once with the Compose API so that a typo or a bad value becomes one message; returns the
    composed config (with its ``hydra`` node when ``hydra_node``; ``${hydra:...}`` values resolve only once that
    node is set as the ``HydraConfig``: there is no Hydra run).

    An unknown key names the valid keys (and the group choice when the typo is close to a group name: ``transfrom=x``
    suggests ``transform=x``); a value of the wrong type names the key, what it accepts and what was given; an
    unknown group option (``transform=dualk``) names the closest option and all of them.
    """
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ValidationError

    app = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/", "hydra="))]
    added = [o for o in app if o.startswith("+")]
    if added:  # '+key=value' would add a key the structured config does not have, silently ignored later
        raise UsageError(f"{added[0]!r}: adding keys with '+' is not supported; every setting already exists "
                         f"(see `kvtransform optimize --help`), so drop the '+' and use key=value")
    with initialize_config_module(config_module="kvtransform.conf", version_base="1.3"):
        try:
            return compose(config_name=config_name, overrides=app, return_hydra_config=hydra_node)
        except HydraException as e:
            err = e
        # Valid keys: the config composed from the group choices only (no key overrides).
        groups = [o for o in app if "=" in o and "." not in o.split("=", 1)[0].lstrip("+~")]
        try:
            base = compose(config_name=config_name, overrides=groups)
        except HydraException:
            base = compose(config_name=config_name)
    if isinstance(err, OverrideParseException):
        raise UsageError(f"bad override syntax: {str(err).splitlines()[0]} (quote lists and strings for the shell, "
                         f"e.g. 'transform.verify.lengths=[16,64]')")
    if isinstance(err, MissingConfigException):  # unknown group option: transform=dualk
        m = re.search(r"Could not find '([^/']+)/([^']*)'", str(err))
        if m:
            group, opt = m.groups()
            choices = group_choices(group)
            close = difflib.get_close_matches(opt, choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ";"
            extra = (" (a model name or path goes first on the command line, or in model.name=...)"
                     if group == "model" else "")
            raise UsageError(f"unknown {group} {opt!r}{hint} choices: {', '.join(choices)}{extra}")
    cause = err.__cause__
    full_key = getattr(cause, "full_key", None)
    text = str(err).splitlines()[0]
    if full_key and isinstance(cause, ValidationError):  # a real key, a value it does not accept
        got = _override_value(app, full_key)
        node = _node(base, full_key)
        why = str(cause).splitlines()[0]
        expected = _expected(node) if node is not None else None
        detail = f"expected {expected} (got {got})" if expected and got is not None else why
        raise UsageError(f"invalid value for {full_key!r}: {detail}")
    if full_key:
        valid = _leaf_keys(base)
        parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
        prefixes = list(dict.fromkeys(k.rsplit(".", i)[0] for k in valid for i in range(k.count(".") + 1)))
        if parent:
            siblings = [k for k in prefixes if k.startswith(parent + ".") and "." not in k[len(parent) + 1 :]] or valid
        else:
            siblings = list(base.keys())
        # the key as typed: 'modle.name' is reported by OmegaConf as 'modle'
        typed = next((o.partition("=")[0].lstrip("+~") for o in app
                      if o.partition("=")[0].lstrip("+~").startswith(full_key)), full_key)
        rest = typed[len(full_key):] if typed.startswith(full_key + ".") else ""
        hint = ""
        group = difflib.get_close_matches(full_key, _GROUPS, n=1) if "." not in typed else []
        if group:  # transfrom=dualkv: a group choice, not transform.name
            value = _override_value(app, full_key) or ""
            choices = group_choices(group[0])
            best = difflib.get_close_matches(value, choices, n=1)
            suggestion = f"{group[0]}={best[0] if best else '<choice>'}"
            hint = f" Did you mean {suggestion!r} ({group[0]} choices: {', '.join(choices)})?"
        else:
            owner = _other_transform_with(typed) if parent == "transform" else None
            close = [k for k in difflib.get_close_matches(full_key, prefixes, n=2) if k != full_key]
            bare = typed.split(".", 1)[1] if full_key == "transform" and "." in typed else ""
            if bare in valid:  # plan-memory transform.budget=512: this command's key is budget
                hint = f" This command has no transform group: did you mean {bare!r}?"
            else:
                hint = (f" {typed.split('.', 1)[1]!r} is a key of transform={owner}: add transform={owner} to the "
                        f"command line." if owner else f" Did you mean {close[0] + rest!r}?" if close else "")
        raise UsageError(f"unknown config key {full_key!r}.{hint} Valid keys: {', '.join(siblings)}")
    if "Available options" in str(err):  # unknown group option: keep the options, drop the search path
        text = " ".join(str(err).split("Config search path")[0].split()).replace("In 'config': ", "")
    raise UsageError(text)
