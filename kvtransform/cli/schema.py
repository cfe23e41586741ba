"""Structured configs of ``kvtransform optimize`` (Hydra's ConfigStore): a misspelt key is an error, not a new key.

:class:`OptimizeConfig` composes :class:`ModelConfig` and one transform dataclass of :mod:`kvtransform.config`
(group ``transform``); ``conf/config.yaml`` and ``conf/<group>/*.yaml`` give the defaults.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List

from omegaconf import MISSING, OmegaConf

from ..config import CONFIG_TYPES

__all__ = ["EMIT_KINDS", "ModelConfig", "OptimizeConfig", "register_configs"]

EMIT_KINDS = ("pt2", "onnx")  # values of OptimizeConfig.emit


@dataclass
class ModelConfig:
    """Which model ``optimize`` loads (arguments of :func:`kvtransform.models.load_model`).

    Attributes:
        name: registry name (``smollm2-135m``), local HF directory, ``.gguf`` file or a cached hub id.
        dtype: ``float32`` | ``bfloat16`` | ``float16`` | ``auto``.
        attn_implementation: ``sdpa`` | ``eager``.
    """

    name: str = "smollm2-135m"
    dtype: str = "float32"
    attn_implementation: str = "sdpa"


@dataclass
class OptimizeConfig:
    """Top-level config of ``kvtransform optimize``.

    Attributes:
        model: the model to load.
        transform: one of the transform configs (group ``transform``: canonical, dualkv, specontext).
        out: output directory of the artifact.
        overwrite: replace ``out`` when it exists and is not empty.
        emit: what to write into ``out``: ``pt2`` (the artifact directory: ``model.pt2``, config, report) and/or
            ``onnx`` (``model.onnx``, opset 23, checked in onnxruntime; :meth:`OptimizedModule.export_onnx`).
        threads: torch CPU threads, ``auto`` (1 on a CPU-only machine of at most 4 cores unless OMP_NUM_THREADS is
            set: the verification gates ran 4-6x slower with more threads on a shared 2-core CPU, README) or N.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    transform: Any = MISSING
    out: str = "outputs/${kvt_slug:${model.name}}-${transform.name}"
    overwrite: bool = False
    emit: List[str] = field(default_factory=lambda: ["pt2"])
    threads: Any = "auto"


def _slug(name: str) -> str:
    """``outputs/<slug>-<transform>``: a registry name as is, a path by its last component without ``.gguf``."""
    base = Path(str(name).rstrip("/")).name or "model"
    if base.lower().endswith(".gguf"):
        base = base[: -len(".gguf")]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base)


def register_configs() -> None:
    """Register the structured configs in Hydra's ConfigStore and the ``kvt_slug`` resolver (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="kvt_optimize_schema", node=OptimizeConfig)
    cs.store(name="kvt_model_schema", node=ModelConfig)
    for name, cls in CONFIG_TYPES.items():
        cs.store(name=f"kvt_transform_{name}", node=cls)
    from ..distill import DistillConfig
    from ..eval_sparse import EvalSparseConfig

    cs.store(name="kvt_eval_sparse_schema", node=EvalSparseConfig)
    cs.store(name="kvt_distill_schema", node=DistillConfig)
    from ..runtime.memory import PlanMemoryConfig

    cs.store(name="kvt_plan_memory_schema", node=PlanMemoryConfig)
    from ..rollout_mismatch import RolloutMismatchConfig

    cs.store(name="kvt_rollout_mismatch_schema", node=RolloutMismatchConfig)
    if not OmegaConf.has_resolver("kvt_slug"):
        OmegaConf.register_new_resolver("kvt_slug", _slug)


register_configs()
