"""What the suite configs of :mod:`.config` and :mod:`.tree_config` share: the dtype enum and the one-line checks
of a composed job's values."""
from __future__ import annotations

from enum import Enum

__all__ = ["DType", "_at_least", "_check_device", "_check_gqa"]


class DType(Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def _at_least(cfg, what: dict, minimum: int) -> None:
    for key, desc in what.items():
        val = getattr(cfg, key)
        if val < minimum:
            raise ValueError(f"{key}={val}: {key} is {desc} and must be >= {minimum}; set {key}={minimum} or more")


def _check_device(cfg) -> None:
    if str(cfg.device) != "auto":
        import torch

        try:
            torch.device(str(cfg.device))
        except (RuntimeError, ValueError, TypeError):
            raise ValueError(f"device={cfg.device}: device must be auto, cpu, cuda or cuda:N") from None


def _check_gqa(cfg) -> None:
    if cfg.heads % cfg.kv_heads != 0:
        raise ValueError(f"heads={cfg.heads} is not divisible by kv_heads={cfg.kv_heads} (GQA); pick kv_heads "
                         f"dividing heads")


def swept_settings(cfg, keys) -> str:
    """``" key=value"`` for each of ``keys`` whose value in the job's config differs from its suite's default: they
    name a result row with the shape (its ``params``), so that rows of a ``-m`` sweep over them (or an ``append`` run
    with another value) are kept apart instead of replacing each other. A config without its suite's dataclass
    (a plain dict) names none."""
    from omegaconf import OmegaConf

    kind = OmegaConf.get_type(cfg) if OmegaConf.is_config(cfg) else None
    if kind is None or not hasattr(kind, "__dataclass_fields__"):
        return ""
    default = kind()

    def text(v):
        v = v.value if isinstance(v, Enum) else v
        return str(v).lower() if isinstance(v, bool) else str(v)

    return "".join(f" {k}={text(cfg.get(k))}" for k in keys
                   if k in kind.__dataclass_fields__ and text(cfg.get(k)) != text(getattr(default, k)))
