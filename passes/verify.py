"""Verification gate: run the original and the rewritten module on the same real inputs; refuse beyond tolerance.

Inputs are tokenised text shipped with the package (``kvtransform/data/prompts.txt``) at several lengths, as one
unpadded row and left-padded rows (so the attention mask's padding path is exercised); without a tokenizer, random
token ids. Logits are compared on real (non-padding) positions only: what a padded position computes is undefined.
"""
from __future__ import annotations

from importlib import resources
from typing import Callable, Optional

import torch

from kvtransform.config import VerifyConfig
from kvtransform.report import Verification


class VerificationError(RuntimeError):
    """The rewritten module differs from the original beyond tolerance; nothing was written."""


DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def sample_text() -> str:
    """The real text shipped with the package (several short prompts, one per line)."""
    return resources.files("kvtransform").joinpath("data/prompts.txt").read_text(encoding="utf-8")


def text_token_ids(tokenizer, vocab_size: int, n: int, offset: int = 0, generator=None) -> torch.Tensor:
    """``n`` token ids (int64) of the shipped text, starting ``offset`` tokens in (wrapping); random ids when
    ``tokenizer`` is None."""
    if tokenizer is None:
        return torch.randint(0, vocab_size, (n,), generator=generator)
    ids = tokenizer(sample_text(), add_special_tokens=False)["input_ids"]
    ids = [i for i in ids if i < vocab_size]
    reps = (offset + n) // max(len(ids), 1) + 1
    return torch.tensor((ids * reps)[offset:offset + n], dtype=torch.long)


def verification_cases(cfg: VerifyConfig, tokenizer, vocab_size: int, device) -> list[tuple[str, torch.Tensor,
                                                                                               torch.Tensor]]:
    """``[(name, input_ids (B, S), attention_mask (B, S))]`` for each configured length."""
    gen = torch.Generator().manual_seed(cfg.seed)
    cases = []
    for s in cfg.lengths:
        s = int(s)
        if s < 2:
            raise ValueError(f"verify.lengths must be >= 2 tokens, got {s}")
        rows = [text_token_ids(tokenizer, vocab_size, s, offset=17 * r, generator=gen) for r in range(cfg.batch_size)]
        ids = torch.stack(rows)
        am = torch.ones_like(ids)
        cases.append((f"len{s}", ids.to(device), am.to(device)))
        if cfg.padding and cfg.batch_size > 1:
            am = torch.ones_like(ids)
            for r in range(1, cfg.batch_size):
                pad = max(1, (s * r) // (2 * cfg.batch_size))
                am[r, :pad] = 0
            cases.append((f"len{s}-leftpad", ids.to(device), am.to(device)))
    return cases


@torch.no_grad()
def verify(original: Callable, rewritten: Callable, cases, tolerance: float) -> Verification:
    """Compare ``original(ids, am)`` and ``rewritten(ids, am)`` logits on real positions of every case.

    Returns a :class:`~kvtransform.report.Verification`; ``passed`` is False when ``max_rel_error`` (max abs error
    over max abs reference) exceeds ``tolerance`` or anything is NaN. Does not raise: :func:`check` does.
    """
    v = Verification(max_abs_error=0.0, max_rel_error=0.0, tolerance=float(tolerance), passed=True)
    for name, ids, am in cases:
        ref = original(ids, am).float()
        out = rewritten(ids, am).float()
        keep = am.bool()
        diff = (ref - out)[keep].abs()
        abs_err = float(diff.max()) if diff.numel() else 0.0
        if torch.isnan(out[keep]).any() or torch.isnan(ref[keep]).any():
            abs_err = float("nan")
        scale = float(ref[keep].abs().max()) if keep.any() else 1.0
        rel_err = abs_err / max(scale, 1e-30)
        v.cases.append({"name": name, "shape": list(ids.shape), "max_abs_error": abs_err, "max_rel_error": rel_err})
        v.max_abs_error = max(v.max_abs_error, abs_err) if abs_err == abs_err else float("nan")
        v.max_rel_error = max(v.max_rel_error, rel_err) if rel_err == rel_err else float("nan")
    v.passed = bool(v.max_rel_error == v.max_rel_error and v.max_rel_error <= tolerance)
    return v


def check(v: Verification) -> None:
    """Raise :class:`VerificationError` if ``v`` did not pass."""
    if v.passed is False:
        worst = max(v.cases, key=lambda c: (c["max_rel_error"] != c["max_rel_error"], c["max_rel_error"]))
        raise VerificationError(
            f"verification failed: max_rel_error={v.max_rel_error:.3g} > tolerance={v.tolerance:.3g} "
            f"(worst case {worst['name']}, shape {worst['shape']}). Nothing was written. If the difference is "
            f"expected for this dtype, raise transform.verify.tolerance; otherwise report the model and config.")


def default_tolerance(dtype: torch.dtype, configured: Optional[float]) -> float:
    return float(configured) if configured is not None else DEFAULT_TOLERANCE.get(dtype, 2e-2)
