"""kvt::sparse_decode_attention (SpeContext, arXiv 2512.00722 §4.3): Triton kernel (under TRITON_INTERPRET=1) and CPU op vs fp64 references."""
import os

import pytest
import torch

from kvtransform.kernels.sparse_decode import sparse_decode_reference, sparse_decode_triton
from kvtransform.ops.sparse_decode import (check_indices, retrieval_topk, slot_decode_attention,
                                           sparse_decode_attention)

FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3}


def _inputs(bsz, h, h_kv, s_max, d, dtype, lengths=None):
    q = torch.randn(bsz, h, d, dtype=dtype)
    k = torch.randn(bsz, h_kv, s_max, d, dtype=dtype)
    v = torch.randn(bsz, h_kv, s_max, d, dtype=dtype)
    kn = torch.randn(bsz, h_kv, d, dtype=dtype)
    vn = torch.randn(bsz, h_kv, d, dtype=dtype)
    if lengths is None:  # per-row differing lengths, one full row
        lengths = torch.randint(1, s_max + 1, (bsz,))
        lengths[0] = s_max
    return q, k, v, kn, vn, torch.as_tensor(lengths, dtype=torch.int32)


def _random_indices(lengths, h_kv, budget, pad_frac=0.2):
    """Distinct positions per (row, KV head), some entries replaced by -1 padding at random places."""
    bsz = lengths.shape[0]
    idx = torch.full((bsz, h_kv, budget), -1, dtype=torch.int32)
    for b in range(bsz):
        n = int(lengths[b])
        for k in range(h_kv):
            take = min(n, budget)
            perm = torch.randperm(n)[:take].to(torch.int32)
            idx[b, k, :take] = perm
            idx[b, k] = idx[b, k, torch.randperm(budget)]
            drop = torch.rand(budget) < pad_frac
            idx[b, k][drop] = -1
    return idx


def _dense_attention_fp64(q, k, v):
    """Full attention of q (1, H, D) over k, v (1, H_kv, n, D), in fp64, GQA by repeat_interleave."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    p = torch.softmax(torch.einsum("bhd,bhnd->bhn", q.double(), k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("bhn,bhnd->bhd", p, v)


def _check_close(out, q, k, v, idx, lengths, kn, vn, dtype):
    ref64 = sparse_decode_reference(q.double(), k.double(), v.double(), idx, lengths,
                                    None if kn is None else kn.double(), None if vn is None else vn.double())
    ref_dt = sparse_decode_reference(q, k, v, idx, lengths, kn, vn, dtype=dtype)  # PyTorch's own error in dtype
    err = (out.double() - ref64).abs().max().item()
    torch_err = (ref_dt.double() - ref64).abs().max().item()
    assert torch.isfinite(out).all()
    assert err <= 2 * torch_err + FLOOR[dtype], (err, torch_err)


# Acceptance shapes: S in {1, 17, 1025}, GQA 1/4/7, head_dim 64/80/128, per-row differing lengths; B below and above
# the lengths; one and several splits; with and without the new token's own K/V.
def _cases():
    out = []
    i = 0
    for g in (1, 4, 7):
        for d in (64, 80, 128):
            for s_max in (1, 17, 1025):
                budget = {1: 1, 17: 8, 1025: 300}[s_max] if i % 3 else s_max + 5  # B < len and B >= len
                dtype = torch.float16 if i % 4 == 3 else torch.float32
                splits = 1 + i % 3
                block_n = 16 if s_max < 100 else 64
                h_kv = 1 + i % 2
                out.append((2 + i % 2, h_kv, g, s_max, d, budget, splits, block_n, dtype, i % 2 == 0))
                i += 1
    return out


CASES = _cases()



@pytest.mark.parametrize("bsz,h_kv,g,s_max,d,budget,splits,block_n,dtype,new", CASES)
def test_gather_matches_fp64_reference(bsz, h_kv, g, s_max, d, budget, splits, block_n, dtype, new):
    q, k, v, kn, vn, lengths = _inputs(bsz, h_kv * g, h_kv, s_max, d, dtype)
    if not new:
        kn = vn = None
    idx = _random_indices(lengths, h_kv, budget)
    out = sparse_decode_triton(q, k, v, idx, lengths, kn, vn, num_splits=splits, block_n=block_n)
    assert out.shape == q.shape and out.dtype == dtype
    _check_close(out, q, k, v, idx, lengths, kn, vn, dtype)


@pytest.mark.parametrize("g,d,s_max", [(4, 128, 17), (7, 80, 1025), (1, 64, 1)])
def test_budget_covering_length_equals_full_attention(g, d, s_max):
    """B >= length: retrieval returns every token, and sparse decode equals full attention over cache + new token."""
    bsz, h_kv, dtype = 3, 2, torch.float32
    q, k, v, kn, vn, lengths = _inputs(bsz, h_kv * g, h_kv, s_max, d, dtype)
    budget = s_max + 3
    idx = retrieval_topk(q, k, lengths, budget)  # CPU op: reference retrieval on the same cache as keys
    for b in range(bsz):
        n = int(lengths[b])
        for kh in range(h_kv):
            sel = idx[b, kh]
            assert sorted(sel[:n].tolist()) == list(range(n)) and (sel[n:] == -1).all()
    out = sparse_decode_triton(q, k, v, idx, lengths, kn, vn, num_splits=2, block_n=16)
    # Full attention: keys = cache[:len] then the new token, as one dense attention per row (fp64).
    for b in range(bsz):
        n = int(lengths[b])
        kk = torch.cat([k[b:b + 1, :, :n], kn[b:b + 1, :, None]], dim=2).double()
        vv = torch.cat([v[b:b + 1, :, :n], vn[b:b + 1, :, None]], dim=2).double()
        full = _dense_attention_fp64(q[b:b + 1], kk, vv)
        torch.testing.assert_close(out[b:b + 1].double(), full, rtol=0, atol=2e-5)
        ref = sparse_decode_reference(q[b:b + 1].double(), k[b:b + 1].double(), v[b:b + 1].double(),
                                      idx[b:b + 1], lengths[b:b + 1], kn[b:b + 1].double(), vn[b:b + 1].double())
        torch.testing.assert_close(ref, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits", [1, 3])
def test_gather_all_in_order_is_bitwise_slot_mode(splits):
    """Indices 0..S_max-1 (gather) and the same cache read as a dense slot buffer give bit-identical outputs when
    the splits cut the same ranges: one split, or full rows (slot mode splits a row's own length, gather mode the
    index list)."""
    q, k, v, kn, vn, lengths = _inputs(3, 8, 2, 97, 64, torch.float32, lengths=[97, 97, 97] if splits > 1 else None)
    idx = torch.arange(97, dtype=torch.int32).expand(3, 2, 97).contiguous()
    a = sparse_decode_triton(q, k, v, idx, lengths, kn, vn, num_splits=splits, block_n=32)
    b = sparse_decode_triton(q, k, v, None, lengths, kn, vn, num_splits=splits, block_n=32)
    assert torch.equal(a, b)


def test_slot_mode_splits_share_each_rows_length():
    """Rows much shorter than the buffer, with many splits: each row's tokens are split over all its programs
    (the grid is sized for S); the result matches the fp64 reference for lengths 0, 1, < S/splits and S."""
    q, k, v, kn, vn, lengths = _inputs(5, 12, 3, 211, 32, torch.float32, lengths=[0, 1, 19, 60, 211])
    for splits in (2, 5, 7):
        out = sparse_decode_triton(q, k, v, None, lengths, kn, vn, num_splits=splits, block_n=16)
        _check_close(out, q, k, v, None, lengths, kn, vn, torch.float32)
        again = sparse_decode_triton(q, k, v, None, lengths, kn, vn, num_splits=splits, block_n=16)
        assert torch.equal(out, again)


def test_default_config_takes_block_128_only_where_one_wave_fits(monkeypatch):
    """Gather mode on an H200-sized GPU (132 SMs): BLOCK_N 128 while programs x splits <= 3 per SM (batches 22-23
    and 43-49 at H_kv 8), 64 beyond (25-32: the 2-split grid spills into a second wave); 16-bit, head_dim <= 128
    only; slot mode keeps 64 (tuned separately)."""
    import kvtransform.kernels.sparse_decode as S

    monkeypatch.setattr(S, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    got = {b: S.default_config(2048, 8 * b, cuda, True, 128, 2) for b in (22, 23, 25, 26, 32, 43, 49, 50)}
    assert {b: (c["block_n"], c["num_splits"]) for b, c in got.items()} == {
        22: (128, 2), 23: (128, 2), 25: (64, 2), 26: (64, 2), 32: (64, 2), 43: (128, 1), 49: (128, 1), 50: (64, 1)}
    assert S.default_config(2048, 8 * 22, cuda, True, 128, 4)["block_n"] == 64   # fp32
    assert S.default_config(2048, 8 * 22, cuda, True, 256, 2)["block_n"] == 64   # head_dim 256
    assert S.default_config(34816, 8 * 22, cuda, False, 128, 2)["block_n"] == 64  # slot mode
    cpu = S.default_config(2048, 8, torch.device("cpu"), True, 128, 2)
    assert cpu["num_splits"] == 1 and cpu["block_n"] == 128


@pytest.mark.parametrize("g,d,dtype", [(4, 128, torch.float32), (7, 80, torch.float16)])
def test_slot_mode_matches_fp64_reference(g, d, dtype):
    bsz, h_kv, budget = 3, 2, 40
    q, k, v, kn, vn, _ = _inputs(bsz, h_kv * g, h_kv, budget, d, dtype)
    lengths = torch.tensor([40, 7, 1], dtype=torch.int32)
    out = sparse_decode_triton(q, k, v, None, lengths, kn, vn, num_splits=2, block_n=16)
    _check_close(out, q, k, v, None, lengths, kn, vn, dtype)
    # slot buffer filled by gathering the selected tokens == gather mode over the full cache
    s_max = 70
    q, kc, vc, kn, vn, lens = _inputs(bsz, h_kv * g, h_kv, s_max, d, dtype, lengths=[70, 30, 3])
    idx = retrieval_topk(q, kc, lens, budget)
    slot_len = lens.clamp(max=budget)
    safe = idx.clamp(min=0).long()[..., None].expand(-1, -1, -1, d)
    ks, vs = torch.gather(kc, 2, safe), torch.gather(vc, 2, safe)
    o_slot = sparse_decode_triton(q, ks, vs, None, slot_len, kn, vn, block_n=16)
    o_gather = sparse_decode_triton(q, kc, vc, idx, lens, kn, vn, block_n=16)
    torch.testing.assert_close(o_slot, o_gather, rtol=0, atol=2 * FLOOR[dtype])


def test_masking_out_of_range_and_empty_rows():
    q, k, v, kn, vn, _ = _inputs(3, 4, 2, 17, 64, torch.float32)
    lengths = torch.tensor([17, 5, 0], dtype=torch.int32)
    idx = _random_indices(lengths, 2, 8)
    idx_bad = idx.clone()
    idx_bad[1, :, 0] = 12  # >= lengths[1]: masked, never read
    idx_bad[0, :, 1] = -7  # negative: masked
    idx_ok = idx_bad.clone()
    idx_ok[1, :, 0] = -1
    idx_ok[0, :, 1] = -1
    a = sparse_decode_triton(q, k, v, idx_bad, lengths, kn, vn, num_splits=2, block_n=16)
    b = sparse_decode_triton(q, k, v, idx_ok, lengths, kn, vn, num_splits=2, block_n=16)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # row 2 has no cached token: with the new token it is exactly v_new, without it zeros
    torch.testing.assert_close(a[2], vn[2].repeat_interleave(2, dim=0), rtol=0, atol=1e-6)
    z = sparse_decode_triton(q, k, v, idx, lengths, num_splits=2, block_n=16)
    assert (z[2] == 0).all()
    # lengths beyond S_max are clamped by the kernel (the CPU wrapper rejects them)
    c = sparse_decode_triton(q, k, v, idx, torch.tensor([1000, 5, 0], dtype=torch.int32), kn, vn, block_n=16)
    torch.testing.assert_close(c, sparse_decode_triton(q, k, v, idx, lengths, kn, vn, block_n=16))


def test_int64_indices_and_noncontiguous_q():
    q, k, v, kn, vn, lengths = _inputs(2, 8, 2, 33, 64, torch.float32)
    idx = _random_indices(lengths, 2, 16)
    qt = torch.randn(2, 64, 8).transpose(1, 2)  # non-contiguous (strided) query
    a = sparse_decode_triton(qt, k, v, idx.long(), lengths, kn, vn, block_n=16)
    _check_close(a, qt, k, v, idx, lengths, kn, vn, torch.float32)


@pytest.mark.parametrize("slot", [False, True])
def test_strided_views_are_read_in_place(slot, monkeypatch):
    """q / k_new / v_new sliced out of one fused projection output (batch and head strides, last dim contiguous): the
    kernels read them in place (no copy per layer, as the decode program passes them) and match the reference; the
    op path does not copy them either."""
    import kvtransform.kernels.sparse_decode as ksd
    import kvtransform.ops.sparse_decode as osd

    bsz, h, h_kv, s_max, d = 3, 8, 2, 41, 32
    fused = torch.randn(bsz, (h + 2 * h_kv) * d)  # one row per request: [q | k | v], as a fused q/k/v GEMM gives
    q, kn, vn = (t.view(bsz, -1, d) for t in fused.split([h * d, h_kv * d, h_kv * d], dim=-1))
    assert not (q.is_contiguous() or kn.is_contiguous() or vn.is_contiguous())
    _, k, v, _, _, lengths = _inputs(bsz, h, h_kv, s_max, d, torch.float32)
    idx = None if slot else _random_indices(lengths, h_kv, 16)
    seen = []
    real = ksd.sparse_decode_triton
    monkeypatch.setattr(osd, "USE_TRITON_ON_CPU", True)
    monkeypatch.setattr(osd, "sparse_decode_triton", lambda *a, **kw: seen.append(a) or real(*a, **kw))
    out = torch.ops.kvt.sparse_decode_attention(q, k, v, idx, lengths, kn, vn, d ** -0.5)
    assert [a.data_ptr() for a in (seen[0][0], seen[0][5], seen[0][6])] == [q.data_ptr(), kn.data_ptr(), vn.data_ptr()]
    _check_close(out, q, k, v, idx, lengths, kn, vn, torch.float32)


def test_op_cpu_path_and_wrappers():
    q, k, v, kn, vn, lengths = _inputs(3, 8, 2, 40, 64, torch.float32)
    idx = _random_indices(lengths, 2, 12)
    out = sparse_decode_attention(q, k, v, idx, lengths, kn, vn)
    ref = sparse_decode_reference(q, k, v, idx, lengths, kn, vn)
    torch.testing.assert_close(out, ref)
    out2 = torch.ops.kvt.sparse_decode_attention(q, k, v, idx, lengths, kn, vn, 64 ** -0.5)
    torch.testing.assert_close(out2, ref)
    # indices=None routes to slot mode
    sl = torch.tensor([40, 3, 9], dtype=torch.int32)
    torch.testing.assert_close(sparse_decode_attention(q, k, v, None, sl), slot_decode_attention(q, k, v, sl))
    torch.testing.assert_close(slot_decode_attention(q, k, v, sl, kn, vn),
                               sparse_decode_reference(q, k, v, None, sl, kn, vn))


def test_opcheck_and_export():
    q, k, v, kn, vn, lengths = _inputs(2, 4, 2, 9, 16, torch.float32)
    idx = _random_indices(lengths, 2, 4)
    torch.library.opcheck(torch.ops.kvt.sparse_decode_attention.default, (q, k, v, idx, lengths, kn, vn, 0.25))
    torch.library.opcheck(torch.ops.kvt.sparse_decode_attention.default, (q, k, v, None, lengths, None, None, 0.25))

    class M(torch.nn.Module):
        def forward(self, q, k, v, idx, lengths, kn, vn):
            return sparse_decode_attention(q, k, v, idx, lengths, kn, vn)

    ep = torch.export.export(M(), (q, k, v, idx, lengths, kn, vn), strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.kvt.sparse_decode_attention.default in targets
    torch.testing.assert_close(ep.module()(q, k, v, idx, lengths, kn, vn), M()(q, k, v, idx, lengths, kn, vn))


def test_empty_batches_no_cache_positions_and_backward():
    """Zero rows give zero rows (as retrieval_topk does; a reshape error before); a cache without positions is named
    (an index_select error); a backward through the decode-only ops is named in one line (torch's "no autograd
    formula")."""
    from kvtransform.ops.sparse_decode import slot_decode_attention

    empty = sparse_decode_attention(torch.randn(0, 4, 8), torch.randn(0, 2, 10, 8), torch.randn(0, 2, 10, 8),
                                    torch.zeros(0, 2, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert empty.shape == (0, 4, 8)
    with pytest.raises(ValueError, match=r"the cache has no positions \(S_max = 0\)"):
        sparse_decode_attention(torch.randn(1, 4, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8),
                                torch.full((1, 2, 3), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    q = torch.randn(1, 4, 8, requires_grad=True)
    outs = [sparse_decode_attention(q, torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8),
                                    torch.tensor([[[0, 1, 2], [3, 4, -1]]], dtype=torch.int32),
                                    torch.tensor([10], dtype=torch.int32)),
            slot_decode_attention(q, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.tensor([3],
                                                                                                    dtype=torch.int32))]
    for out in outs:
        with pytest.raises(RuntimeError, match="decode-only .* have no gradient"):
            out.sum().backward()


def test_bad_input_errors():
    q, k, v, kn, vn, lengths = _inputs(2, 8, 2, 17, 64, torch.float32)
    lengths = torch.tensor([17, 5], dtype=torch.int32)
    idx = _random_indices(lengths, 2, 4)
    bad = idx.clone()
    bad[1, 0, 0] = 5
    with pytest.raises(ValueError, match="out of range"):
        sparse_decode_attention(q, k, v, bad, lengths)
    bad = idx.clone()
    bad[0, 1, :2] = 3
    with pytest.raises(ValueError, match="more than once"):
        sparse_decode_attention(q, k, v, bad, lengths)
    with pytest.raises(ValueError, match="out of range"):
        check_indices(torch.full((2, 2, 4), -2, dtype=torch.int32), lengths)
    sparse_decode_attention(q, k, v, bad, lengths, validate=False)  # masked/unchecked path runs
    with pytest.raises(ValueError, match="cache_seqlens must be <="):
        sparse_decode_attention(q, k, v, idx, torch.tensor([18, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        sparse_decode_attention(q, k, v, idx, torch.tensor([-1, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="B >= 1"):
        sparse_decode_attention(q, k, v, idx[..., :0], lengths)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sparse_decode_attention(q[:, :7], k, v, idx, lengths)
    with pytest.raises(ValueError, match="int32"):
        sparse_decode_attention(q, k, v, idx.float(), lengths)
    with pytest.raises(ValueError, match="int32"):
        sparse_decode_attention(q, k, v, idx, lengths.float())
    with pytest.raises(ValueError, match="both k_new and v_new"):
        sparse_decode_attention(q, k, v, idx, lengths, kn, None)
    with pytest.raises(ValueError, match=r"\(batch, H_kv, D\)"):
        sparse_decode_attention(q, k, v, idx, lengths, kn[:, None], vn[:, None])
    with pytest.raises(ValueError, match="contiguous last"):
        kt = torch.randn(2, 2, 64, 17).transpose(2, 3)
        sparse_decode_attention(q, kt, kt, idx, lengths)
    with pytest.raises(ValueError, match=r"\(batch, H, D\)"):
        sparse_decode_attention(q[:, :, None], k, v, idx, lengths)
    with pytest.raises(ValueError, match="dtype"):
        sparse_decode_attention(q.half(), k, v, idx, lengths)
    with pytest.raises(ValueError, match=r"indices must be \(batch, H_kv, B\)"):
        sparse_decode_attention(q, k, v, idx[:, :1], lengths)
    with pytest.raises(ValueError, match="slot count"):
        slot_decode_attention(q, k[:, :, :4], v[:, :, :4], lengths)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5", True, torch.tensor([0.1, 0.2])])
def test_softmax_scale_that_is_not_a_finite_number_is_one_line(scale):
    """As the DualKV and prefix-tree ops: never NaN outputs or a NaN-ranked selection (the same positions for every
    head) from a NaN scale, never a string taken as a number."""
    from kvtransform.ops.attention import attention

    q, k, v, kn, vn, lengths = _inputs(2, 4, 2, 17, 16, torch.float32, lengths=[17, 5])
    idx = _random_indices(lengths, 2, 4)
    calls = [lambda: retrieval_topk(q, k, lengths, 4, softmax_scale=scale),
             lambda: sparse_decode_attention(q, k, v, idx, lengths, kn, vn, softmax_scale=scale),
             lambda: slot_decode_attention(q, k, v, lengths, kn, vn, softmax_scale=scale),
             lambda: attention(q[:, :, None], k, v, softmax_scale=scale)]
    for call in calls:
        with pytest.raises(ValueError, match="softmax_scale must be a finite real number") as e:
            call()
        assert "\n" not in str(e.value)


def test_deprecated_keyword_names_still_work():
    """lengths= / scale= (pre-rename names) still work for one release, with a DeprecationWarning."""
    q, kc, vc, kn, vn, lens = _inputs(2, 4, 2, 33, 16, torch.float32, lengths=[33, 7])
    idx = torch.arange(6, dtype=torch.int32).expand(2, 2, 6).contiguous()
    want = sparse_decode_attention(q, kc, vc, idx, lens, kn, vn, softmax_scale=0.2)
    with pytest.warns(DeprecationWarning) as record:
        got = sparse_decode_attention(q, kc, vc, idx, k_new=kn, v_new=vn, lengths=lens, scale=0.2)
    assert sorted(str(w.message).rsplit(" ", 1)[-1] for w in record) == ["cache_seqlens=", "softmax_scale="]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("slot", [False, True])
@pytest.mark.parametrize("new", [False, True])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_unused_cache_never_leaks_nan_or_inf(slot, new, poison, monkeypatch):
    """Cache positions that are not attended (past cache_seqlens, masked or padded indices) may hold anything,
    NaN/inf included (a fresh torch.empty cache, a freed slot): the CPU reference, the op's CPU path and the Triton
    kernel must all ignore them. A row with cache_seqlens == 0 gives v_new with the new token's K/V, zeros without."""
    import kvtransform.ops.sparse_decode as osd

    bsz, h, h_kv, s_max, d = 3, 8, 2, 24, 16
    q, k, v, kn, vn, _ = _inputs(bsz, h, h_kv, s_max, d, torch.float32)
    lengths = torch.tensor([0, 5, s_max], dtype=torch.int32)
    for b in range(bsz):  # poison everything past each row's length
        k[b, :, int(lengths[b]):] = poison
        v[b, :, int(lengths[b]):] = poison
    idx = None if slot else _random_indices(lengths, h_kv, 8)
    kn, vn = (kn, vn) if new else (None, None)
    scale = d ** -0.5

    ref = sparse_decode_reference(q, k, v, idx, lengths, kn, vn)
    tri = sparse_decode_triton(q, k, v, idx, lengths, kn, vn, block_n=16)
    op_cpu = torch.ops.kvt.sparse_decode_attention(q, k, v, idx, lengths, kn, vn, scale)
    monkeypatch.setattr(osd, "USE_TRITON_ON_CPU", True)
    op_tri = torch.ops.kvt.sparse_decode_attention(q, k, v, idx, lengths, kn, vn, scale)
    for out in (ref, tri, op_cpu, op_tri):
        assert torch.isfinite(out).all()
    expect0 = vn[0].repeat_interleave(h // h_kv, dim=0) if new else torch.zeros(h, d)
    for out in (ref, tri, op_cpu, op_tri):
        torch.testing.assert_close(out[0], expect0, rtol=0, atol=1e-6)
    torch.testing.assert_close(ref, tri, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(op_cpu, op_tri, rtol=1e-5, atol=1e-5)
    # the valid rows equal the fp64 reference on a clean cache (the poison changed nothing)
    kc, vc = k.clone(), v.clone()
    kc[~torch.isfinite(kc)] = 0
    vc[~torch.isfinite(vc)] = 0
    _check_close(ref, q, kc, vc, idx, lengths, kn, vn, torch.float32)


def _variant_brute_fp64(q, k, v, idx, lengths, kn, vn, window, softcap, sinks):
    """Row by row, in fp64, from the definitions: the attended cache positions (every one below the length in slot
    mode or when the window's cache part fits in B; else the valid selected ones), limited to ``j > len - window``,
    plus the new token; scores soft-capped; the sink a zero-valued key."""
    bsz, h, d = q.shape
    g = h // k.shape[1]
    out = torch.zeros(bsz, h, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(lengths[b])
        for hh in range(h):
            kv = hh // g
            dense = idx is None or (window is not None and window - 1 <= idx.shape[-1])
            sel = range(n) if dense else [int(j) for j in idx[b, kv] if 0 <= int(j) < n]
            sel = [j for j in sel if window is None or n - j < window]
            keys = [k[b, kv, j] for j in sel] + ([kn[b, kv]] if kn is not None else [])
            vals = [v[b, kv, j] for j in sel] + ([vn[b, kv]] if vn is not None else [])
            s = torch.stack([q[b, hh].double() @ x.double() for x in keys]) * d ** -0.5 if keys else \
                torch.zeros(0, dtype=torch.float64)
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                s = torch.cat([s, sinks[hh:hh + 1].double()])
            if s.numel():
                p = torch.softmax(s, 0)[: len(vals)]
                out[b, hh] = (p[:, None] * torch.stack(vals).double()).sum(0) if vals else 0
    return out


@pytest.mark.parametrize("mode,window,softcap,sinks,new", [
    ("gather", 5, None, False, True),     # window within the budget: dense over the window, indices not read
    ("gather", 30, 2.0, True, True),      # window beyond the budget: the selected tokens inside the window only
    ("gather", None, 2.0, True, False),   # soft-cap and sinks alone, no new token
    ("slot", 6, 2.0, True, True),         # slot mode over a whole cache, limited to the window
])
def test_window_softcap_sinks_match_definition(mode, window, softcap, sinks, new, monkeypatch):
    """Window, soft-cap and sinks (Gemma 2 / gpt-oss decode) in the reference, the Triton kernel (interpreter) and
    the op agree with a row-by-row fp64 computation from the definitions; a window layer never reads outside it."""
    import kvtransform.ops.sparse_decode as osd

    torch.manual_seed(3)
    q, k, v, kn, vn, lengths = _inputs(3, 6, 2, 40, 24, torch.float32, lengths=[40, 17, 0])
    idx = _random_indices(lengths, 2, 12) if mode == "gather" else None
    if idx is not None:
        idx[0, 0] = torch.tensor([39, 0, 20, 11, 12, 13, 35, 36, 37, 38, -1, 1])  # in and out of every window
    kn, vn = (kn, vn) if new else (None, None)
    sk = torch.randn(6) * 2 if sinks else None
    var = dict(window=window, softcap=softcap, sinks=sk)
    want = _variant_brute_fp64(q, k, v, idx, lengths, kn, vn, **var)
    ref = sparse_decode_reference(q, k, v, idx, lengths, kn, vn, **var)
    tri = sparse_decode_triton(q, k, v, idx, lengths, kn, vn, num_splits=2, block_n=16, **var)
    monkeypatch.setattr(osd, "USE_TRITON_ON_CPU", True)
    op = sparse_decode_attention(q, k, v, idx, lengths, kn, vn, **var)
    for got in (ref, tri, op):
        assert (got.double() - want).abs().max().item() < 1e-5
    if window is not None:  # poison everything outside the window: nothing changes
        pos = torch.arange(40)
        outside = pos[None, :] <= (lengths[:, None].long() - window)
        k2, v2 = k.clone(), v.clone()
        k2[outside[:, None, :].expand(-1, 2, -1)] = float("nan")
        v2[outside[:, None, :].expand(-1, 2, -1)] = float("inf")
        torch.testing.assert_close(sparse_decode_reference(q, k2, v2, idx, lengths, kn, vn, **var), ref)
        torch.testing.assert_close(sparse_decode_triton(q, k2, v2, idx, lengths, kn, vn, **var), tri)


def test_variant_bad_input_is_one_line():
    q, k, v, kn, vn, lengths = _inputs(2, 8, 2, 17, 64, torch.float32)
    idx = _random_indices(lengths, 2, 4)
    for kw, msg in ((dict(window=0), "window must be a positive int"), (dict(window=-3), "window must be"),
                    (dict(softcap=0.0), "softcap must be a finite float > 0"),
                    (dict(sinks=torch.zeros(4)), r"sinks must be \(H,\) = \(8,\)")):
        with pytest.raises(ValueError, match=msg):
            sparse_decode_attention(q, k, v, idx, lengths, kn, vn, **kw)
        with pytest.raises(ValueError, match=msg):  # the registered op a graph calls checks them too
            torch.ops.kvt.sparse_decode_attention(q, k, v, idx, lengths, kn, vn, 0.125, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs CUDA and compiled kernels: TRITON_INTERPRET=0 python -m pytest -m gpu")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("var", [dict(window=64), dict(window=4096), dict(softcap=30.0), dict(sinks=True),
                                 dict(window=128, softcap=30.0, sinks=True)], ids=str)
def test_cuda_variants_meet_the_numerics_rule(dtype, var):
    """On CUDA, the kernel with window / soft-cap / sinks (gather, budget 2048 of ~6K cached tokens, GQA 4,
    head_dim 128) against fp64: error <= 2x PyTorch's own in ``dtype`` + a small floor."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    q, k, v, kn, vn, lengths = (t.to(dev) for t in _inputs(4, 32, 8, 6144, 128, dtype, lengths=[6144, 5000, 300, 1]))
    idx = torch.stack([torch.stack([torch.randperm(6144, device=dev)[:2048] for _ in range(8)]) for _ in range(4)])
    idx = torch.where(idx < lengths[:, None, None].long(), idx, torch.full_like(idx, -1)).to(torch.int32)
    if var.get("sinks"):
        var = {**var, "sinks": torch.randn(32, device=dev)}
    out = sparse_decode_triton(q, k, v, idx, lengths, kn, vn, **var)
    ref64 = sparse_decode_reference(q.double(), k.double(), v.double(), idx, lengths, kn.double(), vn.double(),
                                    **var)
    own = sparse_decode_reference(q, k, v, idx, lengths, kn, vn, dtype=dtype, **var)
    err, torch_err = ((x.double() - ref64).abs().max().item() for x in (out, own))
    assert err <= 2 * torch_err + 1e-3, (err, torch_err)
