"""The registered ops (``torch.ops.kvt.*``), called directly as a transformed graph calls them, past the validating
wrappers: inconsistent shapes, offsets and indices are refused or computed as documented, on the kernel path (Triton
interpreter on CPU) and on the CPU reference path, and never touch memory outside their tensors."""
import pytest
import torch

import kvtransform  # noqa: F401  registers torch.ops.kvt.*
from kvtransform.kernels import dualkv as K
from kvtransform.kernels.dualkv_reference import bounded_layout
from kvtransform.layout import DualKVLayout, _check_structure, structure_ok
from kvtransform.ops import dualkv as dualkv_ops
from kvtransform.ops import sparse_decode as sparse_ops

PATHS = ["reference", "kernels"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run the op's CPU reference, or its Triton kernels under the interpreter (the CUDA code path)."""
    on = request.param == "kernels"
    monkeypatch.setattr(dualkv_ops, "USE_TRITON_ON_CPU", on)
    monkeypatch.setattr(sparse_ops, "USE_TRITON_ON_CPU", on)
    return request.param


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _guarded(t, h, d, guard=8):
    """A (t, h, d) view at the start of a NaN-filled buffer: a read past row t would put NaN into the result."""
    buf = torch.full((t + guard, h, d), float("nan"))
    x = buf[:t]
    x.normal_()
    return x


# ------------------------------------------------------------------------------------------------- DualKV
BAD_LAYOUTS = [  # (T, cu_seqlens, segment_prefix, message of the host check)
    (18, [0, 8, 16], [-1, 0], "ends at 16 but there are 18 tokens"),  # q longer than the layout
    (14, [0, 8, 16], [-1, 0], "ends at 16 but there are 14 tokens"),  # layout past the end of q
    (16, [2, 8, 16], [-1, 0], "start at 0"),
    (16, [0, 9, 8, 16], [-1, 0, 0], "not monotone"),
    (16, [0, 8, 8, 16], [-1, 0, 0], "response of length 0"),
    (16, [0, 8, 16], [-1, 5], "directly follow"),  # prefix index out of range
    (16, [0, 8, 16], [-3, 0], "marked -1"),
    (16, [0, 8, 16], [0, -1], "before any prefix"),
]


@pytest.mark.parametrize("t, cu, sp, msg", BAD_LAYOUTS)
def test_dualkv_ops_refuse_inconsistent_layouts(path, t, cu, sp, msg):
    q, k, v = _guarded(t, 2, 16), _guarded(t, 1, 16), _guarded(t, 1, 16)
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvt.dualkv_attention(q, k, v, _i32(cu), _i32(sp), 0.25)
    lse = torch.zeros(2, t)
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvt.dualkv_attention_backward(q, None, q, k, v, q, lse, _i32(cu), _i32(sp), 0.25)
    # the CUDA check (device side, no host sync) refuses the same layouts
    assert not bool(structure_ok(_i32(cu), _i32(sp), t))
    with pytest.raises(RuntimeError, match="inconsistent cu_seqlens/segment_prefix"):
        dualkv_ops.assert_layout_async(_i32(cu), _i32(sp), t)


@pytest.mark.parametrize("t, cu, sp, msg", BAD_LAYOUTS)
def test_planning_kernel_check_agrees_with_structure_ok(t, cu, sp, msg):
    """The kernels' planning launch asserts what :func:`structure_ok` checks (the CUDA op path relies on it)."""
    assert not bool(structure_ok(_i32(cu), _i32(sp), t))
    with pytest.raises(RuntimeError, match="inconsistent cu_seqlens/segment_prefix"):
        K._plan_layout(_i32(cu), _i32(sp), t, assert_layout=True)
    for lay in (DualKVLayout.from_lengths(g) for g in ([(3, [2, 1])], [(5, [])], [(2, [1]), (4, []), (1, [3, 3])])):
        K._plan_layout(lay.cu_seqlens, lay.segment_prefix, lay.total_tokens, assert_layout=True)


def test_device_check_agrees_with_host_check():
    good = [DualKVLayout.from_lengths(g) for g in ([(3, [2, 1])], [(5, [])], [(2, [1]), (4, []), (1, [3, 3])])]
    for lay in good:
        _check_structure(lay.cu_seqlens.tolist(), lay.segment_prefix.tolist(), lay.total_tokens)
        assert bool(structure_ok(lay.cu_seqlens, lay.segment_prefix, lay.total_tokens))
        dualkv_ops.assert_layout_async(lay.cu_seqlens, lay.segment_prefix, lay.total_tokens)


@pytest.mark.parametrize("t, cu, sp", [(18, [0, 8, 16], [-1, 0]), (14, [0, 8, 16], [-1, 0]),
                                       (16, [-5, 8, 99, 3], [-1, 7, -9])])
def test_dualkv_kernels_clamp_the_layout(t, cu, sp):
    """Past the op's check (on CUDA the assert is asynchronous), the kernels read and write inside q/k/v and the
    outputs only: offsets are clamped into [0, T] and prefix indices into [-1, S-1] (NaN guard rows after q, k, v are
    never read; where the clamped layout is a valid one, the covered rows equal the reference on it)."""
    q, k, v = _guarded(t, 2, 16), _guarded(t, 1, 16), _guarded(t, 1, 16)
    cu_c, sp_c = bounded_layout(_i32(cu), _i32(sp), t)
    assert int(cu_c.min()) >= 0 and int(cu_c.max()) <= t and int(sp_c.min()) >= -1 and int(sp_c.max()) < len(sp)
    n = int(cu_c[-1])
    out, lse = K.dualkv_fwd(q, k, v, _i32(cu), _i32(sp), 0.25)
    do = torch.randn(q.shape)
    grads = K.dualkv_bwd(do, q, k, v, out, lse, _i32(cu), _i32(sp), 0.25)
    lo = int(cu_c[0])
    for x in (out, *grads):
        assert torch.isfinite(x[lo:n]).all()
    if not bool(structure_ok(cu_c, sp_c, n)):
        return
    ref_out, ref_lse = K.dualkv_attention_reference(q[:n], k[:n], v[:n], cu_c, sp_c, 0.25)
    ref = K.dualkv_attention_reference_backward(do[:n], None, q[:n], k[:n], v[:n], cu_c, sp_c, 0.25)
    torch.testing.assert_close(out[:n], ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse[:, :n], ref_lse, atol=2e-5, rtol=0)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g[:n], r, atol=5e-5, rtol=0)


@pytest.mark.parametrize("mutate, msg", [
    (lambda q, k, v: (q, k[:-2], v[:-2]), r"k/v must be \(T="),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), r"k/v must be \(T="),
    (lambda q, k, v: (q[:, :3], k, v), "divisible"),
    (lambda q, k, v: (q, k, v.half()), "share one dtype"),
])
def test_dualkv_ops_refuse_inconsistent_shapes(path, mutate, msg):
    lay = DualKVLayout.from_lengths([(3, [2, 1])])
    q, k, v = mutate(torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16))
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvt.dualkv_attention(q, k, v, lay.cu_seqlens, lay.segment_prefix, 0.25)


def test_dualkv_backward_refuses_inconsistent_gradient_shapes(path):
    lay = DualKVLayout.from_lengths([(3, [2, 1])])
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 6\)"):
        torch.ops.kvt.dualkv_attention_backward(q, None, q, k, v, q, torch.zeros(4, 5), lay.cu_seqlens,
                                                lay.segment_prefix, 0.25)
    with pytest.raises(ValueError, match=r"grad_out must have shape \(6, 4, 16\)"):
        torch.ops.kvt.dualkv_attention_backward(q[:5], None, q, k, v, q, torch.zeros(4, 6), lay.cu_seqlens,
                                                lay.segment_prefix, 0.25)


# ------------------------------------------------------------------------------------------------- SpeContext
def _decode_inputs(bsz=2, h=4, h_kv=2, s_max=12, d=16):
    return (torch.randn(bsz, h, d), torch.randn(bsz, h_kv, s_max, d), torch.randn(bsz, h_kv, s_max, d),
            torch.randn(bsz, h_kv, d), torch.randn(bsz, h_kv, d))


@pytest.mark.parametrize("bad, msg", [
    ("k_batch", "does not match q"), ("k_head_dim", "does not match q"), ("lengths_shape", r"shape \(batch,\)"),
    ("indices_shape", r"indices must be \(batch, H_kv, B\)"), ("indices_dtype", "int32"),
    ("k_new_shape", r"\(batch, H_kv, D\)"), ("heads", "multiple of KV heads"),
])
def test_sparse_decode_op_refuses_inconsistent_shapes(path, bad, msg):
    q, k, v, kn, vn = _decode_inputs()
    lens = _i32([12, 5])
    idx = _i32([[[0, 1, 2, -1]] * 2] * 2)
    if bad == "k_batch":
        k, v = k[:1], v[:1]
    elif bad == "k_head_dim":
        k, v = k[..., :8], v[..., :8]
    elif bad == "lengths_shape":
        lens = lens[:1]
    elif bad == "indices_shape":
        idx = idx[:1]
    elif bad == "indices_dtype":
        idx = idx.float()
    elif bad == "k_new_shape":
        kn, vn = kn[:, :1], vn[:, :1]
    else:
        q = q[:, :3]
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvt.sparse_decode_attention(q, k, v, idx, lens, kn, vn, 0.25)


def test_sparse_decode_op_masks_bad_values_on_both_paths(path):
    """Index values outside [0, min(cache_seqlens[b], S_max)) and cache_seqlens outside [0, S_max] are the
    documented masking/clamping on every path: the same result as the cleaned-up inputs."""
    q, k, v, kn, vn = _decode_inputs()
    k[1, :, 5:] = float("nan")  # row 1 has 5 valid tokens: what lies past them is never read
    v[1, :, 5:] = float("nan")
    idx = _i32([[[0, 11, 40, -7]] * 2, [[4, 5, 1, 2 ** 30]] * 2])
    lens = _i32([1000, 5])
    clean_idx = _i32([[[0, 11, -1, -1]] * 2, [[4, -1, 1, -1]] * 2])
    got = torch.ops.kvt.sparse_decode_attention(q, k, v, idx, lens, kn, vn, 0.25)
    want = torch.ops.kvt.sparse_decode_attention(q, k, v, clean_idx, _i32([12, 5]), kn, vn, 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    empty = torch.ops.kvt.sparse_decode_attention(q, k, v, idx, _i32([-3, 0]), None, None, 0.25)
    assert (empty == 0).all()  # a negative length is an empty row: zeros


@pytest.mark.parametrize("bad, msg", [
    ("k_batch", "does not match q"), ("k_head_dim", "does not match q"), ("lengths_shape", r"shape \(batch,\)"),
    ("budget", "budget must be an int >= 1"), ("sink", "num_sink and num_recent"), ("heads", "multiple of its KV"),
])
def test_retrieval_op_refuses_inconsistent_shapes(path, bad, msg):
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 12, 16)
    lens, budget, sink = _i32([12, 5]), 4, 0
    if bad == "k_batch":
        k = k[:1]
    elif bad == "k_head_dim":
        k = k[..., :8]
    elif bad == "lengths_shape":
        lens = lens[:1]
    elif bad == "budget":
        budget = -2
    elif bad == "sink":
        sink = -1
    else:
        q = q[:, :3]
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvt.retrieval_topk(q, k, lens, budget, sink, 0, 0.25)


def test_retrieval_op_clamps_lengths_on_both_paths(path):
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 12, 16)
    got = torch.ops.kvt.retrieval_topk(q, k, _i32([1000, -4]), 4, 0, 0, 0.25)
    want = torch.ops.kvt.retrieval_topk(q, k, _i32([12, 0]), 4, 0, 0, 0.25)
    assert torch.equal(got, want) and (got[1] == -1).all()


# ------------------------------------------------------------------------------------------------- canonical
@pytest.mark.parametrize("mutate, msg", [
    (lambda q, k, v, kp: (q, k[:1], v[:1], kp), "match q in batch and head_dim"),
    (lambda q, k, v, kp: (q, k[..., :4], v, kp), "match q in batch and head_dim"),
    (lambda q, k, v, kp: (q[:, :3], k, v, kp), "multiple of KV heads"),
    (lambda q, k, v, kp: (q, k, v, kp[:, :3]), "key_padding must be"),
])
def test_attention_op_refuses_inconsistent_shapes(mutate, msg):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    kp = torch.ones(2, 5, dtype=torch.bool)
    q, k, v, kp = mutate(q, k, v, kp)
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvt.attention(q, k, v, None, kp, 0.3, True)


@pytest.mark.parametrize("mask, kp, msg", [
    (torch.tensor([[1, 1, 0, 0, 1]] * 5), None, r"attn_mask must be bool .* got torch.int64 .* mask.bool\(\)"),
    (torch.zeros(1, 1, 2, 5, 5), None, r"attn_mask of shape \(1, 1, 2, 5, 5\) does not broadcast"),
    (torch.zeros(2, 5, 5), None, r"does not broadcast .* add the head axis, mask\[:, None\]"),
    (None, torch.tensor([[0.0, 0, 0, float("-inf"), 0]] * 2), "key_padding must be bool or 0/1 integers"),
])
def test_attention_refuses_masks_it_would_misread(mask, kp, msg):
    """A 0/1 integer attn_mask was added to the scores (masked keys attended: a silently wrong answer), a float
    key_padding was cast to bool (an additive 0/-inf mask inverted), a 5-D mask gave a 5-D output and a (B, S_q,
    S_k) mask a raw broadcast error: each is named in one line, by the public function and by the op."""
    import kvtransform as kvt

    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    for call in (lambda: kvt.attention(q, k, v, mask, kp), lambda: torch.ops.kvt.attention(q, k, v, mask, kp, 0.3,
                                                                                             False)):
        with pytest.raises(ValueError, match=msg):
            call()
    for shape in ((5, 5), (2, 1, 5, 5), (1, 4, 1, 5)):  # broadcastable masks still run
        assert kvt.attention(q, k, v, torch.zeros(shape)).shape == q.shape
    assert torch.equal(kvt.attention(q, k, v, key_padding=torch.tensor([[1, 1, 0, 1, 1]] * 2)),
                       kvt.attention(q, k, v, key_padding=torch.tensor([[True, True, False, True, True]] * 2)))
    with pytest.raises(ValueError, match="at least one key and head_dim >= 1"):
        kvt.attention(q, k[:, :, :0], v[:, :, :0])


def test_attention_fake_shape_follows_v_head_dim():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 4)
    torch.library.opcheck(torch.ops.kvt.attention.default, (q, k, v, None, None, 0.3, False))


# ------------------------------------------------------------------------------------------- second derivatives
def test_attention_op_second_derivatives_equal_the_math_reference():
    """kvt.attention (the canonical transform's op) keeps second derivatives: a gradient penalty's gradient equals
    plain PyTorch attention's in float64 (before, the first gradient was detached: the penalty's part was lost)."""
    import math

    import kvtransform as kvt

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 7, 5, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    k2, v2 = k[:, :2], v[:, :2]  # GQA 4 / 2

    def reference(q, k, v, sinks):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        s = (q @ k.transpose(-1, -2)) * 0.4
        s = torch.tanh(s / 3.0) * 3.0
        s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -math.inf)
        s = torch.cat([s, sinks[None, :, None, None].expand(1, 4, 7, 1)], -1)
        return s.softmax(-1)[..., :-1] @ v

    results = []
    for f in (lambda *a: kvt.attention(*a[:3], softmax_scale=0.4, causal=True, softcap=3.0, sinks=a[3]), reference):
        out = f(q, k2, v2, sinks)
        g = torch.autograd.grad((out ** 2).sum(), (q, k, sinks), create_graph=True)
        penalty = sum(x.pow(2).sum() for x in g) + out.sum()
        results.append(torch.autograd.grad(penalty, (q, k, v, sinks)))
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["dualkv", "tree"])
def test_fused_backward_ops_refuse_second_derivatives_in_one_line(op):
    import kvtransform as kvt

    torch.manual_seed(0)
    q = torch.randn(6, 2, 4, requires_grad=True)
    k, v = torch.randn(6, 1, 4), torch.randn(6, 1, 4)
    if op == "dualkv":
        out = kvt.dualkv_attention(q, k, v, _i32([0, 2, 4, 6]), _i32([-1, 0, 0]))
    else:
        batch = kvt.pack_trajectories([[1, 2, 3, 4], [1, 2, 5, 6]])
        out = kvt.prefix_tree_attention(q, k, v, batch.layout)
    (g,) = torch.autograd.grad((out ** 2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"kvt::.*_backward has no second derivatives.*kvt.attention"):
        g.pow(2).sum().backward()
