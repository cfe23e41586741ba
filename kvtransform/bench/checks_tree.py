"""Numerics of the prefix-tree Triton kernels on the benchmark device (``tree-attn``/``tree-layer``
``kernel_check=true``, and ``tools/prefix_tree_gpu_check.py``): forward and backward of
``kvtransform.kernels.prefix_tree`` against a float64 reference (node by node), bf16 and fp16, on trees of depth 1-7
with odd node lengths (1, 15, 17, 97, 1025), GQA 32/8 at D=128, GQA 4 at D=80, MHA at D=64, GQA 7 at D=256, GQA 4 at
D=128 under six separate ancestor ranges (Tree
Training, arXiv 2511.00413; the kernels generalise DualKV's, arXiv 2605.15422).

Rule (``docs/ARCHITECTURE.md``): kernel max error <= 2 x PyTorch's own error in that dtype (the reference with its
matmuls in the dtype) + floor (bf16 2e-3, fp16 5e-4). The backward run twice must be bitwise equal; the registered op
(autograd) must give the kernels' bits. Prints a markdown table; returns ``(ok, worst error / bound)``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .checks import _verdict, check_row
from .tree_shapes import agentic_tree

__all__ = ["FLOOR", "tree_cases", "check_tree_case", "check_prefix_tree_kernels", "check_row"]

FLOOR = {torch.bfloat16: 2e-3, torch.float16: 5e-4}


def tree_cases(device) -> list:
    """``[(name, layout, H, H_kv, D)]``: the checked trees on ``device``."""
    from kvtransform.tree_layout import PrefixTreeLayout

    return [
        ("agentic-small", agentic_tree(1025, (2, 2), [97, 1025, 17], 1, device=device), 32, 8, 128),
        ("odd-2trees", agentic_tree(97, (2, 1, 2), [1, 15, 17, 97], 2, trees=2, device=device), 8, 2, 80),
        ("chain+roots", PrefixTreeLayout.from_parents([1025, 17, 1, 97, 15, 1], [-1, 0, 1, 2, -1, -1], device=device),
         4, 4, 64),
        ("dualkv-shape", agentic_tree(1025, (3,), [513, 1, 17], 3, device=device), 7, 1, 256),
        # a leaf under six separate ancestor ranges (a side branch packed between each level and the next): the
        # kernels' walk past the four ranges they address from the loop counter
        ("deep-side-branches", PrefixTreeLayout.from_parents(
            [1025, 17, 130, 1, 256, 64, 257, 3, 1, 15, 300, 33, 97],
            [-1, 0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10], device=device), 8, 2, 128),
    ]


def check_tree_case(name: str, lay, h: int, h_kv: int, d: int, dtype, device, variants: Optional[dict] = None) -> tuple:
    """One tree in one dtype: ``(ok, worst error / bound)``; prints its table row. ``variants``: ``window`` /
    ``softcap`` / ``sinks`` (``True``: random per-head sink logits, checked with their gradient ``dsinks``), as the
    kernels take them (``kernels/attention_tiles.py``)."""
    import kvtransform as kvt
    from kvtransform.kernels import prefix_tree as K

    t = lay.total_tokens
    scale = d ** -0.5
    q, k, v, do = (torch.randn(t, hh, d, device=device, dtype=dtype) for hh in (h, h_kv, h_kv, h))
    var = {k_: v_ for k_, v_ in (variants or {}).items() if v_ is not None and v_ is not False}
    if var.get("sinks") is not None:
        var["sinks"] = torch.randn(h, device=device) * 2
    f64 = [x.double() for x in (q, k, v, do)]
    var64 = {**var, "sinks": var["sinks"].double()} if "sinks" in var else var
    with torch.no_grad():
        ref_out, ref_lse = K.prefix_tree_attention_reference(*f64[:3], lay, scale, **var64)
        ref_grads = K.prefix_tree_attention_reference_backward(f64[3], None, *f64[:3], lay, scale, **var64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    if "sinks" in var:
        leaves.append(var["sinks"].clone().requires_grad_(True))
    pt_out, pt_lse = K.prefix_tree_attention_reference(*leaves[:3], lay, scale, upcast=False,
                                                       **{**var, **({"sinks": leaves[3]} if "sinks" in var else {})})
    pt_grads = torch.autograd.grad(pt_out, leaves, do)
    del leaves
    out, lse = K.prefix_tree_fwd(q, k, v, lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges, scale, **var)
    bargs = (lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges, lay.query_range_ptr, lay.query_ranges, scale)
    grads = K.prefix_tree_bwd(do, q, k, v, out, lse, *bargs, **var)
    again = K.prefix_tree_bwd(do, q, k, v, out, lse, *bargs, **var)
    ok, worst, cells = True, 0.0, []
    for nm, a, p, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads), (pt_out, pt_lse, *pt_grads),
                           (ref_out, ref_lse, *ref_grads)):
        good, ratio, cell = _verdict(nm, a, p, r, FLOOR[dtype])
        ok, worst = ok and good, max(worst, ratio if ratio == ratio else float("inf"))
        cells.append(cell.rsplit(" | ", 1)[0].replace(" | ", " ", 1).replace(" | ", "/"))
    det = all(torch.equal(a, b) for a, b in zip(grads, again))
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))  # the registered op through autograd
    op_out = kvt.prefix_tree_attention(qq, kk, vv, lay, softmax_scale=scale, **var)
    op_grads = torch.autograd.grad(op_out, (qq, kk, vv), do)
    same = torch.equal(op_out, out) and all(torch.equal(a, b) for a, b in zip(op_grads, grads[:3]))
    ok = ok and det and same
    tag = "".join(f" {k_}={v_ if k_ != 'sinks' else 'yes'}" for k_, v_ in sorted(var.items()))
    print(f"| {name}{tag} | T={t} depth={lay.depth} | {h}/{h_kv} | {d} | {str(dtype)[6:]} | {' · '.join(cells)} | "
          f"{worst:.3f} | {det} | {same} | {'ok' if ok else 'FAIL'} |", flush=True)
    return ok, worst


def check_prefix_tree_kernels(device, cases: Optional[Sequence] = None,
                              dtypes: Sequence = (torch.bfloat16, torch.float16),
                              variants: Optional[dict] = None) -> tuple:
    """The checks of the module docstring on :func:`tree_cases` (``cases``: indices into them, or explicit
    ``(name, layout, H, H_kv, D)`` tuples), with the attention ``variants`` of :func:`check_tree_case`. Returns
    ``(ok, worst error / bound)``."""
    device = torch.device(device)
    every = tree_cases(device)
    chosen = every if cases is None else [every[c] if isinstance(c, int) else c for c in cases]
    print("## Prefix-tree kernels vs float64 reference (bound = 2 x torch error in the dtype + floor bf16 2e-3 / "
          "fp16 5e-4)")
    print("| tree | tokens | H/H_kv | D | dtype | kernel err / torch err / bound per tensor | worst err/bound | "
          "deterministic bwd | op == kernel | ok |\n|---|---|---|---|---|---|---|---|---|---|")
    ok, worst = True, 0.0
    for dtype in dtypes:
        for name, lay, h, h_kv, d in chosen:
            good, w = check_tree_case(name, lay, h, h_kv, d, dtype, device, variants)
            ok, worst = ok and good, max(worst, w)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("prefix-tree kernel checks:", "PASS" if ok else "FAIL", flush=True)
    return ok, worst
