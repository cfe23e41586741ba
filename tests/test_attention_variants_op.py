"""The attention variants of the DualKV and prefix-tree ops (``window``, ``softcap``, ``sinks``;
``kvtransform.ops._common.check_attention_variants``): the plain-PyTorch references against a float64 brute force on
the dense ``(T, T)`` mask, the Triton kernels (``TRITON_INTERPRET=1``, fp32) against that brute force forward and
backward (sinks' gradient included), bitwise-deterministic backward, and one-line refusals of bad arguments.

Layouts: a one-level tree (a prompt and two responses, plus an unshared prompt) run through DualKV, and a depth-3 tree
packed out of depth-first order (a node's descendants are not contiguous), so positions continue across nodes and
merged ranges. Windows smaller than a kernel block (32 under the interpreter), between, and larger than the prompt.
"""
import math
import os

import pytest
import torch

import kvtransform  # noqa: F401  registers torch.ops.kvt.*
from kvtransform.kernels import dualkv_reference as R
from kvtransform.kernels import prefix_tree as KT
from kvtransform.ops import dualkv as dualkv_ops
from kvtransform.ops import prefix_tree as tree_ops
from kvtransform.ops.dualkv import dualkv_attention
from kvtransform.ops.prefix_tree import prefix_tree_attention
from kvtransform.tree_layout import PrefixTreeLayout

ONE_LEVEL = ([21, 9, 13, 5], [-1, 0, 0, -1])
DEEP = ([21, 9, 13, 6, 11, 3], [-1, 0, 0, 1, 2, 1])
H, H_KV = 4, 2


def brute(q, k, v, lay: PrefixTreeLayout, scale, window=None, softcap=None, sinks=None):
    """float64 attention on the dense mask: ``lay.dense_mask()`` and ``pos_i - pos_j < window``."""
    grp = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    s = torch.einsum("thd,uhd->htu", q, kk) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = lay.dense_mask()
    if window is not None:
        pos = lay.position_ids()
        mask = mask & (pos[:, None] - pos[None, :] < window)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(-1, s.shape[1], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])[..., :mask.shape[1]]
    return torch.einsum("htu,uhd->thd", p, vv), lse


VARIANTS = {
    "window1": dict(window=1),
    "window30": dict(window=30),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all": dict(window=7, softcap=3.0, sinks=True),
}


def _inputs(lay, d, dtype=torch.float64, sinks=False):
    t = lay.total_tokens
    q, do = torch.randn(t, H, d, dtype=dtype), torch.randn(t, H, d, dtype=dtype)
    k, v = torch.randn(t, H_KV, d, dtype=dtype), torch.randn(t, H_KV, d, dtype=dtype)
    s = torch.randn(H, dtype=dtype) * 2 if sinks else None
    return q, k, v, do, s


def _grads(fn, q, k, v, s, do, dlse):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)] + (
        [s.detach().clone().requires_grad_(True)] if s is not None else [])
    out, lse = fn(*leaves[:3], leaves[3] if s is not None else None)
    torch.autograd.backward((out, lse), (do, dlse))
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def maxerr(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("name,d", [(name, (24, 64)[i % 2]) for i, name in enumerate(VARIANTS)])
def test_references_match_the_dense_float64_brute_force(name, d):
    """Both references (DualKV on the one-level tree, prefix tree on the deep one), forward, autograd through them
    (sinks included) and their explicit backwards, against the brute force; GQA 4/2, odd node lengths."""
    var = dict(VARIANTS[name])
    for lens, parents in (ONE_LEVEL, DEEP):
        lay = PrefixTreeLayout.from_parents(lens, parents)
        q, k, v, do, s = _inputs(lay, d, sinks=var.pop("sinks", False))
        var_s = dict(var, sinks=s)
        dlse = torch.randn(H, lay.total_tokens, dtype=torch.float64)
        scale = 0.3
        want = _grads(lambda q_, k_, v_, s_: brute(q_, k_, v_, lay, scale, **dict(var, sinks=s_)), q, k, v, s, do,
                      dlse)
        if lay.as_dualkv() is not None:
            dl = lay.as_dualkv()

            def ref(q_, k_, v_, s_):
                return R.dualkv_attention_reference(q_, k_, v_, dl.cu_seqlens, dl.segment_prefix, scale,
                                                    **dict(var, sinks=s_))

            explicit = R.dualkv_attention_reference_backward(do, dlse, q, k, v, dl.cu_seqlens, dl.segment_prefix,
                                                             scale, **var_s)
        else:
            def ref(q_, k_, v_, s_):
                return KT.prefix_tree_attention_reference(q_, k_, v_, lay, scale, **dict(var, sinks=s_))

            explicit = KT.prefix_tree_attention_reference_backward(do, dlse, q, k, v, lay, scale, **var_s)
        got = _grads(ref, q, k, v, s, do, dlse)
        assert maxerr(got[0], want[0]) < 1e-10 and maxerr(got[1], want[1]) < 1e-10
        assert len(explicit) == len(want[2])
        for g_auto, g_explicit, w in zip(got[2], explicit, want[2]):
            assert maxerr(g_auto, w) < 1e-9 and maxerr(g_explicit, w) < 1e-9


# (layout, variants, check determinism): windows below a block, above the prompt, soft-cap and sinks, alone and
# together
KERNEL_CASES = [
    ("dualkv", dict(window=5, softcap=2.0, sinks=True), True),
    ("dualkv", dict(window=40, softcap=1e5, sinks=True), False),  # a cap far above the scores: tanh near 0
    ("tree", dict(window=6, softcap=3.0, sinks=True), True),
    ("tree", dict(window=30), False),
]


@pytest.mark.parametrize("which,var,det", KERNEL_CASES, ids=[f"{w}-{'-'.join(v)}{v.get('window', '')}"
                                                             for w, v, _ in KERNEL_CASES])
def test_kernels_match_the_brute_force_and_the_backward_is_deterministic(which, var, det, monkeypatch):
    """The registered op on the Triton kernels (interpreter, fp32; head_dim 24 padded to 32) against the float64
    brute force: out, lse, dq, dk, dv and dsinks; the backward launched again gives the same bits."""
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", True)
    monkeypatch.setattr(tree_ops, "USE_TRITON_ON_CPU", True)
    var = dict(var)
    lay = PrefixTreeLayout.from_parents(*(ONE_LEVEL if which == "dualkv" else DEEP))
    q, k, v, do, s = _inputs(lay, 24, torch.float32, sinks=var.pop("sinks", False))
    dlse = torch.randn(H, lay.total_tokens)
    scale = 0.25

    def op(q_, k_, v_, s_):
        if which == "dualkv":
            return dualkv_attention(q_, k_, v_, lay.as_dualkv(), softmax_scale=scale, return_lse=True, sinks=s_,
                                    **var)
        return prefix_tree_attention(q_, k_, v_, lay, softmax_scale=scale, return_lse=True, sinks=s_, **var)

    got = _grads(op, q, k, v, s, do, dlse)
    want = _grads(lambda q_, k_, v_, s_: brute(q_, k_, v_, lay, scale, **dict(var, sinks=s_)),
                  *(x.double() if x is not None else None for x in (q, k, v, s, do, dlse)))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (got[0], got[1], *got[2]),
                          (want[0], want[1], *want[2])):
        assert maxerr(g, w) < 2e-4 * max(1.0, w.abs().max().item()), name
    if not det:
        return
    # bitwise determinism of the backward (no atomics): the raw backward op again, same bits as autograd's call
    out, lse = got[0], got[1]
    if which == "dualkv":
        dl = lay.as_dualkv()
        args = (do, dlse, q, k, v, out, lse, dl.cu_seqlens, dl.segment_prefix, scale, var.get("window"),
                var.get("softcap"), s)
        bwd = torch.ops.kvt.dualkv_attention_backward
    else:
        args = (do, dlse, q, k, v, out, lse, *lay.kernel_tensors(), scale, var.get("window"), var.get("softcap"), s)
        bwd = torch.ops.kvt.prefix_tree_attention_backward
    again = bwd(*args)
    assert all(torch.equal(x, y) for x, y in zip(got[2], again))


def test_a_window_near_int32_max_equals_no_window(monkeypatch):
    """A window longer than any sequence sees every key: the kernels clamp it to T, so position + window never wraps
    in their int32 bounds (2**31 - 1 once gave wrong dK/dV, and a crash, from both ops)."""
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", True)
    monkeypatch.setattr(tree_ops, "USE_TRITON_ON_CPU", True)
    tree = PrefixTreeLayout.from_parents([40, 20, 10], [-1, 0, 1])
    calls = {"tree": lambda q, k, v, **w: prefix_tree_attention(q, k, v, tree, **w),
             "dualkv": lambda q, k, v, **w: dualkv_attention(q, k, v, torch.tensor([0, 40, 60, 70], dtype=torch.int32),
                                                             torch.tensor([-1, 0, 0], dtype=torch.int32), **w)}
    for name, op in calls.items():
        q, k, v = (torch.randn(70, h, 16, requires_grad=True) for h in (2, 1, 1))
        grads = []
        for w in ({}, {"window": 2 ** 31 - 48}, {"window": 2 ** 31 - 1}):
            out = op(q, k, v, **w)
            grads.append((out,) + torch.autograd.grad(out.square().sum(), (q, k, v)))
        for got in grads[1:]:  # (the windowed kernels mask their steps: fp32 rounding apart, the same sums)
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, grads[0])), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA and compiled kernels: TRITON_INTERPRET=0 python -m pytest -m gpu")])])
def test_softcap_on_saturated_scores(device, monkeypatch):
    """Gemma 2's cap of 50 with scores far past the cap both ways, half the rows with every score at about -50 (a
    row whose best score is the cap's floor, where the GPU's ``exp2`` flushes what an offset exponent would push
    below the normal range), against the float64 brute force, forward and backward; fp32 under the interpreter, bf16
    on CUDA."""
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", True)
    torch.manual_seed(0)
    lay = PrefixTreeLayout.from_parents(*ONE_LEVEL)
    q, k, v, do, _ = _inputs(lay, 24, torch.float32)
    base = torch.randn(H_KV, 24)
    k = base + 0.1 * k  # every key of a KV head close to its base direction
    q = 30.0 * q
    q[::2] = -40.0 * base.repeat_interleave(H // H_KV, 0)  # these rows score about -50 (capped) against every key
    dlse = torch.randn(H, lay.total_tokens)
    dtype, tol = (torch.float32, 2e-4) if device == "cpu" else (torch.bfloat16, 3e-2)
    q, k, v, do = (x.to(device, dtype) for x in (q, k, v, do))
    dl = lay.as_dualkv()

    def op(q_, k_, v_, s_):
        return dualkv_attention(q_, k_, v_, dl.to(device), softmax_scale=0.25, return_lse=True, softcap=50.0)

    got = _grads(op, q, k, v, None, do, dlse.to(device))
    want = _grads(lambda q_, k_, v_, s_: brute(q_, k_, v_, lay, 0.25, softcap=50.0),
                  q.double().cpu(), k.double().cpu(), v.double().cpu(), None, do.double().cpu(), dlse.double())
    assert want[1][:, ::2].max() < -40  # the rows meant to be all-negative are
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), (got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        assert torch.isfinite(g).all() and maxerr(g.cpu(), w) < tol * max(1.0, w.abs().max().item()), name


def _one_line(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), "window must be a positive int"),
    (dict(window=-1), "window must be a positive int"),
    (dict(window=2.5), "window must be a positive int"),
    (dict(window=True), "window must be a positive int"),
    (dict(softcap=0.0), "softcap must be a finite float > 0"),
    (dict(softcap=math.inf), "softcap must be a finite float > 0"),
    (dict(softcap=-1.0), "softcap must be a finite float > 0"),
    (dict(softcap=1e39), "softcap must be a finite float > 0 and <= 3.403e"),  # beyond fp32: all-NaN output
    (dict(sinks=torch.zeros(H + 1)), r"sinks must be \(H,\) = \(4,\)"),
    (dict(sinks=torch.zeros(H, dtype=torch.int64)), r"sinks must be \(H,\) = \(4,\)"),
])
def test_bad_variant_arguments_are_refused_in_one_line(kwargs, match):
    """Every entry point: the DualKV and tree wrappers and both raw registered ops (the transformed graph calls those
    directly)."""
    lay = PrefixTreeLayout.from_parents([5, 3], [-1, 0])
    dl = lay.as_dualkv()
    q, k, v = torch.randn(8, H, 16), torch.randn(8, H_KV, 16), torch.randn(8, H_KV, 16)
    kw = dict(dict(window=None, softcap=None, sinks=None), **kwargs)
    _one_line(lambda: dualkv_attention(q, k, v, dl, **kwargs), match)
    _one_line(lambda: prefix_tree_attention(q, k, v, lay, **kwargs), match)
    if isinstance(kw["window"], float) or isinstance(kw["window"], bool):
        return  # the raw ops' schema (SymInt? window) refuses a non-int itself (RuntimeError from the dispatcher)
    _one_line(lambda: torch.ops.kvt.dualkv_attention(q, k, v, dl.cu_seqlens, dl.segment_prefix, 0.25,
                                                     kw["window"], kw["softcap"], kw["sinks"]), match)
    _one_line(lambda: torch.ops.kvt.prefix_tree_attention(q, k, v, *lay.kernel_tensors(), 0.25, kw["window"],
                                                          kw["softcap"], kw["sinks"]), match)


def test_opcheck_and_export_with_the_variants():
    """The schema's optional arguments through torch.library.opcheck (fake, autograd with sinks' gradient) and
    torch.export (the variants are node arguments of the opaque op)."""
    lay = PrefixTreeLayout.from_parents([5, 3, 2, 4], [-1, 0, 0, -1])
    dl = lay.as_dualkv()
    t = lay.total_tokens
    q, k, v = (torch.randn(t, hh, 16, requires_grad=True) for hh in (H, H_KV, H_KV))
    sinks = torch.randn(H, requires_grad=True)
    fast = ("test_schema", "test_autograd_registration", "test_faketensor")  # test_opcheck covers the rest
    torch.library.opcheck(torch.ops.kvt.dualkv_attention.default,
                          (q, k, v, dl.cu_seqlens, dl.segment_prefix, 0.25, 3, 5.0, sinks), test_utils=fast)
    torch.library.opcheck(torch.ops.kvt.prefix_tree_attention.default,
                          (q, k, v, *lay.kernel_tensors(), 0.25, 2, None, sinks), test_utils=fast)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.randn(H))

        def forward(self, q, k, v, cu, sp):
            return dualkv_attention(q, k, v, cu, sp, window=4, softcap=30.0, sinks=self.sinks) * 2

    m = M()
    ep = torch.export.export(m, (q.detach(), k.detach(), v.detach(), dl.cu_seqlens, dl.segment_prefix))
    node = next(n for n in ep.graph.nodes if n.target is torch.ops.kvt.dualkv_attention.default)
    assert 4 in node.args and 30.0 in node.args
    args = (q.detach(), k.detach(), v.detach(), dl.cu_seqlens, dl.segment_prefix)
    assert torch.equal(ep.module()(*args), m(*args))


def test_bench_dualkv_attn_takes_the_variants(tmp_path, monkeypatch):
    """``kvtransform bench dualkv-attn window=.. softcap=.. sinks=true``: the DualKV op runs with them, methods that
    do not take them are recorded unavailable; ``kernel_check`` checks the kernels with them (interpreter, a tiny
    case)."""
    from kvtransform.bench import checks, run

    tiny = ["r_min=3", "r_max=9", "hidden=64", "heads=4", "kv_heads=2", "head_dim=16", "mlp=96", "dtype=float32",
            "warmup=0", "iters=1", "device=cpu", "P=9", "mb=2", f"out_dir={tmp_path}", "plot=false"]
    rows = run("dualkv-attn", ["method=dualkv", "window=4", "softcap=30", "sinks=true"] + tiny)
    assert [r["status"] for r in rows] == ["ok"] * 3 and "window=4 softcap=30.0 sinks" in rows[0]["impl"]
    rows = run("dualkv-attn", ["method=pg", "window=4"] + tiny)
    assert all(r["status"].startswith("unavailable: pg does not take window") for r in rows)
    monkeypatch.setattr(checks, "DUALKV_CASES", [([(20, [7, 1])], 2, 1, 16)])
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", True)  # the registered op runs the kernels, as on CUDA
    ok, worst = checks.check_dualkv_kernels(torch.device("cpu"), dtype=torch.float16,
                                            variants=dict(window=5, softcap=20.0, sinks=torch.zeros(2)))
    assert ok and 0 <= worst <= 1


@pytest.mark.parametrize("t, cu, sp", [(18, [0, 8, 16], [-1, 0]), (16, [-5, 8, 99, 3], [-1, 7, -9])])
def test_variant_kernels_stay_inside_their_tensors_on_a_bad_layout(t, cu, sp):
    """Past the op's check (asynchronous on CUDA), the kernels with a window, soft-cap and sinks read only q/k/v's
    rows (NaN guard rows after them stay unread: the outputs over the clamped layout's rows are finite)."""
    from kvtransform.kernels import dualkv as K

    def guarded(heads):
        x = torch.full((t + 4, heads, 16), float("nan"))
        x[:t] = torch.randn(t, heads, 16)
        return x[:t]

    q, k, v = guarded(2), guarded(1), guarded(1)
    cu_t, sp_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(sp, dtype=torch.int32)
    var = dict(window=3, softcap=2.0, sinks=torch.randn(2))
    out, lse = K.dualkv_fwd(q, k, v, cu_t, sp_t, 0.25, **var)
    grads = K.dualkv_bwd(torch.randn(q.shape), q, k, v, out, lse, cu_t, sp_t, 0.25, **var)
    cu_c, _ = R.bounded_layout(cu_t, sp_t, t)
    lo, n = int(cu_c[0]), int(cu_c[-1])
    assert all(torch.isfinite(x[lo:n]).all() for x in (out, *grads[:3]))  # (dsinks sums every row: the op refuses
    # such a layout, on CUDA with a device-side assert)


@pytest.mark.parametrize("config", [None, {"dq": dict(BLOCK_M=16, BLOCK_N=32, PACK=True)}], ids=["default", "pack"])
def test_sinks_gradient_is_exact_in_half_precision(config):
    """fp16 kernels (interpreter), window + soft-cap + sinks + dLSE: dsinks against the float64 brute force to
    ~fp32 rounding (measured 2-5e-6), because the kernel sums ``p_sink * (rowsum(P * dP) - dLSE)`` from fp32 P and dP.
    The same sum from ``rowsum(dO * O)`` with the stored fp16 O (the other gradients' Delta) is ~1e-3 off here (up to
    ~4x PyTorch's own fp16 error; in bf16 it failed the H200 kernel check): the case tells the two apart."""
    from kvtransform.kernels import dualkv as K
    lay = PrefixTreeLayout.from_parents([96, 40, 33, 15, 1], [-1, 0, 0, -1, 3])
    dl = lay.as_dualkv()
    q, k, v, do, _ = _inputs(lay, 32, torch.float16)
    s = torch.randn(H) + 2.0  # p_sink well away from 0 on every head
    dlse = torch.randn(H, lay.total_tokens)
    var = dict(window=40, softcap=5.0)
    scale = 32 ** -0.5
    out, lse = K.dualkv_fwd(q, k, v, dl.cu_seqlens, dl.segment_prefix, scale, sinks=s, **var)
    dsinks = K.dualkv_bwd(do, q, k, v, out, lse, dl.cu_seqlens, dl.segment_prefix, scale, dlse, config=config,
                          sinks=s, **var)[3]
    want = _grads(lambda q_, k_, v_, s_: brute(q_, k_, v_, lay, scale, **dict(var, sinks=s_)),
                  *(x.double() for x in (q, k, v, s, do, dlse)))[2][3]
    err = maxerr(dsinks, want)
    from_o = -(torch.exp(s[:, None] - lse) * ((out.float() * do.float()).sum(-1).T - dlse)).sum(1)
    assert err < 2e-5 * max(1.0, want.abs().max().item()), (err, maxerr(from_o, want))
    assert maxerr(from_o, want) > 20 * err


def test_a_nan_sink_gives_nan_not_a_finite_wrong_answer():
    """A NaN sink logit makes its head's output NaN in ``kvt.attention``'s reference and the sparse-decode reference,
    as in ``kvt.dualkv_attention`` (the fully-masked-row guards must not turn it into an unnormalised output); the
    other heads are unchanged."""
    from kvtransform.kernels.sparse_decode import sparse_decode_reference

    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    sinks = torch.tensor([float("nan"), 0.0, 0.0, 0.0])
    out = kvtransform.attention(q, k, v, causal=True, sinks=sinks)
    want = kvtransform.attention(q, k, v, causal=True, sinks=torch.zeros(4))
    assert out[:, 0].isnan().all() and torch.equal(out[:, 1:], want[:, 1:])
    cache_k, cache_v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    got = sparse_decode_reference(torch.randn(2, 4, 16), cache_k, cache_v, None, torch.tensor([9, 4]), scale=0.25,
                                  sinks=sinks)
    assert got[:, 0].isnan().all() and torch.isfinite(got[:, 1:]).all()


def test_scale_and_causal_passed_by_position_are_named():
    """``kvt.attention(q, k, v, 0.25, True)`` (scale and causal where attn_mask and key_padding go) is refused in one
    line that gives the order, not an AttributeError from inside."""
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"attn_mask must be a tensor or None; got float \(the order is q, k, v"):
        kvtransform.attention(q, q, q, 0.25, True)
