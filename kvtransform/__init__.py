"""kvtransform: compiler passes that rewrite attention in Hugging Face causal LMs into DualKV and SpeContext kernels.

Public API::

    import kvtransform as kvt
    model, tok = kvt.load_model("smollm2-135m")
    opt = kvt.transform(model, "canonical")      # or "dualkv", "specontext", or a config dataclass
    opt.report; opt.save("out/"); opt2 = kvt.load("out/")

Architecture and where things live: ``docs/ARCHITECTURE.md``.
"""
from __future__ import annotations

import importlib

from . import ops  # noqa: F401  registers torch.ops.kvt.*
from .api import inspect, load, transform  # noqa: F401
from .config import CanonicalConfig, DualKVConfig, RuntimeConfig, SpeContextConfig, TransformConfig, VerifyConfig  # noqa: F401
from .report import Report  # noqa: F401
from .transforms import register_transform  # noqa: F401
from .transforms.base import OptimizedModule  # noqa: F401

__version__ = "0.1.0"

# Names resolved on first use (keeps `import kvtransform` light): name -> module that defines it.
_LAZY = {
    "load_model": "kvtransform.models",
    "tiny_model": "kvtransform.models",
    "DualKVLayout": "kvtransform.layout",
    "pack_shared_prefix": "kvtransform.packing",
    "pack_shared_prefix_groups": "kvtransform.packing",
    "PackedBatch": "kvtransform.packing",
    "DualKVModule": "kvtransform.transforms.dualkv",
    "attention": "kvtransform.ops.attention",
    "dualkv_attention": "kvtransform.ops.dualkv",
    "retrieval_topk": "kvtransform.ops.sparse_decode",
    "sparse_decode_attention": "kvtransform.ops.sparse_decode",
    "VerificationError": "kvtransform.verify",
    "balance_groups": "kvtransform.balance",
    "GroupBalance": "kvtransform.balance",
    "shard_dualkv": "kvtransform.distributed",
    "compile_backend": "kvtransform.compile",
    "pack_trajectories": "kvtransform.tree_packing",
    "TreeBatch": "kvtransform.tree_packing",
    "PrefixTreeLayout": "kvtransform.tree_layout",
    "prefix_tree_attention": "kvtransform.ops.prefix_tree",
}
_LAZY_MODULES = ("integrations", "onnx_export", "compile")  # kvt.integrations.transformers.enable(...), ...


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"kvtransform.{name}")
    raise AttributeError(f"module 'kvtransform' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY) + list(_LAZY_MODULES))
