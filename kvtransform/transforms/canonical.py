"""The canonical transform: every standard attention becomes ``kvt.attention(q, k, v, ..., softmax_scale, causal)``
on the un-repeated K/V; verified against the original model on real text.

The smallest transform, and the one to copy for a new one: a config type (``CanonicalConfig``), a capture function, a
list of passes, a module class, a verification gate (``docs/ARCHITECTURE.md``).
"""
from __future__ import annotations

import warnings

from kvtransform.capture import capture
from kvtransform.config import CanonicalConfig
from kvtransform.model_features import training_dropout
from kvtransform.passes.attention import AttentionPass
from kvtransform.passes.cleanup import CleanupPass
from kvtransform.verify import verify_logits

from . import register_transform
from .base import Logits, OptimizedModule, capture_and_rewrite, new_report


@register_transform(CanonicalConfig, module_type=OptimizedModule)
def canonical_transform(model, cfg: CanonicalConfig, tokenizer=None, progress: bool = True) -> OptimizedModule:
    """Capture ``model`` (:func:`kvtransform.capture.capture`), rewrite every attention into ``kvt.attention``,
    remove the dead mask construction, and verify the logits against the original model.

    Raises:
        ValueError: not a decoder-only causal LM, or no attention rewritten (the message names each skipped site's
            reason).
        kvtransform.verify.VerificationError: the rewritten module differs beyond tolerance.
    """
    report = new_report(model, cfg)
    gm, ctx, cap = capture_and_rewrite(model, capture, [AttentionPass, CleanupPass], report, progress)
    rec = report.pass_record("attention")
    if rec.rewritten == 0:  # a module that only re-runs the model would claim a rewrite that did not happen
        reasons = "; ".join(sorted({f"site {s['site']}: {s['reason']}" for s in rec.skipped})) or \
            "no attention found (no q·kᵀ → softmax → ·v chain or SDPA call the matcher recognises)"
        raise ValueError(f"the canonical transform rewrote no attention of {type(model).__name__}: {reasons}; "
                         f"kvt.inspect(model) shows what each layer computes")
    dropout = training_dropout(model) if model.training else None
    if dropout is not None:  # (DualKV, built for training, refuses such a model: refuse_training_dropout)
        note = (f"model in train mode with dropout {dropout[1]} ({dropout[0]}): the program applies no dropout "
                f"(captured and verified in eval semantics)")
        rec.notes.append(note)
        warnings.warn(f"{note}; call model.eval() before kvt.transform to silence this", stacklevel=3)
    opt = OptimizedModule(Logits(gm), cfg, report, max_seq_len=cap.max_seq_len)
    opt.link_source(model)
    verify_logits(model, opt, cfg, tokenizer, report, progress)
    return opt
