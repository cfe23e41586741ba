"""The transforms: one file each, each a handler registered for its config type (torchao ``quantize_`` style).

``kvt.transform(model, config)`` resolves ``config`` to a :class:`~kvtransform.config.TransformConfig` subclass and
calls the handler registered for that type; ``kvt.load(dir)`` rebuilds the module class registered with it. Importing
this package registers every transform. Adding one: copy ``canonical.py``, give it its config dataclass in
``kvtransform/config.py``, import it below (``docs/ARCHITECTURE.md``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from kvtransform.config import TransformConfig

from .base import OptimizedModule


@dataclass(frozen=True)
class TransformSpec:
    """One registered transform.

    Attributes:
        config_type: the config dataclass that selects it.
        handler: ``fn(model, config, tokenizer=None, progress=True) -> OptimizedModule``.
        module_type: the :class:`OptimizedModule` subclass it returns (``kvt.load`` rebuilds artifacts with it).
        cli_step: optional ``fn(model, tokenizer, opt, config, console) -> dict`` that ``kvtransform optimize`` runs
            after the transform and before saving, for a transform registered outside kvtransform; a plain callable
            that must not import ``kvtransform.cli``. The built-in transforms' steps (the DualKV demo, the SpeContext
            head summary) live in the CLI (``kvtransform.cli.steps.STEPS``, keyed by transform name), which takes
            precedence over this field.
    """

    config_type: type
    handler: Callable
    module_type: type
    cli_step: Optional[Callable] = None


_REGISTRY: dict[type, TransformSpec] = {}


def register_transform(config_type: type, module_type: type = OptimizedModule, cli_step: Optional[Callable] = None):
    """Decorator: register ``handler(model, config, tokenizer=None, progress=True)`` for configs of
    ``config_type`` (a :class:`~kvtransform.config.TransformConfig` subclass).

    Raises:
        TypeError: ``config_type`` is not a TransformConfig subclass, or ``module_type`` not an OptimizedModule.
    """
    if not (isinstance(config_type, type) and issubclass(config_type, TransformConfig)):
        raise TypeError(f"register_transform takes a TransformConfig subclass; got {config_type!r}")
    if not (isinstance(module_type, type) and issubclass(module_type, OptimizedModule)):
        raise TypeError(f"module_type must be an OptimizedModule subclass; got {module_type!r}")

    def deco(handler):
        _REGISTRY[config_type] = TransformSpec(config_type, handler, module_type, cli_step)
        return handler

    return deco


def spec_for(config: TransformConfig) -> TransformSpec:
    """The registered transform for ``config``'s type (or its nearest registered base class).

    Raises:
        ValueError: no transform is registered for it (the message lists the registered ones).
    """
    for cls in type(config).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    raise ValueError(f"transform {config.name!r} is not available in this installation; available: "
                     f"{sorted(s.config_type().name for s in _REGISTRY.values())}")


def registered() -> list[str]:
    """Names of the registered transforms."""
    return sorted(s.config_type().name for s in _REGISTRY.values())


# Importing the transform modules registers them.
from . import canonical  # noqa: E402,F401
from . import dualkv  # noqa: E402,F401
from . import specontext  # noqa: E402,F401
