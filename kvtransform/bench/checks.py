"""bf16 correctness checks of the Triton kernels on the benchmark device, run before timing (suite option
``kernel_check=true``): the kernels against fp64 references, with the numerics rule of the test suite — kernel max
error <= 2 x PyTorch's own bf16 error + 2e-3.

* DualKV (arXiv 2605.15422, §2–3): forward and backward against an fp64 reference computed on the *replicated*
  layout (each response its own sequence prefix + response, prefix gradients summed over the copies); prefixes up
  to 8K, head_dim 64/80/128/256, GQA 1/4/7; the backward run twice must be bitwise equal, and the registered op must
  give the kernel's bits.
* SpeContext decode (arXiv 2512.00722, §4.3): retrieval scores and top-k, and sparse decode in gather and slot
  mode, odd shapes, GQA 1/4/7, head_dim 64/80/128.

Each check prints a markdown table and returns ``(ok, worst)``: ``worst`` = max over tensors of kernel error / bound.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["replicated_reference_fp64", "check_dualkv_kernels", "check_decode_kernels", "check_row"]

# (groups [(P, [R_i])], H, H_kv, D)
DUALKV_CASES = [
    ([(8192, [1500, 17, 300]), (1025, [97, 1])], 4, 1, 128),
    ([(4096, [2048, 131]), (97, [16, 15, 1])], 8, 2, 128),
    ([(2049, [1025, 17]), (15, [1])], 7, 1, 64),
    ([(1025, [97, 300])], 4, 4, 80),
    ([(1025, [513, 1]), (16, [17])], 4, 1, 256),
]
# (batch, H_kv, G, S_max, D, budget B, with a new token)
DECODE_CASES = [
    (3, 2, 1, 1, 64, 1, True), (3, 2, 4, 17, 80, 8, True), (2, 1, 7, 1025, 128, 300, False),
    (2, 2, 4, 1025, 128, 1100, True), (4, 8, 4, 4096, 128, 2048, True), (2, 3, 7, 513, 64, 64, True),
]


def check_row(method: str, what: str, result: tuple, pass_: str = "check") -> dict:
    """The CSV row of one check: ``pass=check``, status ``ok`` or ``FAIL``, ``check_rel_err`` = worst error/bound."""
    ok, worst = result
    return dict(method=method, impl=f"bf16 vs fp64, {what}", **{"pass": pass_}, status="ok" if ok else "FAIL",
                check_rel_err=worst, iters=0)


def replicated_reference_fp64(q, k, v, do, layout, scale):
    """fp64 ``(out, lse, dq, dk, dv)`` of DualKV attention via the replicated layout, one sequence (prefix +
    response) at a time, explicit formulas (no autograd graph kept). Prefix rows of out/lse/dq from the first copy;
    prefix dK/dV summed over the copies. q ``(T, H, D)``, k/v ``(T, H_kv, D)``, do ``(T, H, D)``; lse ``(H, T)``.
    Every group of ``layout`` must have a response (a group without one is not in the replicated layout)."""
    if any(not rs for rs in layout.response_lens):
        raise ValueError("replicated_reference_fp64: every group needs at least one response")
    t, h, d = q.shape
    grp = h // k.shape[1]
    f = torch.float64
    dev = q.device
    out = torch.zeros(t, h, d, dtype=f, device=dev)
    lse = torch.zeros(h, t, dtype=f, device=dev)
    dq = torch.zeros(t, h, d, dtype=f, device=dev)
    dk = torch.zeros(k.shape, dtype=f, device=dev)
    dv = torch.zeros(v.shape, dtype=f, device=dev)
    rep = layout.replicated_index().to(dev)
    cu = [int(x) for x in layout.replicated_cu_seqlens().tolist()]
    seen = torch.zeros(t, dtype=torch.bool, device=dev)
    for a, b in zip(cu[:-1], cu[1:]):
        ix = rep[a:b]
        keep = ~seen[ix]  # a prefix row's output exists once: only its first copy carries dO
        seen[ix] = True
        qs = q[ix].to(f).transpose(0, 1)
        ks = k[ix].to(f).transpose(0, 1).repeat_interleave(grp, 0)
        vs = v[ix].to(f).transpose(0, 1).repeat_interleave(grp, 0)
        dos = do[ix].to(f).transpose(0, 1) * keep[None, :, None]
        n = ix.numel()
        s = (qs @ ks.transpose(-1, -2)) * scale
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        lg = torch.logsumexp(s, -1)
        pm = torch.exp(s - lg[..., None])
        del s
        o = pm @ vs
        delta = (o * dos).sum(-1)
        ds = pm * ((dos @ vs.transpose(-1, -2)) - delta[..., None])
        dqs = (ds @ ks) * scale
        dks = ((ds.transpose(-1, -2) @ qs) * scale).view(-1, grp, n, d).sum(1).transpose(0, 1)
        dvs = (pm.transpose(-1, -2) @ dos).view(-1, grp, n, d).sum(1).transpose(0, 1)
        del ds, pm
        out[ix[keep]] = o.transpose(0, 1)[keep]
        lse[:, ix[keep]] = lg[:, keep]
        dq[ix[keep]] = dqs.transpose(0, 1)[keep]
        dk.index_add_(0, ix, dks)
        dv.index_add_(0, ix, dvs)
    return out, lse, dq, dk, dv


def _verdict(name: str, got, torch_bf16, ref, floor: float = 2e-3) -> tuple:
    """``(ok, err / bound, table cells)`` of one tensor under the numerics rule (bound = 2 x PyTorch's own error in
    the dtype + ``floor``)."""
    eg = (got.double() - ref).abs().max().item()
    ep = (torch_bf16.double() - ref).abs().max().item()
    bound = 2 * ep + floor
    good = eg <= bound and bool(torch.isfinite(got).all())
    return good, eg / bound, f"{name} | {eg:.3e} | {ep:.3e} | {bound:.3e} | {'ok' if good else 'FAIL'}"


def _variants_fp64_reference(K, q, k, v, do, cu, sp, scale, variants: dict) -> tuple:
    """fp64 ``(out, lse, dq, dk, dv, dsinks...)`` of the DualKV reference with the attention variants (the
    segment-by-segment reference, checked against a dense brute force in tests/test_attention_variants_op.py), by
    autograd; and the same in PyTorch's bf16 (``upcast=False``) for the numerics rule's yardstick."""
    out = []
    for up in (True, False):
        leaves = [x.detach().to(torch.float64 if up else x.dtype).requires_grad_(True) for x in (q, k, v)]
        sinks = variants.get("sinks")
        if sinks is not None:
            leaves.append(sinks.detach().to(torch.float64 if up else torch.float32).requires_grad_(True))
        var = dict(variants, sinks=leaves[3] if sinks is not None else None)
        o, lse = K.dualkv_attention_reference(*leaves[:3], cu, sp, scale, upcast=up, **var)
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype))
        out.append((o.detach(), lse.detach(), *grads))
        del o, lse, leaves
    return out[0], out[1]


def check_dualkv_kernels(device, config: Optional[dict] = None, cases: Optional[Sequence[int]] = None,
                         variants: Optional[dict] = None, dtype: torch.dtype = torch.bfloat16) -> tuple:
    """bf16 checks of ``dualkv_fwd``/``dualkv_bwd`` (launch ``config`` as the kernels take it) on
    :data:`DUALKV_CASES` (``cases``: indices, default all); with ``variants`` (``window``/``softcap``/``sinks`` as
    the kernels take them; sinks are redrawn per case with the case's head count) against the fp64 DualKV reference
    with them, dsinks included. ``dtype``: bf16 (fp16 for Triton's CPU interpreter, whose bf16 dots are wrong).
    Returns ``(ok, worst error / bound)``."""
    from kvtransform.kernels import dualkv as K
    from kvtransform.layout import DualKVLayout

    variants = dict(variants or {})
    yardstick = f"reference with {sorted(variants)}" if variants else "replicated reference"
    print(f"## DualKV kernels, bf16 vs fp64 {yardstick} (bound = 2 x torch-bf16 error + 2e-3; launch config "
          f"{config or 'default'})")
    print("| layout | H/H_kv | D | tensor | kernel err | torch-bf16 err | bound | ok |\n|---|---|---|---|---|---|---|---|")
    ok, worst, dt = True, 0.0, dtype
    for ci, (groups, h, h_kv, d) in enumerate(DUALKV_CASES):
        if cases is not None and ci not in cases:
            continue
        lay = DualKVLayout.from_lengths(groups, device=device)
        t = lay.total_tokens
        q, do = (torch.randn(t, h, d, device=device, dtype=dt) for _ in range(2))
        k, v = (torch.randn(t, h_kv, d, device=device, dtype=dt) for _ in range(2))
        scale = d ** -0.5
        cu, sp = lay.cu_seqlens, lay.segment_prefix
        var = dict(variants)
        if var.get("sinks") is not None:
            var["sinks"] = torch.randn(h, device=device) * 2
        if var:
            ref, pt = _variants_fp64_reference(K, q, k, v, do, cu, sp, scale, var)
        else:
            ref = replicated_reference_fp64(q, k, v, do, lay, scale)
            qp, kp, vp = (x.clone().requires_grad_(True) for x in (q, k, v))
            po, pl = K.dualkv_attention_reference(qp, kp, vp, cu, sp, scale, upcast=False)
            pt = (po.detach(), pl.detach(), *torch.autograd.grad(po, (qp, kp, vp), do))
            del po, pl, qp, kp, vp
        out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale, config=config, **var)
        got = (out, lse, *K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale, config=config, **var))
        again = K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale, config=config, **var)
        det = all(torch.equal(a, b) for a, b in zip(got[2:], again))
        oo, ll = torch.ops.kvt.dualkv_attention(q, k, v, cu, sp, scale, var.get("window"), var.get("softcap"),
                                                var.get("sinks"))  # the registered op gives the same bits
        same = torch.equal(oo, out) and torch.equal(ll, lse)
        name = "+".join(f"{p}x{len(r)}" for p, r in groups)
        for tn, g, p_, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, pt, ref):
            good, ratio, cells = _verdict(tn, g, p_, r)
            ok, worst = ok and good, max(worst, ratio)
            print(f"| {name} | {h}/{h_kv} | {d} | {cells} |")
        print(f"| {name} | {h}/{h_kv} | {d} | deterministic bwd x2 | {det} | | | {'ok' if det else 'FAIL'} |")
        print(f"| {name} | {h}/{h_kv} | {d} | op == kernel | {same} | | | {'ok' if same else 'FAIL'} |")
        ok = ok and det and same
        del ref, pt, got, again
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("DualKV kernel checks:", "PASS" if ok else "FAIL", flush=True)
    return ok, worst


def check_decode_kernels(device, cases: Optional[Sequence[int]] = None) -> tuple:
    """bf16 checks of retrieval scoring / top-k and sparse decode (gather and slot mode) on :data:`DECODE_CASES`
    (``cases``: indices, default all). Returns ``(ok, worst error / bound)``."""
    from kvtransform.kernels.retrieval import retrieval_scores_reference, retrieval_scores_triton
    from kvtransform.kernels.sparse_decode import sparse_decode_reference
    from kvtransform.ops.sparse_decode import retrieval_topk, sparse_decode_attention

    print("## SpeContext decode kernels, bf16 vs fp64 reference (bound = 2 x torch-bf16 error + 2e-3)")
    print("| b | H_kv | G | S | D | B | new | mode | kernel err | torch-bf16 err | bound | retrieval | ok |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok, worst, dt = True, 0.0, torch.bfloat16
    d64 = lambda t: None if t is None else t.double()  # noqa: E731
    for ci, (bsz, h_kv, g, s_max, d, budget, new) in enumerate(DECODE_CASES):
        if cases is not None and ci not in cases:
            continue
        q = torch.randn(bsz, h_kv * g, d, device=device, dtype=dt)
        k, v = (torch.randn(bsz, h_kv, s_max, d, device=device, dtype=dt) for _ in range(2))
        kn, vn = ((torch.randn(bsz, h_kv, d, device=device, dtype=dt) if new else None) for _ in range(2))
        lens = torch.randint(1, s_max + 1, (bsz,), device=device)
        lens[0] = s_max
        lens = lens.to(torch.int32)
        sc = retrieval_scores_triton(q, k, lens, d ** -0.5)  # retrieval on the same keys: scores vs fp64
        rs = retrieval_scores_reference(q, k, lens, d ** -0.5)
        fin = torch.isfinite(rs)
        r_err = (sc.double() - rs)[fin].abs().max().item()
        idx = retrieval_topk(q, k, lens, budget)
        r_ok = torch.equal(torch.isfinite(sc), fin) and r_err < 5e-2 and \
            bool(((idx >= 0).sum(-1) == lens.clamp(max=budget)[:, None]).all())
        for mode in ("gather", "slots"):
            if mode == "slots":
                safe = idx.clamp(min=0).long()[..., None].expand(-1, -1, -1, d)
                ii, kk, vv, ll = None, torch.gather(k, 2, safe), torch.gather(v, 2, safe), lens.clamp(max=budget)
            else:
                ii, kk, vv, ll = idx, k, v, lens
            out = sparse_decode_attention(q, kk, vv, ii, ll, kn, vn, validate=True)
            ref = sparse_decode_reference(q.double(), kk.double(), vv.double(), ii, ll, d64(kn), d64(vn))
            tref = sparse_decode_reference(q, kk, vv, ii, ll, kn, vn, dtype=torch.bfloat16)
            good, ratio, cells = _verdict(mode, out, tref, ref)
            good = good and r_ok
            ok, worst = ok and good, max(worst, ratio)
            cells = cells.rsplit(" | ", 1)[0]
            print(f"| {bsz} | {h_kv} | {g} | {s_max} | {d} | {budget} | {new} | {cells} | {r_err:.1e} "
                  f"{'ok' if r_ok else 'FAIL'} | {'ok' if good else 'FAIL'} |")
    print("decode kernel checks:", "PASS" if ok else "FAIL", flush=True)
    return ok, worst
