"""kvtransform: compiler passes that rewrite attention in Hugging Face causal LMs into DualKV and SpeContext kernels.

Public API (DESIGN.md §2)::

    import kvtransform as kvt
    model, tok = kvt.load_model("smollm2-135m")
    opt = kvt.transform(model, "canonical")      # or "dualkv", "specontext", or a config dataclass
    opt.report; opt.save("out/"); opt2 = kvt.load("out/")
"""
from __future__ import annotations

from . import ops  # noqa: F401  registers torch.ops.kvt.*
from .config import CanonicalConfig, DualKVConfig, SpeContextConfig, VerifyConfig  # noqa: F401

__version__ = "0.1.0"
