"""kvt::retrieval_topk (SpeContext, arXiv 2512.00722 §4.3): Triton scoring (under TRITON_INTERPRET=1) and CPU op vs fp64 references."""
import pytest
import torch

from kvtransform.kernels.retrieval import (retrieval_scores_reference, retrieval_scores_triton,
                                           retrieval_topk_reference, retrieval_topk_triton, select_topk)
from kvtransform.ops.sparse_decode import retrieval_topk

ATOL = {torch.float32: 1e-4, torch.float16: 2e-2}  # on log-probabilities (scores ~ N(0, 1) after scaling)


def _inputs(bsz, h_kv, g, s_max, d, dtype, lengths=None):
    q = torch.randn(bsz, h_kv * g, d, dtype=dtype)
    k = torch.randn(bsz, h_kv, s_max, d, dtype=dtype)
    if lengths is None:
        lengths = torch.randint(1, s_max + 1, (bsz,))
        lengths[0] = s_max
    return q, k, torch.as_tensor(lengths, dtype=torch.int32)


def _check_selection(idx, ref_scores, lengths, budget, atol):
    """idx is a valid top-`budget` set of the fp64 scores, up to near-ties within `atol`."""
    bsz, h_kv, _ = ref_scores.shape
    assert idx.dtype == torch.int32 and idx.shape == (bsz, h_kv, budget)
    for b in range(bsz):
        n = int(lengths[b])
        want = min(n, budget)
        for kh in range(h_kv):
            sel = idx[b, kh]
            assert (sel[:want] >= 0).all() and (sel[want:] == -1).all()  # valid first, then -1 padding
            chosen = sel[:want].long()
            assert chosen.unique().numel() == want and (chosen < n).all()
            if want < n:
                kth = ref_scores[b, kh, :n].topk(want).values[-1]
                assert (ref_scores[b, kh, chosen] >= kth - atol).all()


def _cases():
    out, i = [], 0
    for g in (1, 4, 7):
        for d in (64, 80, 128):
            s_max = (1, 17, 1025)[i % 3]
            budget = {1: 1, 17: 5, 1025: 64}[s_max]
            dtype = torch.float16 if i % 3 == 2 and d != 80 else torch.float32
            out.append((2 + i % 2, 1 + i % 2, g, s_max, d, budget, dtype))
            i += 1
    return out


@pytest.mark.parametrize("bsz,h_kv,g,s_max,d,budget,dtype", _cases())
def test_scores_and_topk_match_fp64(bsz, h_kv, g, s_max, d, budget, dtype):
    q, k, lengths = _inputs(bsz, h_kv, g, s_max, d, dtype)
    scale = d ** -0.5
    got = retrieval_scores_triton(q, k, lengths, scale, block_s=64, blocks_per_prog=3)
    ref = retrieval_scores_reference(q, k, lengths, scale)
    valid = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), valid) and (got[~valid] == float("-inf")).all()
    torch.testing.assert_close(got[valid].double(), ref[valid], rtol=0, atol=ATOL[dtype])
    idx = retrieval_topk_triton(q, k, lengths, budget, block_s=64)
    _check_selection(idx, ref, lengths, budget, 2 * ATOL[dtype])


def test_group_max_of_softmax_definition():
    """The kernel's ranking equals the paper's definition: max over the group of softmax probabilities."""
    bsz, h_kv, g, s_max, d = 2, 2, 4, 50, 32
    q, k, lengths = _inputs(bsz, h_kv, g, s_max, d, torch.float32, lengths=[50, 20])
    scale = 0.3
    got = retrieval_scores_triton(q, k, lengths, scale, block_s=16)
    for b in range(bsz):
        n = int(lengths[b])
        for kh in range(h_kv):
            s = torch.einsum("gd,sd->gs", q[b, kh * g:(kh + 1) * g].double(), k[b, kh, :n].double()) * scale
            p = torch.softmax(s, dim=-1).amax(dim=0)
            torch.testing.assert_close(got[b, kh, :n].double().exp(), p, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("s_max,budget", [(1, 1), (17, 17), (17, 40), (1025, 1025)])
def test_budget_covering_length_returns_all_tokens(s_max, budget):
    q, k, lengths = _inputs(3, 2, 4, s_max, 64, torch.float32)
    for fn in (retrieval_topk_triton, retrieval_topk_reference):
        idx = fn(q, k, lengths, budget)
        assert idx.shape == (3, 2, budget)
        for b in range(3):
            n = int(lengths[b])
            for kh in range(2):
                assert sorted(idx[b, kh, :n].tolist()) == list(range(n)) and (idx[b, kh, n:] == -1).all()


def test_sink_and_recent_windows():
    q, k, lengths = _inputs(2, 2, 4, 97, 64, torch.float32, lengths=[97, 40])
    sink, recent, budget = 4, 8, 20
    for fn in (retrieval_topk_triton, retrieval_topk_reference):
        idx = fn(q, k, lengths, budget, sink=sink, recent=recent)
        for b in range(2):
            n = int(lengths[b])
            forced = set(range(sink)) | set(range(n - recent, n))
            for kh in range(2):
                sel = set(idx[b, kh].tolist())
                assert forced <= sel and len(sel) == budget
    ref = retrieval_scores_reference(q, k, lengths, 0.125, sink, recent)
    got = retrieval_scores_triton(q, k, lengths, 0.125, sink, recent, block_s=32, blocks_per_prog=2)
    assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(ref) & (ref > 0))


def test_nothing_past_each_rows_length_is_read(monkeypatch):
    """The scoring kernel visits only blocks below each row's length and leaves the rest of its scratch (scores,
    softmax partials) unwritten: results are the same when that scratch starts as NaN (rows of length 0, within one
    block, at a block edge, across programs, the whole cache)."""
    bsz, h_kv, g, s_max, d = 6, 2, 3, 203, 32
    lengths = [0, 5, 16, 17, 100, 203]
    q, k, lens = _inputs(bsz, h_kv, g, s_max, d, torch.float32, lengths=lengths)
    clean = retrieval_scores_triton(q, k, lens, 0.2, 2, 3, block_s=16, blocks_per_prog=3)
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real(*a, **kw).fill_(
        float("nan") if kw.get("dtype", torch.float32).is_floating_point else 7))
    dirty = retrieval_scores_triton(q, k, lens, 0.2, 2, 3, block_s=16, blocks_per_prog=3)
    assert torch.equal(clean, dirty)
    ref = retrieval_scores_reference(q, k, lens, 0.2, 2, 3)
    assert torch.equal(torch.isfinite(dirty), torch.isfinite(ref)) and torch.equal(dirty.isinf(), ref.isinf())
    fin = torch.isfinite(ref)
    torch.testing.assert_close(dirty[fin].double(), ref[fin], rtol=0, atol=1e-5)


def test_strided_lengths_are_read_by_row():
    """A strided int32 ``lengths`` view (every other row of a longer tensor) is read by row, not by storage."""
    q, k, _ = _inputs(2, 2, 4, 17, 16, torch.float32)
    strided = torch.tensor([2, 9, 5, 0], dtype=torch.int32)[::2]
    got = retrieval_scores_triton(q, k, strided, 0.25, block_s=16)
    want = retrieval_scores_triton(q, k, strided.contiguous(), 0.25, block_s=16)
    assert torch.equal(got.isfinite(), want.isfinite()) and torch.isfinite(got[1, :, :5]).all()
    assert not torch.isfinite(got[1, :, 5:]).any()


def test_zero_length_row_and_clamped_lengths():
    q, k, _ = _inputs(2, 2, 4, 17, 64, torch.float32)
    idx = retrieval_topk_triton(q, k, torch.tensor([0, 17], dtype=torch.int32), 5)
    assert (idx[0] == -1).all() and (idx[1] >= 0).all()
    a = retrieval_topk_triton(q, k, torch.tensor([500, 17], dtype=torch.int32), 5)  # clamped to S_max in-kernel
    b = retrieval_topk_triton(q, k, torch.tensor([17, 17], dtype=torch.int32), 5)
    assert torch.equal(a, b)


def test_select_topk_padding_beyond_s_max():
    scores = torch.tensor([[[0.5, float("-inf"), 2.0]]])
    assert select_topk(scores, 5).tolist() == [[[2, 0, -1, -1, -1]]]


def test_op_cpu_path_opcheck_and_export():
    q, k, lengths = _inputs(2, 2, 4, 33, 32, torch.float32)
    a = retrieval_topk(q, k, lengths, 8)
    b = retrieval_topk_reference(q, k, lengths, 8)
    assert torch.equal(a, b)
    torch.library.opcheck(torch.ops.kvt.retrieval_topk.default, (q, k, lengths, 8, 1, 2, 0.2))

    class M(torch.nn.Module):
        def forward(self, q, k, lengths):
            return retrieval_topk(q, k, lengths, 8)

    ep = torch.export.export(M(), (q, k, lengths), strict=False)
    assert any(n.target == torch.ops.kvt.retrieval_topk.default for n in ep.graph.nodes)
    assert torch.equal(ep.module()(q, k, lengths), a)


def test_integer_like_counts():
    """NumPy / torch integer scalars are accepted for budget, sink and recent, and give the int result."""
    np = pytest.importorskip("numpy")
    q, k, lengths = _inputs(2, 2, 4, 17, 32, torch.float32, lengths=[17, 3])
    want = retrieval_topk(q, k, lengths, 5, num_sink=1, num_recent=2)
    got = retrieval_topk(q, k, lengths, np.int64(5), num_sink=np.int32(1), num_recent=torch.tensor(2))
    assert torch.equal(got, want)


def test_bad_input_errors():
    q, k, lengths = _inputs(2, 2, 4, 17, 32, torch.float32, lengths=[17, 3])
    with pytest.raises(ValueError, match="budget"):
        retrieval_topk(q, k, lengths, 0)
    with pytest.raises(ValueError, match="num_sink and num_recent"):
        retrieval_topk(q, k, lengths, 4, num_sink=-1)
    with pytest.raises(ValueError, match="exceeds the budget"):
        retrieval_topk(q, k, lengths, 4, num_sink=3, num_recent=2)
    with pytest.raises(ValueError, match=r"num_sink must be an integer token count; got 1.5.*num_sink=1"):
        retrieval_topk(q, k, lengths, 4, num_sink=1.5)
    with pytest.raises(ValueError, match="recent must be an integer token count; got 2.0"):
        retrieval_topk(q, k, lengths, 4, num_recent=2.0)
    with pytest.raises(ValueError, match="budget must be an integer token count; got 4.0"):
        retrieval_topk(q, k, lengths, 4.0)
    # a cache in (batch, S, H_kv, D) order instead of (batch, H_kv, S_max, D): the message names the layout
    with pytest.raises(ValueError, match=r"the cache layout is \(batch, H_kv, S_max, D\), pass k.transpose\(1, 2\)"):
        retrieval_topk(q, k.transpose(1, 2).contiguous(), lengths, 4)
    with pytest.raises(ValueError, match="budget must be an integer token count; got the bool"):
        retrieval_topk(q, k, lengths, True)
    with pytest.raises(ValueError, match="sink must be an integer"):
        retrieval_topk(q, k, lengths, 4, num_sink=torch.tensor(1.0))
    with pytest.raises(ValueError, match="multiple of its KV heads"):
        retrieval_topk(q[:, :7], k, lengths, 4)
    with pytest.raises(ValueError, match="cache_seqlens must be <="):
        retrieval_topk(q, k, torch.tensor([18, 3], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        retrieval_topk(q, k, lengths[:1], 4)
    with pytest.raises(ValueError, match="dtype"):
        retrieval_topk(q.half(), k, lengths, 4)
    with pytest.raises(ValueError, match="head_dim"):
        retrieval_topk(q[..., :16], k, lengths, 4)


def test_deprecated_keyword_names_still_work():
    """The pre-rename keywords (lengths=, sink=, recent=, scale=) are accepted for one release, with a warning."""
    q, k, lengths = _inputs(2, 2, 4, 17, 32, torch.float32, lengths=[17, 3])
    want = retrieval_topk(q, k, lengths, 5, num_sink=1, num_recent=2, softmax_scale=0.3)
    with pytest.warns(DeprecationWarning) as record:
        got = retrieval_topk(q, k, budget=5, lengths=lengths, sink=1, recent=2, scale=0.3)
    assert sorted(str(w.message).rsplit(" ", 1)[-1] for w in record) == [
        "cache_seqlens=", "num_recent=", "num_sink=", "softmax_scale="]
    assert torch.equal(want, got)
    with pytest.raises(TypeError, match="both sink= .deprecated. and num_sink="):
        retrieval_topk(q, k, lengths, 5, sink=1, num_sink=1)
