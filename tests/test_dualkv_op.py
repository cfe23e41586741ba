"""kvt::dualkv_attention (DualKV, arXiv 2605.15422): Triton kernels under TRITON_INTERPRET=1 against an fp64 reference computed on the
*replicated* layout (each response as its own sequence prompt+response; prefix K/V gradients summed over the copies).

Numerics rule (flash-attention's, ``docs/ARCHITECTURE.md``): max error of out, LSE, dQ, dK, dV ≤ 2 × PyTorch's own error in the same dtype
(``dualkv_attention_reference(upcast=False)``) + a floor (``tests/numerics.py``).
"""
import pytest
import torch
from numerics import check_rule, maxerr

import kvtransform  # noqa: F401  registers torch.ops.kvt.*
from kvtransform.kernels import dualkv as K
from kvtransform.kernels import dualkv_reference as R
from kvtransform.layout import DualKVLayout
from kvtransform.ops import dualkv as dualkv_ops
from kvtransform.ops.dualkv import dualkv_attention



def replicated_reference(q, k, v, layout: DualKVLayout, scale):
    """fp64 DualKV attention through the replicated layout: every response becomes the sequence prefix+response,
    plain causal attention per sequence, GQA by repeating heads. Prefix rows are read from the first copy (all copies
    are equal); groups without responses run their prefix alone. Differentiable: the gradient of a prefix key/value is
    the sum over its copies."""
    q, k, v = q.double(), k.double(), v.double()
    grp = q.shape[1] // k.shape[1]
    idx = layout.replicated_index()
    rcu = layout.replicated_cu_seqlens().tolist()
    qr, kr, vr = q[idx], k[idx], v[idx]
    outs, lses = [], []

    def causal(qs, ks, vs):
        qs, ks, vs = qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)
        ks, vs = ks.repeat_interleave(grp, 0), vs.repeat_interleave(grp, 0)
        n = qs.shape[1]
        s = qs @ ks.transpose(-1, -2) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        return (torch.softmax(s, -1) @ vs).transpose(0, 1), lse

    seq, off = 0, 0
    for p, rs in zip(layout.prefix_lens, layout.response_lens):
        if not rs:
            o, l = causal(q[off:off + p], k[off:off + p], v[off:off + p])
            outs.append(o), lses.append(l)
            off += p
            continue
        for i, r in enumerate(rs):
            a, b = rcu[seq], rcu[seq + 1]
            o, l = causal(qr[a:b], kr[a:b], vr[a:b])
            if i == 0:
                outs.append(o[:p]), lses.append(l[:, :p])
            outs.append(o[p:]), lses.append(l[:, p:])
            seq += 1
        off += p + sum(rs)
    return torch.cat(outs), torch.cat(lses, 1)


def make_inputs(layout, h, h_kv, d, dtype):
    t = layout.total_tokens
    q = torch.randn(t, h, d, dtype=dtype)
    k = torch.randn(t, h_kv, d, dtype=dtype)
    v = torch.randn(t, h_kv, d, dtype=dtype)
    return q, k, v




# (groups, H, H_kv, D, dtype): every P, R in {1, 15, 16, 17, 97}, GQA ratios 1, 4, 7, head_dim 64/80/96/128 (+256),
# several groups with different P, a group without responses; a representative subset of the cross product.
CASES = [
    ([(1, [1])], 2, 2, 64, torch.float32),
    ([(15, [16, 17])], 4, 1, 80, torch.float32),
    ([(16, [1, 15]), (17, [97])], 7, 1, 96, torch.float32),
    ([(97, [15, 16, 1]), (1, [17])], 4, 4, 128, torch.float32),
    ([(17, [1]), (97, [16, 97]), (15, [])], 8, 2, 64, torch.float32),
    ([(16, [17, 16]), (1, [1, 1])], 14, 2, 80, torch.float16),
    ([(97, [97]), (15, [1])], 4, 1, 128, torch.float16),
    ([(15, [16]), (16, [15])], 2, 1, 96, torch.float16),
    ([(17, [15, 16])], 2, 2, 256, torch.float32),
]


def _id(c):
    groups, h, hkv, d, dt = c
    return f"{'+'.join(f'{p}x{len(r)}' for p, r in groups)}-H{h}-Hkv{hkv}-D{d}-{str(dt)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_kernels_match_replicated_reference(case):
    groups, h, h_kv, d, dtype = case
    layout = DualKVLayout.from_lengths(groups)
    q, k, v = make_inputs(layout, h, h_kv, d, dtype)
    scale = d ** -0.5
    cu, sp = layout.cu_seqlens, layout.segment_prefix

    # fp64 reference on the replicated layout
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    ref_out, ref_lse = replicated_reference(qd, kd, vd, layout, scale)
    do = torch.randn(q.shape, dtype=dtype)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), do.double())

    # PyTorch's own error in this dtype (matmuls in the input dtype, softmax in fp32)
    qp, kp, vp = (x.clone().requires_grad_(True) for x in (q, k, v))
    pt_out, pt_lse = K.dualkv_attention_reference(qp, kp, vp, cu, sp, scale, upcast=False)
    pt_grads = torch.autograd.grad(pt_out, (qp, kp, vp), do)

    out, lse = K.dualkv_fwd(q, k, v, cu, sp, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (h, layout.total_tokens)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_rule("out", out, pt_out, ref_out, dtype)
    check_rule("lse", lse, pt_lse, ref_lse, dtype)

    dq, dk, dv = K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale)
    for name, g, pg, rg in zip(("dq", "dk", "dv"), (dq, dk, dv), pt_grads, ref_grads):
        assert g.dtype == dtype and g.shape == rg.shape
        check_rule(name, g, pg, rg, dtype)

    # bitwise deterministic backward
    dq2, dk2, dv2 = K.dualkv_bwd(do, q, k, v, out, lse, cu, sp, scale)
    assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)


GQA2, GQA3, MHA = (4, 2), (6, 2), (3, 3)
# Each launch config with the head layout it most needs (packed GQA rows: a group of 3, so padded rows; the rest
# rotate over GQA 2 / GQA 3 / MHA): the default configs run every head layout in the tests above.
OTHER_CONFIGS = [
    ("blocks32-16", {"fwd": dict(BLOCK_M=32, BLOCK_N=16), "dq": dict(BLOCK_M=32, BLOCK_N=16),
                     "dkdv": dict(BLOCK_M=16, BLOCK_N=32)}, GQA2),
    ("blocks16", {"fwd": dict(BLOCK_M=16, BLOCK_N=16), "dq": dict(BLOCK_M=16, BLOCK_N=16),
                  "dkdv": dict(BLOCK_M=16, BLOCK_N=16)}, MHA),
    ("gqa-packed-16-32", {"fwd": dict(BLOCK_M=16, BLOCK_N=32, PACK=True)}, GQA3),
    ("gqa-packed-16-32-mha", {"fwd": dict(BLOCK_M=16, BLOCK_N=32, PACK=True)}, MHA),
    ("gqa-packed-16", {"fwd": dict(BLOCK_M=16, BLOCK_N=16, PACK=True)}, GQA2),
    ("tma", {"fwd": dict(BLOCK_M=32, BLOCK_N=16, TMA=True)}, GQA3),
    ("tma-packed", {"fwd": dict(BLOCK_M=16, BLOCK_N=32, PACK=True, TMA=True)}, GQA3),
    ("dq-packed-16-32", {"dq": dict(BLOCK_M=16, BLOCK_N=32, PACK=True)}, GQA3),
    ("dq-tma-packed", {"dq": dict(BLOCK_M=16, BLOCK_N=32, PACK=True, TMA=True)}, GQA2),
    ("dq-tma", {"dq": dict(BLOCK_M=32, BLOCK_N=16, TMA=True)}, MHA),
    ("dkdv-tma", {"dkdv": dict(BLOCK_M=16, BLOCK_N=32, TMA=True)}, GQA3),
]


@pytest.mark.parametrize("cfg,heads", [c[1:] for c in OTHER_CONFIGS], ids=[c[0] for c in OTHER_CONFIGS])
def test_kernels_other_launch_configs(cfg, heads):
    layout = DualKVLayout.from_lengths([(17, [15, 1]), (16, [33]), (40, [70, 3])])
    q, k, v = make_inputs(layout, heads[0], heads[1], 64, torch.float32)
    do = torch.randn_like(q)
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    ref_out, ref_lse = replicated_reference(qd, kd, vd, layout, 0.125)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), do.double())
    out, lse = K.dualkv_fwd(q, k, v, layout.cu_seqlens, layout.segment_prefix, 0.125, config=cfg)
    assert maxerr(out, ref_out) < 1e-5 and maxerr(lse, ref_lse) < 1e-5
    if not {"dq", "dkdv"} & set(cfg):  # a forward config: the backward's default launch is tested elsewhere
        return
    grads = K.dualkv_bwd(do, q, k, v, out, lse, layout.cu_seqlens, layout.segment_prefix, 0.125, config=cfg)
    for g, r in zip(grads, ref_grads):
        assert maxerr(g, r) < 5e-5


def test_reference_backward_matches_autograd():
    layout = DualKVLayout.from_lengths([(16, [1, 15]), (17, [9]), (5, [])])
    q, k, v = (x.requires_grad_(True) for x in make_inputs(layout, 4, 2, 64, torch.float64))
    do, dl = torch.randn(q.shape, dtype=torch.float64), torch.randn(4, layout.total_tokens, dtype=torch.float64)
    out, lse = K.dualkv_attention_reference(q, k, v, layout.cu_seqlens, layout.segment_prefix, 0.2)
    ref = torch.autograd.grad((out, lse), (q, k, v), (do, dl))
    got = K.dualkv_attention_reference_backward(do, dl, q.detach(), k.detach(), v.detach(), layout.cu_seqlens,
                                                 layout.segment_prefix, 0.2)
    for g, r in zip(got, ref):
        assert maxerr(g, r) < 1e-12


def test_reference_matches_replicated():
    layout = DualKVLayout.from_lengths([(16, [1, 15]), (17, [97]), (5, [])])
    q, k, v = make_inputs(layout, 4, 2, 64, torch.float64)
    a, la = K.dualkv_attention_reference(q, k, v, layout.cu_seqlens, layout.segment_prefix, 0.3)
    b, lb = replicated_reference(q, k, v, layout, 0.3)
    assert maxerr(a, b) < 1e-12 and maxerr(la, lb) < 1e-12


@pytest.mark.parametrize("use_triton", [False, True], ids=["cpu-reference", "triton-interpreter"])
def test_op_autograd_with_lse_grad(use_triton, monkeypatch):
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", use_triton)
    layout = DualKVLayout.from_lengths([(17, [15, 16]), (15, [1])])
    q, k, v = make_inputs(layout, 4, 2, 64, torch.float32)
    scale = 0.11
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    ref_out, ref_lse = replicated_reference(qd, kd, vd, layout, scale)
    do, dl = torch.randn_like(q), torch.randn(4, layout.total_tokens)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), (qd, kd, vd), (do.double(), dl.double()), retain_graph=True)

    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = dualkv_attention(qq, kk, vv, layout, softmax_scale=scale, return_lse=True)
    assert maxerr(out, ref_out) < 1e-5 and maxerr(lse, ref_lse) < 1e-5
    grads = torch.autograd.grad((out, lse), (qq, kk, vv), (do, dl))
    for g, r in zip(grads, ref_grads):
        assert maxerr(g, r) < 5e-5
    # out only (grad of lse absent)
    out = dualkv_attention(qq, kk, vv, layout.cu_seqlens, layout.segment_prefix, softmax_scale=scale)
    grads = torch.autograd.grad(out, (qq, kk, vv), do)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), do.double())
    for g, r in zip(grads, ref_grads):
        assert maxerr(g, r) < 5e-5


def test_default_scale_and_layout_device_move():
    layout = DualKVLayout.from_lengths([(3, [2])])
    q, k, v = make_inputs(layout, 2, 1, 64, torch.float32)
    a = dualkv_attention(q, k, v, layout)
    b = dualkv_attention(q, k, v, layout, softmax_scale=64 ** -0.5)
    assert torch.equal(a, b)


def test_opcheck():
    layout = DualKVLayout.from_lengths([(5, [3, 2]), (2, [1])])
    q, k, v = (x.requires_grad_(True) for x in make_inputs(layout, 4, 2, 64, torch.float32))
    torch.library.opcheck(torch.ops.kvt.dualkv_attention.default,
                          (q, k, v, layout.cu_seqlens, layout.segment_prefix, 0.125))


def test_torch_export_with_layout_inputs():
    class M(torch.nn.Module):
        def forward(self, q, k, v, cu, sp):
            return torch.ops.kvt.dualkv_attention(q, k, v, cu, sp, 0.125)[0] * 2

    layout = DualKVLayout.from_lengths([(5, [3, 2]), (2, [1])])
    q, k, v = make_inputs(layout, 4, 2, 64, torch.float32)
    args = (q, k, v, layout.cu_seqlens, layout.segment_prefix)
    t = torch.export.Dim("ntok", min=2)
    s = torch.export.Dim("nseg", min=1)
    ep = torch.export.export(M(), args, dynamic_shapes=({0: t}, {0: t}, {0: t}, {0: s + 1}, {0: s}), strict=False)
    assert any(n.target == torch.ops.kvt.dualkv_attention.default for n in ep.graph.nodes)
    lay2 = DualKVLayout.from_lengths([(4, [1, 2, 3])])
    q2, k2, v2 = make_inputs(lay2, 4, 2, 64, torch.float32)
    got = ep.module()(q2, k2, v2, lay2.cu_seqlens, lay2.segment_prefix)
    ref, _ = replicated_reference(q2, k2, v2, lay2, 0.125)
    assert maxerr(got, 2 * ref) < 1e-5


# ------------------------------------------------------------------------------------------------- bad input
def _good():
    layout = DualKVLayout.from_lengths([(3, [2, 1])])
    q, k, v = make_inputs(layout, 4, 2, 64, torch.float32)
    return q, k, v, layout.cu_seqlens.clone(), layout.segment_prefix.clone()


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("mutate, msg", [
    (lambda q, k, v, cu, sp: (q, k, v, _i32([0, 3, 2, 6]), sp), "not monotone"),
    (lambda q, k, v, cu, sp: (q, k, v, _i32([0, 3, 5, 7]), sp), "sum to T"),
    (lambda q, k, v, cu, sp: (q, k, v, _i32([0, 3, 5, 5]), sp), "response of length 0"),
    (lambda q, k, v, cu, sp: (q, k, v, _i32([0, 0, 5, 6]), sp), "prompt .prefix. of length 0"),
    (lambda q, k, v, cu, sp: (q, k, v, _i32([1, 3, 5, 6]), sp), "start at 0"),
    (lambda q, k, v, cu, sp: (q, k, v, cu, _i32([-1, 0, 1])), "directly follow"),
    (lambda q, k, v, cu, sp: (q, k, v, cu.long(), sp), "int32"),
    (lambda q, k, v, cu, sp: (q, k, v, cu[:-1], sp), r"\(S\+1,\)"),
    (lambda q, k, v, cu, sp: (q[..., :0], k[..., :0], v[..., :0], cu, sp), "unsupported head_dim 0"),
    (lambda q, k, v, cu, sp: (torch.randn(6, 4, 264), torch.randn(6, 2, 264), torch.randn(6, 2, 264), cu, sp),
     r"unsupported head_dim 264: supported are 1 to 256"),
    (lambda q, k, v, cu, sp: (q, k.half(), v, cu, sp), "share one dtype"),
    (lambda q, k, v, cu, sp: (q[:, :3], k, v, cu, sp), "divisible"),
    (lambda q, k, v, cu, sp: (q, k, v[:, :1], cu, sp), "same shape"),
    (lambda q, k, v, cu, sp: (q, k, v, cu.to("meta"), sp), "different devices"),
    (lambda q, k, v, cu, sp: (q[0], k, v, cu, sp), "3-D"),
])
def test_bad_inputs(mutate, msg):
    args = mutate(*_good())
    with pytest.raises(ValueError, match=msg):
        dualkv_attention(*args)


def test_float64_runs_the_cpu_reference_and_the_kernels_refuse_it(monkeypatch):
    """float64 CPU tensors (a float64 model under enable()) run the reference, as the prefix-tree op does; the
    kernels (CUDA, or the interpreter) take fp16/bf16/fp32 and say how to get there."""
    layout = DualKVLayout.from_lengths([(7, [5, 3]), (4, [2])])
    q, k, v = make_inputs(layout, 4, 2, 24, torch.float64)
    out = dualkv_attention(q, k, v, layout.cu_seqlens, layout.segment_prefix, softmax_scale=0.3)
    assert maxerr(out, replicated_reference(q, k, v, layout, 0.3)[0]) < 1e-12
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", True)
    with pytest.raises(ValueError, match="unsupported dtype torch.float64: .*cast the model or its inputs"):
        dualkv_attention(q, k, v, layout.cu_seqlens, layout.segment_prefix)


def test_bad_layout_arguments():
    q, k, v, cu, sp = _good()
    with pytest.raises(ValueError, match="segment_prefix is required"):
        dualkv_attention(q, k, v, cu)
    with pytest.raises(ValueError, match="only with a cu_seqlens"):
        dualkv_attention(q, k, v, DualKVLayout(cu, sp), sp)
    with pytest.raises(ValueError, match="cu_seqlens must be an int32 tensor; got list: pass a DualKVLayout"):
        dualkv_attention(q, k, v, cu.tolist(), sp)  # was an AttributeError from the device check
    with pytest.raises(ValueError, match="segment_prefix must be an int32 tensor; got tuple"):
        dualkv_attention(q, k, v, cu, tuple(sp.tolist()))


@pytest.mark.parametrize("d, dtype", [(20, torch.float32), (24, torch.float32), (12, torch.float16), (60, torch.float32),
                                      (1, torch.float32)])
def test_small_and_odd_head_dims(d, dtype, monkeypatch):
    """Head dims that are not multiples of 8 / below 16: the kernels pad to max(16, next power of two) with masks, so
    the wrapper accepts them and they match the fp64 replicated reference (forward and backward, interpreter)."""
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", True)
    layout = DualKVLayout.from_lengths([(17, [15, 1]), (5, [3])])
    q, k, v = make_inputs(layout, 4, 2, d, dtype)
    do = torch.randn(q.shape, dtype=dtype)
    scale = d ** -0.5
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    ref_out, ref_lse = replicated_reference(qd, kd, vd, layout, scale)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), do.double())
    qp, kp, vp = (x.clone().requires_grad_(True) for x in (q, k, v))
    pt_out, pt_lse = K.dualkv_attention_reference(qp, kp, vp, layout.cu_seqlens, layout.segment_prefix, scale,
                                                  upcast=False)
    pt_grads = torch.autograd.grad(pt_out, (qp, kp, vp), do)
    qt, kt, vt = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = dualkv_attention(qt, kt, vt, layout, return_lse=True)  # the wrapper accepts d, runs the kernels
    grads = torch.autograd.grad(out, (qt, kt, vt), do)
    check_rule("out", out, pt_out, ref_out, dtype)
    check_rule("lse", lse, pt_lse, ref_lse, dtype)
    for name, g, pg, rg in zip(("dq", "dk", "dv"), grads, pt_grads, ref_grads):
        check_rule(name, g, pg, rg, dtype)


def test_raw_op_rejects_unsupported_head_dim_on_the_kernel_path(monkeypatch):
    """The transformed graph calls torch.ops.kvt.dualkv_attention directly: its kernel path raises the wrapper's
    ValueError; the reference path and the fake implementation stay permissive."""
    layout = DualKVLayout.from_lengths([(3, [2])])
    q, k, v = make_inputs(layout, 2, 1, 264, torch.float32)
    args = (q, k, v, layout.cu_seqlens, layout.segment_prefix, 0.1)
    out, _ = torch.ops.kvt.dualkv_attention(*args)  # CPU reference: any head_dim
    assert out.shape == q.shape
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", True)  # the CUDA code path, under the interpreter
    with pytest.raises(ValueError, match=r"unsupported head_dim 264: supported are 1 to 256"):
        torch.ops.kvt.dualkv_attention(*args)
    with pytest.raises(ValueError, match="unsupported head_dim 264"):
        torch.ops.kvt.dualkv_attention_backward(q, None, q, k, v, q, torch.zeros(2, 5), layout.cu_seqlens,
                                                layout.segment_prefix, 0.1)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fo, fl = torch.ops.kvt.dualkv_attention(*fargs)
    assert fo.shape == q.shape and fl.shape == (2, 5)


@pytest.mark.parametrize("t, cu, sp", [
    (None, None, None),  # random valid layouts
    (18, [0, 8, 16], [-1, 0]), (16, [-5, 8, 99, 3], [-1, 7, -9]), (20, [0, 10, 5, 12], [-1, 0, 0]),
])
def test_planning_kernels_match_the_torch_tables(t, cu, sp):
    """The Triton planning kernels give exactly the torch tables (bounded offsets, context ranges, heaviest-first
    work order with index tie-break), also for inconsistent layouts and more segments than one chunk."""
    import random
    rng = random.Random(0)
    cases = [(t, cu, sp)]
    if t is None:
        cases = []
        for n_groups in (1, 3, 40):
            lay = DualKVLayout.from_lengths([(rng.randint(1, 60), [rng.randint(1, 40) for _ in range(rng.randint(0, 5))])
                                             for _ in range(n_groups)])
            cases.append((lay.total_tokens, lay.cu_seqlens.tolist(), lay.segment_prefix.tolist()))
    for t_, cu_, sp_ in cases:
        cu_t, sp_t = torch.tensor(cu_, dtype=torch.int32), torch.tensor(sp_, dtype=torch.int32)
        cb, spb = R.bounded_layout(cu_t, sp_t, t_)
        ref = R.segment_tables(cb, spb)
        cub, ctx = K._plan_layout(cu_t, sp_t, t_)
        assert torch.equal(cub, cb)
        for r in range(4):
            assert torch.equal(ctx[r], ref[r])
        for block in (16, 64):
            for sign, lo, hi in ((+1, 0, 1), (-1, 2, 3)):
                ws, wb, w = R.work_table(cb, block, t_, ref[hi] - ref[lo], sign)
                ws2, wb2, w2 = K._plan_work(cub, ctx[lo], ctx[hi], block, t_, sign)
                assert w == w2 and torch.equal(ws, ws2) and torch.equal(wb[ws >= 0], wb2[ws >= 0])


@pytest.mark.parametrize("scale", [0.125, -0.3, 0.0])
def test_forward_any_softmax_scale(scale):
    """The forward folds a positive scale into the exponent after the row max; zero and negative scales take the
    scale-first path. Both match the reference."""
    layout = DualKVLayout.from_lengths([(19, [7, 1]), (5, [9])])
    q, k, v = make_inputs(layout, 4, 2, 32, torch.float32)
    ref_out, ref_lse = K.dualkv_attention_reference(q, k, v, layout.cu_seqlens, layout.segment_prefix, scale)
    out, lse = K.dualkv_fwd(q, k, v, layout.cu_seqlens, layout.segment_prefix, scale)
    assert maxerr(out, ref_out) < 1e-5 and maxerr(lse, ref_lse) < 1e-5


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5", True, torch.tensor([0.1, 0.2])])
def test_wrapper_refuses_a_softmax_scale_that_is_not_a_finite_number(scale):
    """As the prefix-tree wrapper: one line, never an all-NaN output or a string taken as a number."""
    from kvtransform.ops.dualkv import dualkv_attention

    layout = DualKVLayout.from_lengths([(4, [3, 2])])
    q, k, v = make_inputs(layout, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="softmax_scale must be a finite real number") as e:
        dualkv_attention(q, k, v, layout, softmax_scale=scale)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["fwd", "dq"])
def test_default_config_packs_gqa4_only_and_a_given_config_starts_unpacked(monkeypatch, kind):
    """The device default (not the interpreter's): GQA 4 at D=128 in bf16 runs the packed forward / dQ with TMA K/V
    (measured fastest on the H200); other groups, head dims and dtypes keep the unpacked tiles; a user's config
    starts unpacked, without TMA."""
    from kvtransform.kernels import dualkv as K

    monkeypatch.setattr(K, "_interpreting", lambda: False)
    packed = K._cfg(kind, 128, torch.bfloat16, None, 4)
    assert packed["PACK"] and packed["TMA"] and packed["BLOCK_M"] * 4 == 128
    for group, d_pad, dtype in ((1, 128, torch.bfloat16), (8, 128, torch.bfloat16), (4, 64, torch.bfloat16),
                                (4, 128, torch.float32), (4, 128, torch.float16)):
        assert not K._cfg(kind, d_pad, dtype, None, group).get("PACK")
    own = K._cfg(kind, 128, torch.bfloat16, {kind: {"BLOCK_M": 128}}, 4)
    assert own["BLOCK_M"] == 128 and not own.get("PACK") and not own.get("TMA")
    assert K._cfg(kind, 128, torch.bfloat16, {kind: {"BLOCK_M": 32, "PACK": True}}, 4)["PACK"]


def test_dkdv_default_uses_tma_in_bf16_at_d128_only(monkeypatch):
    from kvtransform.kernels import dualkv as K

    monkeypatch.setattr(K, "_interpreting", lambda: False)
    assert K._cfg("dkdv", 128, torch.bfloat16)["TMA"]
    for d_pad, dtype in ((64, torch.bfloat16), (128, torch.float16), (128, torch.float32)):
        assert not K._cfg("dkdv", d_pad, dtype).get("TMA")
    assert not K._cfg("dkdv", 128, torch.bfloat16, {"dkdv": {"num_stages": 3}}).get("TMA")


def test_dkdv_config_with_blocks_that_do_not_tile_is_refused():
    layout = DualKVLayout.from_lengths([(17, [5])])
    q, k, v = make_inputs(layout, 4, 2, 32, torch.float32)
    out, lse = K.dualkv_fwd(q, k, v, layout.cu_seqlens, layout.segment_prefix, 0.2)
    with pytest.raises(ValueError, match="must be a multiple of BLOCK_M"):
        K.dualkv_bwd(torch.randn_like(q), q, k, v, out, lse, layout.cu_seqlens, layout.segment_prefix, 0.2,
                     config={"dkdv": {"BLOCK_M": 32, "BLOCK_N": 16}})


def test_kernel_resources_tool_compiles_for_hopper_without_a_gpu():
    """tools/kernel_resources.py: the forward kernel compiled for sm_90a on this CPU machine gives a ptxas resource
    row; a config past sm_90's shared memory says it fails at launch."""
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "kernel_resources.py"
    r = subprocess.run([sys.executable, str(tool), "fwd", "64,32,4,2", "32,128,8,4,1,4"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| fwd |")]
    assert len(rows) == 2, r.stdout
    regs = int(rows[0][2])
    assert 16 <= regs <= 255
    stores, loads = (int(x) for x in rows[0][3].split("/"))
    assert stores >= 0 and loads >= 0 and int(rows[0][4]) > 0
    assert "over sm_90's 227 KB" in rows[1][4], rows[1]  # the packed TMA forward at 4 stages (3 take 225 KB)
    assert rows[0][5].strip() in ("yes", "no")  # ptxas's C7515 (wgmma pipeline serialized)
    r = subprocess.run([sys.executable, str(tool), "dq", "32,32,8,3,1,4", "--tree"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "| dq | 32,32,8,3,1,4 | " in r.stdout and "error" not in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_forward_runs_the_fused_kernel_where_it_applies(dtype, monkeypatch):
    """The op's CPU forward computes plain segments (causal or windowed, prompt and response segments) with PyTorch's
    fused CPU flash attention, within float64 as tightly as the plain softmax; soft-caps, sinks, a scale that is not
    positive and autograd-recorded calls (that kernel gives no gradient through the LSE) take the plain softmax."""
    layout = DualKVLayout.from_lengths([(23, [7, 1, 12]), (5, [9])])
    q, k, v = make_inputs(layout, 6, 2, 16, dtype)
    args = (layout.cu_seqlens, layout.segment_prefix)
    taken = []
    fused = R.fused_segment_attention

    def spy(*a, **kw):
        res = fused(*a, **kw)
        if res is not None:
            taken.append(1)
        return res
    monkeypatch.setattr(R, "fused_segment_attention", spy)
    x64 = [t.to(torch.float64, copy=True).requires_grad_() for t in (q, k, v)]  # autograd records: plain softmax
    for variant in ({}, {"window": 5}):
        out, lse = R.dualkv_attention_reference(q, k, v, *args, **variant)
        assert len(taken) == 6, taken  # one call per segment
        taken.clear()
        ref_out, ref_lse = R.dualkv_attention_reference(*x64, *args, **variant)
        assert not taken
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        assert maxerr(out.double(), ref_out.detach()) < tol and maxerr(lse.double(), ref_lse.detach()) < tol
    for variant in ({"softcap": 3.0}, {"sinks": torch.randn(6, dtype=dtype)}, {"softmax_scale": -0.3}):
        R.dualkv_attention_reference(q, k, v, *args, **variant)
    qg = q.clone().requires_grad_()
    R.dualkv_attention_reference(qg, k, v, *args)
    assert not taken
    assert R.fused_segment_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), -0.3) is None
    # inputs whose head_dim is not contiguous (the kernel reads each row as contiguous)
    strided = [t.permute(2, 1, 0).contiguous().permute(2, 1, 0) for t in (q, k, v)]
    assert strided[0].stride(-1) != 1
    out, lse = R.dualkv_attention_reference(*strided, *args)
    assert taken
    ref_out, ref_lse = R.dualkv_attention_reference(*x64, *args)
    assert maxerr(out.double(), ref_out.detach()) < tol and maxerr(lse.double(), ref_lse.detach()) < tol

