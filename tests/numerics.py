"""The numerics rule for kernel-level tests (``docs/ARCHITECTURE.md``, flash-attention's rule): a kernel's max error
against a float64 reference is at most 2 × PyTorch's own error in the same dtype plus a floor.

The floor has two parts: a small absolute one, and half an ulp of the tensor's largest value (``eps / 2 ·
max|ref|``). The second matters in fp16: the result is stored in fp16 (half an ulp of rounding where the values are
largest), and the FlashAttention backward rounds where PyTorch's reference does not (``Delta = rowsum(dO ∘ O)`` from
the stored fp16 ``O``, ``dS`` rounded to fp16 for the ``dS·K`` product), so on a few random draws in a thousand its
largest dQ element is ~1.4 ulp off while PyTorch's happens to be within 0.6 ulp everywhere. In fp32 the second part
is ~6e-8 · max|ref|, far below the absolute floor.
"""
import torch

FLOOR = {torch.float32: 2e-5, torch.float16: 2e-4}


def maxerr(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def check_rule(name: str, got, pt, ref, dtype) -> tuple:
    """Assert ``maxerr(got, ref) <= 2 * maxerr(pt, ref) + floor`` (``pt``: PyTorch's result in ``dtype``; ``ref``:
    float64). Returns ``(our error, PyTorch's error)``."""
    e_got, e_pt = maxerr(got, ref), maxerr(pt, ref)
    floor = FLOOR[dtype] + torch.finfo(dtype).eps / 2 * ref.abs().max().item()
    bound = 2 * e_pt + floor
    assert e_got <= bound, f"{name}: kernel error {e_got:.3g} > 2 x PyTorch error {e_pt:.3g} + floor {floor:.3g}"
    return e_got, e_pt
