"""Prefix trees (Tree Training, arXiv 2511.00413; DualKV, arXiv 2605.15422, is the one-level case): the layout, the
trajectory packing, ``kvt::prefix_tree_attention`` (Triton kernels under TRITON_INTERPRET=1 and the CPU reference)
against float64, and exactness of a tiny Llama run on a packed tree against each trajectory run separately.

Numerics rule (``docs/ARCHITECTURE.md``): our max error on out, LSE, dQ, dK, dV (and, at model level, on the
trajectory log-probs and every parameter gradient) is at most 2 × PyTorch's own error in the same dtype plus a small
floor. bf16 is checked on the GPU (``tools/prefix_tree_gpu_check.py``): the interpreter's bf16 dot is wrong.
"""
import copy
import random

import pytest
import torch
from numerics import check_rule, maxerr

import kvtransform as kvt
from kvtransform.kernels import prefix_tree as K
from kvtransform.ops import prefix_tree as tree_ops
from kvtransform.tree_layout import PrefixTreeLayout
from kvtransform.exactness import _loss_grads, _rel, trainable_parameters




def one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value), str(e.value)


# ====================================================================================================== layout
def test_layout_tables_positions_and_mask():
    # two trees; node 4 is a second child of 0 packed after 1's subtree; node 5 a new root
    lay = PrefixTreeLayout.from_parents([3, 2, 1, 2, 4, 2, 1], [-1, 0, 1, 1, 0, -1, 5])
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12, 14, 15]
    assert lay.cu_seqlens.dtype == torch.int32 and lay.parent.tolist() == [-1, 0, 1, 1, 0, -1, 5]
    anc = [lay.ancestors[lay.ancestor_ptr[n]:lay.ancestor_ptr[n + 1]].tolist() for n in range(7)]
    assert anc == [[], [0], [0, 1], [0, 1], [0], [], [5]]
    desc = [lay.descendants[lay.descendant_ptr[n]:lay.descendant_ptr[n + 1]].tolist() for n in range(7)]
    assert desc == [[1, 2, 3, 4], [2, 3], [], [], [], [6], []]
    kr = [lay.key_ranges[lay.key_range_ptr[n]:lay.key_range_ptr[n + 1]].tolist() for n in range(7)]
    assert kr == [[], [[0, 3]], [[0, 5]], [[0, 5]], [[0, 3]], [], [[12, 14]]]  # adjacent ancestors merged
    qr = [lay.query_ranges[lay.query_range_ptr[n]:lay.query_range_ptr[n + 1]].tolist() for n in range(7)]
    assert qr == [[[3, 12]], [[5, 8]], [], [], [], [[14, 15]], []]  # depth-first: one range per node
    assert lay.position_ids().tolist() == [0, 1, 2, 3, 4, 5, 5, 6, 3, 4, 5, 6, 0, 1, 2]
    assert (lay.max_seqlen, lay.max_context, lay.depth, lay.num_trees, lay.total_tokens) == (4, 7, 3, 2, 15)
    m = lay.dense_mask()
    assert m[7, 4] and not m[7, 5] and m[7, 6] and not m[6, 7] and m[7, 0] and not m[8, 3] and m[8, 2] and not m[12, 11]
    assert lay.visible_pairs() == int(m.sum())
    again = PrefixTreeLayout.from_tensors(lay.cu_seqlens, lay.parent, total_tokens=15)
    for name in PrefixTreeLayout._TENSORS:
        assert torch.equal(getattr(again, name), getattr(lay, name))
    lay.validate(total_tokens=15)


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("build, match", [
    (lambda: PrefixTreeLayout.from_parents([2, 3], [-1, 2]), "not a node index"),
    (lambda: PrefixTreeLayout.from_parents([2, 3], [-1, 1]), "its own parent"),
    (lambda: PrefixTreeLayout.from_parents([2, 3, 4], [2, -1, 1]), "comes after it"),
    (lambda: PrefixTreeLayout.from_parents([2, 3, 4], [-1, 2, 1]), "cycle: 1 -> 2 -> 1"),
    (lambda: PrefixTreeLayout.from_parents([2, 0], [-1, 0]), "node 1 has length 0"),
    (lambda: PrefixTreeLayout.from_parents([], []), "no nodes"),
    (lambda: PrefixTreeLayout.from_parents([2, 3], [-1]), "2 node lengths but 1 parents"),
    (lambda: PrefixTreeLayout.from_parents([2, 3], [-1, 0], total_tokens=6), "sum to 5 tokens but there are 6"),
    (lambda: PrefixTreeLayout.from_parents([2.0, 3], [-1, 0]), r"lengths\[0\] must be an integer"),
    (lambda: PrefixTreeLayout.from_parents([2, 3], [-1, True]), r"parents\[1\] must be an integer"),
    (lambda: PrefixTreeLayout.from_parents([2 ** 31, 1], [-1, 0]), "outside int32"),
    (lambda: PrefixTreeLayout.from_parents([2 ** 30, 2 ** 30], [-1, 0]), "do not fit int32"),
    (lambda: PrefixTreeLayout.from_tensors(torch.tensor([0.0, 2.0]), _i32([-1])), "must hold integers"),
    (lambda: PrefixTreeLayout.from_tensors(torch.tensor([0, 2 ** 31]), _i32([-1])), "outside int32"),
    (lambda: PrefixTreeLayout.from_tensors(_i32([0]), _i32([])), "no nodes"),
    (lambda: PrefixTreeLayout.from_tensors(_i32([1, 3]), _i32([-1])), "must start at 0"),
    (lambda: PrefixTreeLayout.from_tensors(_i32([0, 3, 3]), _i32([-1, 0])), "node 1 has length 0"),
    (lambda: PrefixTreeLayout.from_tensors(_i32([0, 3, 5]), _i32([-1])), "len\\(parent\\) \\+ 1 = 2"),
    (lambda: PrefixTreeLayout.from_tensors(_i32([0, 3, 5]), _i32([-1, 0]), total_tokens=4),
     "sum to 5 tokens but there are 4"),
    (lambda: PrefixTreeLayout.from_tensors(torch.zeros(2, 2, dtype=torch.int32), _i32([-1])), "must be 1-D"),
    (lambda: PrefixTreeLayout.from_tensors(_i32([0, 3]).to("meta"), _i32([-1]).to("meta")), "no data"),
    (lambda: PrefixTreeLayout.from_parents([2, 3], [-1, 0], total_tokens=3.5), "total_tokens must be an integer"),
    (lambda: PrefixTreeLayout.from_parents({1: 1}, [-1]), "lengths must be an ordered sequence.*got dict"),
    (lambda: PrefixTreeLayout.from_parents([2], {-1}), "parents must be an ordered sequence.*got set"),
    (lambda: PrefixTreeLayout([1], [-1]), None),
])
def test_layout_refuses_malformed_input_in_one_line(build, match):
    if match is None:
        with pytest.raises(TypeError, match="from_parents"):
            build()
        return
    one_line_error(build, match)


@pytest.mark.parametrize("call, node, exc, match", [("path_index", -1, IndexError, "node -1 is out of range: valid "
    "nodes are 0..1"), ("ancestors_of", 10, IndexError, "node 10"), ("path_index", 0.5, ValueError, "an integer")])
def test_layout_node_index_is_checked(call, node, exc, match):
    pytest.raises(exc, getattr(PrefixTreeLayout.from_parents([2, 3], [-1, 0]), call), node).match(match)


# ====================================================================================================== packing
def _random_tree_trajectories(rng, n_roots=2, depth=3, vocab=50):
    """Trajectories from a random tree of turns (lengths 1..6 per turn, 1-3 children), some ending at inner
    turns, one duplicated."""
    out = []

    def grow(prefix, d):
        turn = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        seq = prefix + turn
        kids = rng.randint(1, 3) if d < depth else 0
        if kids == 0 or rng.random() < 0.2:
            out.append(seq)
        for _ in range(kids):
            grow(seq, d + 1)

    for _ in range(n_roots):
        grow([], 1)
    out.append(list(out[0]))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_pack_is_a_trie_with_every_trajectory_a_path(seed):
    rng = random.Random(seed)
    seqs = _random_tree_trajectories(rng, n_roots=rng.randint(1, 3), depth=rng.randint(1, 4), vocab=rng.choice([3, 50]))
    batch = kvt.pack_trajectories([torch.tensor(s) for s in seqs])
    batch.validate()
    prefixes = {tuple(s[:j]) for s in seqs for j in range(1, len(s) + 1)}
    assert batch.num_tokens == len(prefixes)  # every distinct prefix stored exactly once
    assert batch.replicated_tokens == sum(map(len, seqs))
    for i, s in enumerate(seqs):
        idx = batch.token_index(i)
        assert batch.input_ids[0, idx].tolist() == s
        assert batch.position_ids[0, idx].tolist() == list(range(len(s)))
    for bad, err in ((len(seqs), IndexError), (-1, IndexError), (0.5, ValueError)):  # (was a bare IndexError)
        with pytest.raises(err, match=r"trajectory .*(out of range: this batch holds trajectories 0\.\.|integer)"):
            batch.token_index(bad)
    # depth-first packing: descendants of each node are one contiguous token range
    lay = batch.layout
    assert all(int(lay.query_range_ptr[n + 1] - lay.query_range_ptr[n]) <= 1 for n in range(lay.num_nodes))



def test_pack_a_comb_deep_tree():
    """Trajectory i = a shared stem's first i tokens + its own token: a tree 1,500 nodes deep (each level one node
    of the stem, one leaf), built with tensor ops per node, not per member or token."""
    stem = torch.randint(0, 1000, (1500,))
    seqs = [torch.cat([stem[:i], torch.tensor([1000 + i])]) for i in range(1, 1500)]
    batch = kvt.pack_trajectories(seqs)
    lay = batch.layout
    assert lay.num_nodes == 1498 + 1499 and batch.num_tokens == 1498 + 1499 + 1  # the last leaf: stem token + own
    assert max(len(a) for a in lay._anc) == 1498  # the deepest leaf hangs under the whole stem
    for i in (0, 1, 700, 1498):
        idx = batch.token_index(i)
        assert torch.equal(batch.input_ids[0, idx], seqs[i])
        assert batch.position_ids[0, idx].tolist() == list(range(len(seqs[i])))
    lps = batch.trajectory_logprobs(torch.randn(batch.num_tokens, 2500))
    assert [lp.numel() for lp in lps[:3]] == [1, 2, 3] and lps[-1].numel() == 1499

@pytest.mark.parametrize("seqs, lengths, parents", [
    ([[1, 2, 3], [1, 2, 3]], [3], [-1]),                                   # identical
    ([[1, 2, 3, 4], [1, 2]], [2, 2], [-1, 0]),                             # one a prefix of the other
    ([[1, 2, 3], [4, 5], [6]], [3, 2, 1], [-1, -1, -1]),                   # nothing shared
    ([[7, 7, 7, 7, 7]], [5], [-1]),                                        # a single chain
    ([[1], [1], [2]], [1, 1], [-1, -1]),                                   # one-token trajectories
    ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [2, 1, 1, 1, 1], [-1, 0, 1, 1, 0]),  # depth 3
])
def test_pack_edge_cases(seqs, lengths, parents):
    batch = kvt.pack_trajectories(seqs)
    batch.validate()
    assert batch.layout.lengths == lengths and batch.layout.parents == parents
    lps = batch.trajectory_logprobs(torch.randn(batch.num_tokens, 10))
    assert [lp.numel() for lp in lps] == [len(s) - 1 for s in seqs]


def test_min_shared_duplicates_short_shared_runs():
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9], [1, 2, 3, 4, 7], [1, 2]]
    full = kvt.pack_trajectories(seqs)
    assert full.layout.lengths == [2, 1, 1, 1, 1, 3] and full.layout.parents == [-1, 0, 1, 2, 2, 1]
    short = kvt.pack_trajectories(seqs, min_shared=3)
    short.validate()
    # [1, 2] (2 tokens) and [4] (1 token) are duplicated; [1, 2, 3] (3 tokens) stays shared
    assert short.layout.lengths == [2, 3, 2, 2, 3] and short.layout.parents == [-1, -1, 1, 1, 1]
    for a, b in zip(full.trajectory_logprobs(torch.zeros(full.num_tokens, 10)),
                    short.trajectory_logprobs(torch.zeros(short.num_tokens, 10))):
        assert a.shape == b.shape
    assert kvt.pack_trajectories([[1, 2], [1, 2]], min_shared=3).layout.lengths == [2, 2]


def test_min_shared_default_and_threshold_on_a_long_context_tree():
    """The documented default (1: every shared run becomes a node) and the threshold: below ``min_shared`` the
    tiny run under a long shared context is copied into each branch ((k-1)·s more tokens, one node fewer, the long
    context still shared); at ``min_shared`` it stays one node. Log-probs of random logits agree either way."""
    import inspect

    assert inspect.signature(kvt.pack_trajectories).parameters["min_shared"].default == 1
    ctx, run = list(range(2, 302)), [900, 901, 902, 903]
    seqs = [ctx + run + [1000 + 10 * b + j for j in range(5)] for b in range(3)] + [ctx + [2000, 2001]]
    share = kvt.pack_trajectories(seqs)
    assert share.layout.lengths == [300, 4, 5, 5, 5, 2]
    for ms, dup in ((4, False), (5, True), (50, True)):
        b = kvt.pack_trajectories(seqs, min_shared=ms)
        b.validate()
        assert b.layout.lengths[0] == 300  # the long context is shared whatever the threshold
        assert b.num_tokens == share.num_tokens + (2 * len(run) if dup else 0)
        assert b.layout.num_nodes == share.layout.num_nodes - (1 if dup else 0)
        logits = torch.randn(b.num_tokens, 3000, generator=torch.Generator().manual_seed(0))
        lp = b.trajectory_logprobs(logits)
        ref = [torch.log_softmax(logits[b.token_index(i)], -1)[:-1].gather(-1, b.sequences[i][1:, None])[:, 0]
               for i in range(len(seqs))]
        assert all(torch.equal(x, y) for x, y in zip(lp, ref))


def test_trajectory_logprobs_gather_predecessor_rows_and_sum_gradients():
    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]
    batch = kvt.pack_trajectories(seqs)  # nodes [1, 2] [3] [4] [5]: packed 1 2 3 4 5
    logits = torch.randn(batch.num_tokens, 8, dtype=torch.float64, requires_grad=True)
    lps = batch.trajectory_logprobs(logits[None])
    ls = torch.log_softmax(logits, -1)
    assert torch.allclose(lps[0], torch.stack([ls[0, 2], ls[1, 3], ls[2, 4]]))
    assert torch.allclose(lps[1], torch.stack([ls[0, 2], ls[1, 5]]))  # row 1 (token 2) also predicts child [5]
    assert torch.allclose(lps[2], torch.stack([ls[0, 2], ls[1, 3]]))
    assert lps[0].dtype == torch.float64
    sum(lp.sum() for lp in lps).backward()
    ref = torch.zeros_like(logits)
    sm = torch.softmax(logits.detach(), -1)
    for row, tok in [(0, 2), (1, 3), (2, 4), (0, 2), (1, 5), (0, 2), (1, 3)]:
        ref[row] -= sm[row]
        ref[row, tok] += 1
    assert torch.allclose(logits.grad, ref)


def test_loss_masks():
    seqs = [[1, 2, 3, 4], [1, 2, 5]]
    masks = [torch.tensor([False, False, True, True]), [0, 0, 1]]
    batch = kvt.pack_trajectories(seqs, loss_masks=masks)
    got = batch.loss_mask_tensors()
    assert [m.tolist() for m in got] == [[False, True, True], [False, True]]
    assert [m.tolist() for m in kvt.pack_trajectories(seqs).loss_mask_tensors()] == [[True] * 3, [True] * 2]


@pytest.mark.parametrize("kwargs, match", [
    (dict(seqs=[]), "non-empty list"),
    (dict(seqs=torch.tensor([1, 2])), "non-empty list"),
    (dict(seqs=[[1, 2], []]), "trajectory 1 is empty"),
    (dict(seqs=[[1, 2.5]]), "not an integer token id"),
    (dict(seqs=[torch.tensor([1.0, 2.0])]), "integer token ids"),
    (dict(seqs=[torch.tensor([1, 2]).to_sparse()]), "trajectory 0 is a sparse_coo tensor: pass dense"),  # was aten
    (dict(seqs=[[3], torch.nested.nested_tensor([torch.tensor([1, 2])])]), "trajectory 1 is a nested tensor"),
    (dict(seqs=[[1, -3]]), "token id -3"),
    (dict(seqs=[[1, 99]], vocab_size=50), "outside the vocabulary"),
    (dict(seqs=[[1, 2]], loss_masks=[[True]]), "loss_masks\\[0\\] has 1 entries but trajectory 0 has 2"),
    (dict(seqs=[[1, 2]], loss_masks=[[True, 2]]), "loss masks hold bools"),
    (dict(seqs=[[1, 2]], loss_masks=[torch.tensor([0.5, 1.0])]), "must hold bools or 0/1 values"),
    (dict(seqs=[[1, 2]], loss_masks=[torch.tensor([float("nan"), 1.0])]), "must hold bools or 0/1 values"),
    (dict(seqs=[[1, 2]], loss_masks=[[1.0, 0.25]]), "loss masks hold bools or 0/1 values"),
    (dict(seqs=[[1, 2, 3]], loss_masks=[__import__("numpy").array([[1, 0, 1]])]), "loss masks hold bools"),
    (dict(seqs=[[1, 2, 3]], loss_masks=[[torch.tensor([1, 0]), 0, 1]]), "loss masks hold bools"),
    (dict(seqs=[[1, 2], [3]], loss_masks=[[True, True]]), "one mask per trajectory \\(2\\)"),
    (dict(seqs=[[1, 2]], min_shared=0), "min_shared must be an integer >= 1"),
    *[(dict(seqs=[[1, 2]], vocab_size=v), "vocab_size must be a positive integer") for v in (2.5, 0, -5, "100", True)],
    *[(dict(seqs=[[1, 2]], device=d), "device") for d in ("foo", "meta", "cuda:99")],
    (dict(seqs=[torch.tensor([1, 2], device="meta")]), "trajectory 0 is on the meta device"),
    (dict(seqs=[[1, 2]], loss_masks=[{True, False}]), r"loss_masks\[0\] is a set \(unordered\)"),
    (dict(seqs=[[1, 2]], loss_masks={(True, True)}), "loss_masks must be a list"),
    (dict(seqs={(1, 2)}), "pass a list, not a set"), (dict(seqs=[[1, 2 ** 64]]), "outside int64"),
    (dict(seqs=[__import__("numpy").array([3, 2 ** 63 + 5], dtype="uint64")]),
     "element 1 is 9223372036854775813, outside int64"),  # (not wrapped to a negative id)
])
def test_pack_refuses_malformed_input_in_one_line(kwargs, match):
    one_line_error(lambda: kvt.pack_trajectories(**kwargs), match)


@pytest.mark.parametrize("device", ["foo", "meta", "cuda:99"])
def test_layout_constructors_refuse_an_unusable_device_in_one_line(device):
    one_line_error(lambda: PrefixTreeLayout.from_parents([2, 1], [-1, 0], device=device), "device")
    one_line_error(lambda: kvt.DualKVLayout.from_lengths([(2, [1])], device=device), "device")


def test_pack_takes_float_and_integer_01_loss_masks():
    """RL loops keep masks as 0/1 floats or integers: the same trained tokens as bools."""
    seqs, want = [[1, 2, 3], [1, 2, 4]], [[True, False], [True, True]]
    np = __import__("numpy")
    for masks in ([torch.tensor([0.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])], [[0.0, 1.0, 0.0], [1, 1, 1]],
                  [list(torch.tensor([0.0, 1.0, 0.0])), [np.float32(1), np.int8(1), torch.tensor(True)]],
                  torch.tensor([[0, 1, 0], [1, 1, 1]], dtype=torch.int32), (m for m in [[0, 1, 0], [1, 1, 1]])):
        assert [m.tolist() for m in kvt.pack_trajectories(seqs, loss_masks=masks).loss_mask_tensors()] == want


def test_pack_takes_rows_of_a_2d_tensor_or_array_and_generators():
    for make in (torch.tensor, lambda x: __import__("numpy").array(x), lambda x: (r for r in x)):
        assert kvt.pack_trajectories(make([[1, 2, 3], [1, 2, 4]])).layout.lengths == [2, 1, 1]
    masks = [[False, True, True], [False, False, True]]  # loss masks as rows too; min_shared a NumPy integer
    for make in (torch.tensor, lambda x: __import__("numpy").array(x)):
        batch = kvt.pack_trajectories([[1, 2, 3], [1, 2, 4]], loss_masks=make(masks),
                                      min_shared=__import__("numpy").int64(2))
        assert [m.tolist() for m in batch.loss_mask_tensors()] == [[True, True], [False, True]]


def test_trajectory_logprobs_refuses_foreign_logits():
    batch = kvt.pack_trajectories([[1, 2, 3], [1, 4]])
    one_line_error(lambda: batch.trajectory_logprobs(torch.zeros(7, 10)), "do not belong to this batch")
    one_line_error(lambda: batch.trajectory_logprobs(torch.zeros(4, 3)), "vocabulary of 3")
    one_line_error(lambda: batch.trajectory_logprobs(torch.zeros(4, 10, dtype=torch.long)), "floating-point")
    one_line_error(lambda: batch.trajectory_logprobs(torch.zeros(2, 4, 10)), r"\(1, T, vocab\)")


# ====================================================================================================== kernels
def dense_reference(q, k, v, lay, scale):
    """float64 attention with the layout's dense (T, T) mask: independent of the node-by-node reference."""
    grp = q.shape[1] // k.shape[1]
    s = torch.einsum("thd,shd->hts", q, k.repeat_interleave(grp, 1)) * scale
    s = s.masked_fill(~lay.dense_mask(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v.repeat_interleave(grp, 1)), lse



# (lengths, parents, H, H_kv, D, dtype): depth 1 (roots only), a chain (depth 4), depth 2 (DualKV's shape), depth 3
# packed out of depth-first order (unmerged ranges), depth 4 with several trees; node lengths in {1, 15, 17}
CASES = [
    ([15, 1, 17], [-1, -1, -1], 4, 4, 64, torch.float32),
    ([17, 1, 15, 17], [-1, 0, 1, 2], 4, 1, 80, torch.float32),
    ([17, 15, 1, 17], [-1, 0, 0, 0], 4, 1, 64, torch.float16),
    ([15, 17, 1, 15, 17, 1], [-1, 0, 0, 1, 2, 1], 8, 2, 80, torch.float32),
    ([17, 15, 1, 17, 1, 15, 17, 15], [-1, 0, 1, 2, 2, -1, 5, 6], 4, 1, 80, torch.float16),
    ([1, 17, 15, 1, 15], [-1, 0, 1, 1, -1], 2, 2, 64, torch.float16),
]


def _case_id(c):
    lens, par, h, hkv, d, dt = c
    lay = PrefixTreeLayout.from_parents(lens, par)
    return f"depth{lay.depth}-trees{lay.num_trees}-T{lay.total_tokens}-H{h}-Hkv{hkv}-D{d}-{str(dt)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kernels_match_float64_under_the_numerics_rule(case):
    lens, parents, h, h_kv, d, dtype = case
    lay = PrefixTreeLayout.from_parents(lens, parents)
    t = lay.total_tokens
    q, k, v = torch.randn(t, h, d, dtype=dtype), torch.randn(t, h_kv, d, dtype=dtype), torch.randn(t, h_kv, d,
                                                                                                  dtype=dtype)
    do = torch.randn(t, h, d, dtype=dtype)
    scale = d ** -0.5
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    ref_out, ref_lse = dense_reference(qd, kd, vd, lay, scale)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), do.double())
    qp, kp, vp = (x.clone().requires_grad_(True) for x in (q, k, v))
    pt_out, pt_lse = K.prefix_tree_attention_reference(qp, kp, vp, lay, scale, upcast=False)
    pt_grads = torch.autograd.grad(pt_out, (qp, kp, vp), do)

    out, lse = K.prefix_tree_fwd(q, k, v, lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (h, t)
    check_rule("out", out, pt_out, ref_out, dtype)
    check_rule("lse", lse, pt_lse, ref_lse, dtype)
    args = (lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges, lay.query_range_ptr, lay.query_ranges, scale)
    grads = K.prefix_tree_bwd(do, q, k, v, out, lse, *args)
    for name, g, pg, rg in zip(("dq", "dk", "dv"), grads, pt_grads, ref_grads):
        assert g.dtype == dtype and g.shape == rg.shape
        check_rule(name, g, pg, rg, dtype)
    again = K.prefix_tree_bwd(do, q, k, v, out, lse, *args)
    assert all(torch.equal(a, b) for a, b in zip(grads, again)), "backward not bitwise deterministic"


@pytest.mark.parametrize("cfg", [
    {"fwd": dict(BLOCK_M=16, BLOCK_N=16, PACK=True), "dq": dict(BLOCK_M=16, BLOCK_N=16, PACK=True),
     "dkdv": dict(BLOCK_M=16, BLOCK_N=32)},
    {"fwd": dict(BLOCK_M=32, BLOCK_N=16), "dq": dict(BLOCK_M=16, BLOCK_N=32), "dkdv": dict(BLOCK_M=16, BLOCK_N=16)},
], ids=["gqa-packed-16", "mixed-blocks"])
def test_kernels_other_launch_configs(cfg):
    _fp32_kernels_match_dense(PrefixTreeLayout.from_parents([33, 17, 1, 40, 5], [-1, 0, 1, 0, 3]), 64, 0.125, cfg)


def _fp32_kernels_match_dense(lay, d, scale, cfg):
    """The fp32 kernels (launch ``cfg``) against the dense float64 reference: out, lse and every gradient (H 4,
    H_kv 2)."""
    t = lay.total_tokens
    q, k, v = torch.randn(t, 4, d), torch.randn(t, 2, d), torch.randn(t, 2, d)
    do = torch.randn_like(q)
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    ref_out, ref_lse = dense_reference(qd, kd, vd, lay, scale)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), do.double())
    out, lse = K.prefix_tree_fwd(q, k, v, lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges, scale, config=cfg)
    grads = K.prefix_tree_bwd(do, q, k, v, out, lse, lay.cu_seqlens, lay.key_range_ptr, lay.key_ranges,
                              lay.query_range_ptr, lay.query_ranges, scale, config=cfg)
    assert maxerr(out, ref_out) < 1e-5 and maxerr(lse, ref_lse) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert maxerr(g, r) < 5e-5


@pytest.mark.parametrize("cfg", [None, {"fwd": dict(BLOCK_M=16, BLOCK_N=16), "dq": dict(BLOCK_M=16, BLOCK_N=16)}],
                         ids=["default", "blocks-16"])
def test_kernels_walk_ancestor_ranges_with_and_without_whole_blocks(cfg):
    """dQ's flat walk over a node's ancestor ranges (and the forward's loop over them): node 5's ancestors are three
    separate ranges ([0, 40), [90, 96), [116, 148)): one with whole blocks and a ragged tail, one shorter than a
    block (skipped by the whole-block walk, only its tail), one a whole multiple of the block (no tail: a fully
    masked step)."""
    lay = PrefixTreeLayout.from_parents([40, 50, 6, 20, 32, 9], [-1, 0, 0, 2, 2, 4])
    assert lay.key_ranges[lay.key_range_ptr[5]:lay.key_range_ptr[6]].tolist() == [[0, 40], [90, 96], [116, 148]]
    _fp32_kernels_match_dense(lay, 32, 0.2, cfg)


@pytest.mark.parametrize("cfg", [None, {"fwd": dict(BLOCK_M=16, BLOCK_N=16), "dq": dict(BLOCK_M=16, BLOCK_N=16)}],
                         ids=["default", "blocks-16"])
def test_kernels_walk_more_than_four_ancestor_ranges(cfg):
    """The forward's and dQ's walks address the first four ancestor ranges' whole blocks from the loop counter and
    walk any deeper ones: a leaf with six separate ancestor ranges (a side branch packed between each level and the
    next), ranges with and without whole blocks and tails on both sides of the fourth."""
    lens = [40, 3, 6, 3, 32, 3, 17, 3, 33, 3, 20, 3, 9]
    parents = [-1, 0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    lay = PrefixTreeLayout.from_parents(lens, parents)
    leaf = len(lens) - 1
    assert len(lay.key_ranges[lay.key_range_ptr[leaf]:lay.key_range_ptr[leaf + 1]]) == 6
    _fp32_kernels_match_dense(lay, 32, 0.2, cfg)


def test_whole_range_next_skips_ranges_without_a_whole_block():
    from kvtransform.kernels.attention_tiles import whole_range_next

    lo = torch.tensor([0, 90, 116, 200, 300], dtype=torch.int32)
    hi = torch.tensor([40, 96, 148, 210, 301], dtype=torch.int32)
    assert whole_range_next(lo, hi, 16).tolist() == [0, 2, 2, 5, 5, 5]
    assert whole_range_next(lo, hi, 64).tolist() == [5] * 6
    assert whole_range_next(lo[:0], hi[:0], 16).tolist() == [0]


def test_references_agree_in_float64():
    lay = PrefixTreeLayout.from_parents([5, 3, 1, 4, 2, 6], [-1, 0, 1, 0, -1, 4])
    t = lay.total_tokens
    q, k, v = (torch.randn(t, hh, 16, dtype=torch.float64, requires_grad=True) for hh in (4, 2, 2))
    do, dl = torch.randn(t, 4, 16, dtype=torch.float64), torch.randn(4, t, dtype=torch.float64)
    a, la = K.prefix_tree_attention_reference(q, k, v, lay, 0.3)
    b, lb = dense_reference(q, k, v, lay, 0.3)
    assert maxerr(a, b) < 1e-12 and maxerr(la, lb) < 1e-12
    ref = torch.autograd.grad((a, la), (q, k, v), (do, dl))
    got = K.prefix_tree_attention_reference_backward(do, dl, q.detach(), k.detach(), v.detach(), lay, 0.3)
    assert all(maxerr(g, r) < 1e-12 for g, r in zip(got, ref))


@pytest.mark.parametrize("use_triton", [False, True], ids=["cpu-reference", "triton-interpreter"])
def test_op_autograd_with_lse_grad(use_triton, monkeypatch):
    monkeypatch.setattr(tree_ops, "USE_TRITON_ON_CPU", use_triton)
    lay = PrefixTreeLayout.from_parents([17, 15, 1, 16], [-1, 0, 1, 0])
    t = lay.total_tokens
    q, k, v = torch.randn(t, 4, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    qd, kd, vd = (x.double().requires_grad_(True) for x in (q, k, v))
    ref_out, ref_lse = dense_reference(qd, kd, vd, lay, 0.11)
    do, dl = torch.randn_like(q), torch.randn(4, t)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), (qd, kd, vd), (do.double(), dl.double()))
    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
    out, lse = kvt.prefix_tree_attention(qq, kk, vv, lay, softmax_scale=0.11, return_lse=True)
    assert maxerr(out, ref_out) < 1e-5 and maxerr(lse, ref_lse) < 1e-5
    grads = torch.autograd.grad((out, lse), (qq, kk, vv), (do, dl))
    assert all(maxerr(g, r) < 5e-5 for g, r in zip(grads, ref_grads))
    assert torch.equal(kvt.prefix_tree_attention(qq, kk, vv, lay), kvt.prefix_tree_attention(qq, kk, vv, lay, 0.125))


def test_opcheck():
    lay = PrefixTreeLayout.from_parents([5, 3, 2, 1], [-1, 0, 0, -1])
    t = lay.total_tokens
    q, k, v = (torch.randn(t, hh, 16, requires_grad=True) for hh in (4, 2, 2))
    torch.library.opcheck(torch.ops.kvt.prefix_tree_attention.default, (q, k, v, *lay.kernel_tensors(), 0.25))


def test_op_refuses_bad_inputs_in_one_line():
    lay = PrefixTreeLayout.from_parents([5, 3], [-1, 0])
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    one_line_error(lambda: kvt.prefix_tree_attention(q, k, v, (lay.cu_seqlens, lay.parent)), "PrefixTreeLayout")
    one_line_error(lambda: kvt.prefix_tree_attention(q[:7], k[:7], v[:7], lay), "sum to 8 tokens but q has T=7")
    one_line_error(lambda: kvt.prefix_tree_attention(q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), lay),
                   "divisible")
    one_line_error(lambda: kvt.prefix_tree_attention(q, k.half(), v, lay), "one dtype")
    one_line_error(lambda: kvt.prefix_tree_attention(*(torch.randn(8, 2, 300) for _ in range(3)), lay),
                   "unsupported head_dim 300")
    # the raw op (what a transformed graph calls) re-derives the ranges on the host for CPU tensors
    bad = list(lay.kernel_tensors())
    bad[3] = torch.tensor([[0, 4]], dtype=torch.int32)
    one_line_error(lambda: torch.ops.kvt.prefix_tree_attention(q, k, v, *bad, 0.25), "key_ranges does not match")
    bad = list(lay.kernel_tensors())
    bad[1] = torch.tensor([-1, 1], dtype=torch.int32)
    one_line_error(lambda: torch.ops.kvt.prefix_tree_attention(q, k, v, *bad, 0.25), "its own parent")
    bad = list(lay.kernel_tensors())
    bad[0] = torch.tensor([0, 5, 8], dtype=torch.int64)
    one_line_error(lambda: torch.ops.kvt.prefix_tree_attention(q, k, v, *bad, 0.25), "cu_seqlens must be int32")


@pytest.mark.parametrize("scale, d, dev, match", [(x, 16, "cpu", "softmax_scale must be a finite") for x in (
    float("nan"), float("inf"), "a", True)] + [(0, 0, "cpu", "dim 0:"), (1, 16, "meta", "meta"), (.3, 16, "cpu", 0)])
def test_wrapper_checks_scale_head_dim_meta_and_float64_lse(scale, d, dev, match):
    lay, (q, k, v) = PrefixTreeLayout.from_parents([5, 3], [-1, 0]), torch.randn(3, 8, 2, d).double().to(dev)
    run = lambda: kvt.prefix_tree_attention(q, k, v, lay, softmax_scale=scale, return_lse=True)  # noqa: E731
    if match:
        return one_line_error(run, match)
    (out, lse), want = run(), K.prefix_tree_attention_reference(q, k, v, lay, 0.3)[1]  # fp64 lse, computed in fp64
    assert out.dtype == lse.dtype == want.dtype == torch.float64 and torch.equal(lse, want)


# ====================================================================================================== model level
def _tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query (1, H, T, D), key/value (1, H_kv, T, D) -> ((1, T, H, D), None),
    tree attention over the ``prefix_tree_layout`` keyword argument of the model's forward."""
    layout = kwargs["prefix_tree_layout"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return kvt.prefix_tree_attention(q, k, v, layout, softmax_scale=scaling)[None], None


@pytest.mark.parametrize("use_triton", [False, True], ids=["cpu-reference", "triton-interpreter"])
def test_tiny_llama_on_a_packed_tree_equals_separate_runs(use_triton, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    monkeypatch.setattr(tree_ops, "USE_TRITON_ON_CPU", use_triton)
    transformers.AttentionInterface.register("kvt_tree", _tree_attention)
    AttentionMaskInterface.register("kvt_tree", sdpa_mask)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    model.set_attn_implementation("sdpa")
    ref = copy.deepcopy(model).double()
    # a system prompt + task shared by all, then three turns branching 2 ways (depth 4), one trajectory a prefix of
    # another, one trajectory sharing nothing
    r = lambda n: torch.randint(0, 61, (n,))  # noqa: E731
    sys_task, a, b = r(13), r(7), r(5)
    lone = r(9)
    lone[0] = (sys_task[0] + 1) % 61  # shares nothing, not even a first token (else one tree, not two)
    b[0] = (a[0] + 1) % 61  # the two turns after the task branch at their first token
    seqs = [torch.cat([sys_task, a, r(4), r(3)]), torch.cat([sys_task, a, r(6)]), torch.cat([sys_task, b, r(2)]),
            torch.cat([sys_task, b]), lone]
    seqs.insert(1, torch.cat([seqs[0][:24], r(5)]))
    masks = [torch.rand(s.numel()) < 0.7 for s in seqs]
    batch = kvt.pack_trajectories(seqs, loss_masks=masks, vocab_size=61)
    assert batch.layout.depth >= 4 and batch.layout.num_trees == 2 and batch.token_ratio > 1.5
    adv = torch.randn(len(seqs), dtype=torch.float64)

    def loss_terms(lps):  # masked per-trajectory sums: what a GRPO-style loss weights by advantages
        return [lp * m.to(lp.dtype) for lp, m in zip(lps, batch.loss_mask_tensors())]

    def separate(m):
        out = []
        for s in seqs:
            lg = m(input_ids=s[None], use_cache=False).logits[0]
            work = torch.float64 if lg.dtype == torch.float64 else torch.float32
            out.append(torch.log_softmax(lg[:-1].to(work), -1).gather(1, s[1:, None])[:, 0])
        return out

    names, ps = zip(*trainable_parameters(model))
    ps64 = [dict(trainable_parameters(ref))[n] for n in names]
    lp64 = loss_terms(separate(ref))
    x64 = [torch.cat(lp64).detach()] + _loss_grads(lp64, adv, ps64)
    lp32 = loss_terms(separate(model))
    x32 = [torch.cat(lp32).detach()] + _loss_grads(lp32, adv.float(), list(ps))
    model.set_attn_implementation("kvt_tree")
    logits = model(batch.input_ids, position_ids=batch.position_ids, prefix_tree_layout=batch.layout,
                   use_cache=False).logits
    lpt = loss_terms(batch.trajectory_logprobs(logits))
    xt = [torch.cat(lpt).detach()] + _loss_grads(lpt, adv.float(), list(ps))
    for name, a_t, a_32, a_64 in zip(("logprobs",) + names, xt, x32, x64):
        e_t, e_32 = _rel(a_t, a_64)[1], _rel(a_32, a_64)[1]
        assert e_t <= 2 * e_32 + 1e-5, f"{name}: packed tree error {e_t:.3g} > 2 x separate runs' {e_32:.3g} + 1e-5"


@pytest.mark.parametrize("which, value", [("key_ranges", [[-5, 1000]]), ("key_ranges", [[6, 2]]),
                                          ("key_range_ptr", [0, 7, 1]), ("cu_seqlens", [0, 40, 8])])
def test_kernels_clamp_inconsistent_layouts_and_the_device_check_refuses_them(which, value):
    """What the CUDA path gets past the wrapper: the kernels read and write only inside their tensors (NaN guard
    rows after each would show), and the device-side assert's condition is False."""
    lay = PrefixTreeLayout.from_parents([5, 3], [-1, 0])
    t = lay.total_tokens
    bufs = [torch.full((t + 8, hh, 16), float("nan")) for hh in (2, 1, 1)]
    q, k, v = (b[:t].normal_() for b in bufs)
    tensors = dict(zip(("cu_seqlens", "parent", "key_range_ptr", "key_ranges", "query_range_ptr", "query_ranges"),
                       lay.kernel_tensors()))
    tensors[which] = torch.tensor(value, dtype=torch.int32)
    assert not bool(tree_ops.structure_ok(t, *tensors.values()))
    assert bool(tree_ops.structure_ok(t, *lay.kernel_tensors()))
    out, lse = K.prefix_tree_fwd(q, k, v, tensors["cu_seqlens"], tensors["key_range_ptr"], tensors["key_ranges"],
                                 0.25)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    grads = K.prefix_tree_bwd(torch.randn_like(q), q, k, v, out, lse, tensors["cu_seqlens"], tensors["key_range_ptr"],
                              tensors["key_ranges"], tensors["query_range_ptr"], tensors["query_ranges"], 0.25)
    assert all(torch.isfinite(g).all() for g in grads)
