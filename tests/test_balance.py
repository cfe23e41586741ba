"""kvt.balance_groups: every group exactly once, never split, LPT bounds, micro-batch limits, clear errors."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtransform as kvt
from kvtransform.balance import group_tokens

group_st = st.tuples(st.integers(1, 300), st.lists(st.integers(1, 200), min_size=1, max_size=8))


def _flat(plan):
    if plan.max_tokens is None:
        return [i for r in plan.indices for i in r]
    return [i for r in plan.indices for mb in r for i in mb]


@settings(max_examples=150, deadline=None)
@given(st.lists(group_st, min_size=1, max_size=40), st.integers(1, 9))
def test_ranks_every_group_once_and_lpt_bound(groups, world_size):
    plan = kvt.balance_groups(groups, world_size)
    assert sorted(_flat(plan)) == list(range(len(groups)))
    sizes = [p + sum(rs) for p, rs in groups]
    assert plan.tokens == [sum(sizes[i] for i in r) for r in plan.indices]
    assert sum(plan.tokens) == sum(sizes)
    # LPT: the most loaded rank exceeds the mean by at most one group, and is within 4/3 of the lower bound
    # max(mean, largest group) plus that bound's slack.
    mean = sum(sizes) / world_size
    assert max(plan.tokens) <= mean + max(sizes)
    assert max(plan.tokens) <= (4 / 3) * max(mean, max(sizes)) + max(sizes) / 3 + 1e-9
    assert [[groups[i] for i in r] for r in plan.indices] == plan.ranks


@settings(max_examples=150, deadline=None)
@given(st.lists(group_st, min_size=1, max_size=40), st.integers(1, 6), st.integers(0, 3000))
def test_micro_batches_respect_max_tokens(groups, world_size, extra):
    sizes = [p + sum(rs) for p, rs in groups]
    cap = max(sizes) + extra
    plan = kvt.balance_groups(groups, world_size, max_tokens=cap)
    assert sorted(_flat(plan)) == list(range(len(groups)))
    m = plan.num_micro_batches
    assert all(len(r) == m for r in plan.indices)  # same number of passes on every rank
    for r, toks in zip(plan.indices, plan.micro_batch_tokens):
        assert [sum(sizes[i] for i in mb) for mb in r] == toks
        assert all(t <= cap for t in toks)
        assert toks == sorted(toks, reverse=True)
    # never more micro-batches than first-fit decreasing needs on the fullest rank; at least the volume bound
    assert m >= -(-max(plan.tokens) // cap)


def test_balanced_example_and_token_sequences():
    gs = [([1, 2, 3], [[4], [5, 6]]), (torch.arange(7), [torch.arange(5), 3]), (4, [4, 4, 4]), (2, [1])]
    assert [group_tokens(g) for g in gs] == [6, 15, 16, 3]
    plan = kvt.balance_groups(gs, 2)
    assert sorted(plan.tokens) == [19, 21] and plan.imbalance == pytest.approx(21 / 20)
    assert "max/mean 1.050" in plan.summary()
    plan = kvt.balance_groups(gs, 4, max_tokens=16)
    assert plan.num_micro_batches == 1 and sorted(plan.tokens) == [3, 6, 15, 16]
    plan = kvt.balance_groups(gs, 8)  # more ranks than groups: some ranks idle
    assert plan.tokens.count(0) == 4


@pytest.mark.parametrize("args, match", [
    (([], 2), "non-empty list"),
    (([(3, [1])], 0), "world_size must be an integer >= 1"),
    (([(3, [1])], 2.0), "world_size must be an integer >= 1"),
    (([(3, [])], 1), "group 0 has no responses"),
    (([(3, [2]), (0, [1])], 1), "group 1: prompt has 0 tokens"),
    (([(3, [2]), (1, [[]])], 1), "group 1: response 0 has 0 tokens"),
    (([(3, [2]), "abc"], 1), "group 1 must be a pair"),
    (([(3, [2])], 1, 0), "max_tokens must be a positive integer"),
    (([(3, [2])], 1, 2.5), "max_tokens must be an integer >= 1"),
    (([(3, [1])], True), "world_size must be an integer >= 1"),
])
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        kvt.balance_groups(*args)


def test_numpy_and_torch_integers_as_world_size_and_max_tokens():
    np = pytest.importorskip("numpy")
    plan = kvt.balance_groups([(10, [5]), (3, [2])], np.int64(2), max_tokens=torch.tensor(30))
    assert plan == kvt.balance_groups([(10, [5]), (3, [2])], 2, max_tokens=30)


def test_group_larger_than_max_tokens_names_it_and_the_fix():
    with pytest.raises(ValueError, match=r"group 1 packs to 30 tokens .* > max_tokens=12.*raise max_tokens to at "
                                         r"least 30"):
        kvt.balance_groups([(5, [3]), (10, [10, 10])], 2, max_tokens=12)


@pytest.mark.parametrize("max_tokens", [None, 16])
def test_plan_is_a_sequence_of_ranks(max_tokens):
    """The documented contract: ``balance_groups`` returns per-rank lists (``for rank_groups in plan``,
    ``plan[rank]``, ``len(plan) == world_size``), with the named fields kept."""
    from collections.abc import Sequence

    gs = [([1, 2, 3], [[4], [5, 6]]), (torch.arange(7), [torch.arange(5), 3]), (4, [4, 4, 4]), (2, [1])]
    plan = kvt.balance_groups(gs, 3, max_tokens=max_tokens)
    assert isinstance(plan, Sequence) and isinstance(plan, kvt.GroupBalance)
    assert len(plan) == 3
    assert list(plan) == plan.ranks
    assert [rank_groups for rank_groups in kvt.balance_groups(gs, 3, max_tokens=max_tokens)] == plan.ranks
    assert plan[0] == plan.ranks[0] and plan[-1] == plan.ranks[-1] and plan[1:] == plan.ranks[1:]
    with pytest.raises(IndexError):
        plan[3]
    r0, r1, r2 = plan  # unpacking, as per-rank lists
    assert r2 == plan.ranks[2]
    assert plan.tokens and plan.indices and "groups on 3 ranks" in plan.summary()


# ---------------------------------------------------------------------------------------------- prefix trees
def _tree(gen, prefix, branches, depth):
    """Trajectories of a random tree: a shared ``prefix`` of ids, ``branches`` children per level, ``depth`` levels
    of random 1..12-token turns."""
    paths = [torch.randint(0, 500, (prefix,), generator=gen)]
    for _ in range(depth):
        paths = [torch.cat([p, torch.randint(0, 500, (int(torch.randint(1, 13, (1,), generator=gen)),),
                                             generator=gen)]) for p in paths for _ in range(branches)]
    return paths


def test_tree_cost_counts_packed_tokens_and_visible_pairs():
    from kvtransform.balance import PAIR_WEIGHT, tree_cost

    tree = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 7]]  # trie: [1 2] -> [3] -> [4], [5 6]; [1 2] -> [7]
    tokens, pairs, cost = tree_cost(tree)
    assert tokens == 7 < sum(map(len, tree))
    b = kvt.pack_trajectories(tree)
    assert pairs == b.layout.visible_pairs() == int(b.layout.dense_mask().sum())
    assert cost == pytest.approx(tokens + PAIR_WEIGHT * pairs)
    assert tree_cost(tree, pair_weight=0.5)[2] == pytest.approx(7 + 0.5 * pairs)
    plan = kvt.balance_groups([tree, [[9, 9]]], 1, trees=True, pair_weight=0.5)
    assert plan.tokens == [9] and plan.group_tokens == [7, 2]
    assert plan.costs == [pytest.approx(7 + 0.5 * pairs + 2 + 0.5 * 3)] and "2 trees on 1 ranks" in plan.summary()


@pytest.mark.parametrize("max_tokens", [None, 700])
def test_trees_never_split_and_beat_round_robin_on_skewed_trees(max_tokens):
    gen = torch.Generator().manual_seed(0)
    # skewed: a few deep, wide agentic trees with long prompts among many small ones
    trees = [_tree(gen, 200, 3, 3) for _ in range(3)] + [_tree(gen, int(torch.randint(5, 60, (1,), generator=gen)),
                                                               2, 1) for _ in range(29)]
    trees = [trees[i] for i in torch.randperm(len(trees), generator=gen).tolist()]
    plan = kvt.balance_groups(trees, 4, max_tokens=max_tokens, trees=True, pair_weight=0.01)
    flat = _flat(plan)
    assert sorted(flat) == list(range(len(trees)))  # each tree exactly once, whole
    items = [t for r in plan.ranks for t in (r if max_tokens is None else [x for mb in r for x in mb])]
    assert all(any(x is t for t in trees) for x in items)
    if max_tokens is not None:
        assert all(t <= max_tokens for r in plan.micro_batch_tokens for t in r)
        assert all(len(r) == plan.num_micro_batches for r in plan.indices)
    cost = plan.group_costs
    rr = [sum(cost[i] for i in range(r, len(trees), 4)) for r in range(4)]
    assert max(plan.costs) < 0.8 * max(rr)  # round-robin leaves a rank with two of the three big trees
    assert max(plan.costs) <= sum(cost) / 4 + max(cost) + 1e-6  # the LPT bound, in cost
    # what a rank packs: its trees' tries (never more tokens than the plan counts)
    r0 = plan.ranks[0] if max_tokens is None else [t for mb in plan.ranks[0] for t in mb]
    assert kvt.pack_trajectories([s for t in r0 for s in t]).num_tokens <= plan.tokens[0]


def test_tree_cost_weights_attention_work():
    """Equal packed tokens, different attention work: one long chain vs many short roots; the pair weight moves
    the balance, pair_weight=0 balances tokens only."""
    from kvtransform.balance import tree_cost

    chain = [list(range(1, 201))]
    bush = [[1000 + i] + [7] * 9 for i in range(20)]  # 20 trajectories of 10 tokens sharing nothing
    (tc, pc, _), (tb, pb, _) = tree_cost(chain), tree_cost(bush)
    assert tc == tb == 200 and pc > 10 * pb
    assert kvt.balance_groups([chain, bush], 2, trees=True, pair_weight=0).imbalance == 1.0
    assert kvt.balance_groups([chain, bush], 2, trees=True, pair_weight=0.1).imbalance > 1.5


@pytest.mark.parametrize("args, kwargs, match", [
    (([], 2), {"trees": True}, "non-empty list of trees"),
    (((t for t in []), 2), {"trees": True}, "non-empty list of trees"),
    (({0: [[1, 2]]}, 2), {"trees": True}, r"takes a list of trees .*, not a dict \(the plan gives each tree by its"),
    (({0: ([1], [[2]])}, 2), {}, r"takes a list of \(prompt, \[responses\]\) groups, not a dict"),
    (([[[1, 2]], []], 2), {"trees": True}, "tree 1 must be a non-empty list of trajectories"),
    (([[[1, 2]], [[1, 2], []]], 2), {"trees": True}, "tree 1: trajectory 1"),
    (([[[1, 2]], torch.tensor([1, 2])], 2), {"trees": True}, r"tree 1 must be a non-empty list.*of shape \(2,\)"),
    (([torch.zeros(2, 2, 2, dtype=torch.long)], 2), {"trees": True}, r"tree 0 .* or a 2-D tensor of them as rows"),
    (([([1, 2], [[3], [4, 5]])], 2), {"trees": True}, "pass trees=False"),
    (([[[1, 2, 3], [1, 2, 4], [1, 5]]], 2), {}, "pass trees=True"),
    (([[[1, 2]]], 2), {"trees": True, "pair_weight": -1.0}, "pair_weight must be a finite number >= 0"),
    (([[[1, 2, 3, 4]], [[1] * 9, [1] * 8 + [2]]], 2, 5), {"trees": True},
     r"tree 1 packs to 10 tokens .* > max_tokens=5.*raise max_tokens to at least 10"),
])
def test_tree_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvt.balance_groups(*args, **kwargs)


def test_a_tree_as_a_2d_tensor_or_array_is_its_rows():
    """A tree given as a 2-D tensor or NumPy array (equal-length trajectories as rows, as pack_trajectories takes
    it) costs what its rows as a list cost."""
    rows = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 7, 8, 9]]
    as_list = kvt.balance_groups([rows, [[5, 6]]], 2, trees=True, max_tokens=64, min_shared=2)
    for tree in (torch.tensor(rows), np.array(rows)):
        plan = kvt.balance_groups([tree, [[5, 6]]], 2, trees=True, max_tokens=64, min_shared=2)
        assert (plan.indices, plan.tokens, plan.costs) == (as_list.indices, as_list.tokens, as_list.costs)


def test_a_groups_responses_as_a_2d_tensor_or_array_are_its_rows():
    """A group's responses as a 2-D tensor or NumPy array (rows), which pack_shared_prefix_groups takes, cost what
    the rows as a list cost (they were refused); a 1-D tensor stays refused (lengths or one response?)."""
    prompt, rows = [5, 6, 7], [[8, 9], [10, 11], [12, 13]]
    as_list = kvt.balance_groups([(prompt, rows), ([1], [[2]])], 2)
    for responses in (torch.tensor(rows), np.array(rows)):
        plan = kvt.balance_groups([(torch.tensor(prompt), responses), ([1], [[2]])], 2)
        assert (plan.indices, plan.tokens) == (as_list.indices, as_list.tokens)
    assert kvt.pack_shared_prefix_groups([(torch.tensor(prompt), torch.tensor(rows))]).num_tokens == 9
    with pytest.raises(ValueError, match="group 0: responses must be .* or a 2-D tensor / array of responses"):
        kvt.balance_groups([(prompt, torch.tensor([8, 9]))], 1)


def test_the_plan_prints_as_its_summary():
    """repr(plan) is its one-line summary (the generated repr printed every group's token ids)."""
    plan = kvt.balance_groups([([1] * 50, [[2] * 9, [3] * 7]), ([4] * 5, [[5] * 3])], 2)
    assert repr(plan) == f"GroupBalance({plan.summary()}; .ranks / .indices per rank)" and "[1, 1" not in repr(plan)


def test_groups_from_a_generator():
    trees = [[[1, 2, 3], [1, 2, 4]], [[5, 6]], [[7, 8, 9, 10]]]
    plan = kvt.balance_groups((t for t in trees), 2, trees=True)
    assert plan.indices == kvt.balance_groups(trees, 2, trees=True).indices
    assert sorted(g for r in plan.ranks for g in r) == sorted(trees)


@pytest.mark.parametrize("kwargs, match", [
    ({"trees": True, "pair_weight": float("inf")}, r"pair_weight must be a finite number >= 0 .*; got inf"),
    ({"trees": True, "pair_weight": float("nan")}, r"pair_weight must be a finite number >= 0 .*; got nan"),
    ({"trees": True, "pair_weight": -0.5}, r"pair_weight must be a finite number >= 0 .*; got -0.5"),
    ({"trees": True, "pair_weight": "0.1"}, r"pair_weight must be a finite number >= 0"),
    ({"trees": True, "pair_weight": __import__("numpy").bool_(True)}, r"pair_weight must be a finite number >= 0"),
    ({"trees": "no"}, r"trees must be True .* or False .*; got 'no'"),
    ({"trees": 1}, r"trees must be True"),
    ({"pair_weight": 0.1}, r"pair_weight applies to prefix trees only: pass trees=True"),
    ({"trees": False, "pair_weight": 0}, r"pair_weight applies to prefix trees only"),
    ({"min_shared": 4}, r"min_shared applies to prefix trees only: pass trees=True"),
    ({"trees": True, "min_shared": 0}, r"min_shared"),
])
def test_tree_flags_are_checked(kwargs, match):
    """pair_weight finite and >= 0, trees a bool, pair_weight refused without trees=True: one line each."""
    with pytest.raises(ValueError, match=match):
        kvt.balance_groups([[[1, 2]]], 2, **kwargs)


def test_tree_cost_checks_pair_weight():
    from kvtransform.balance import tree_cost

    with pytest.raises(ValueError, match="pair_weight must be a finite number >= 0"):
        tree_cost([[1, 2]], pair_weight=float("inf"))


def test_tree_batch_is_refused_with_the_fix():
    b = kvt.pack_trajectories([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match=r"tree 0 is a TreeBatch: pass its trajectories \(batch.sequences\)"):
        kvt.balance_groups([b], 2, trees=True)
    with pytest.raises(ValueError, match="pass trees=True"):
        kvt.balance_groups([b], 2)


def test_tree_plan_holds_max_tokens_for_the_min_shared_the_ranks_pack_with():
    """A prefix shorter than min_shared is stored once per trajectory: the plan counts it so, and every micro-batch
    packed with that min_shared fits max_tokens (planned with the default 1 one packed to 480 > 420 tokens)."""
    g = torch.Generator().manual_seed(0)
    trees = [[torch.cat([torch.full((20,), t), torch.randint(10, 99, (60,), generator=g)]) for _ in range(3)]
             for t in range(1, 5)]  # 4 trees: 3 trajectories sharing a 20-token prompt each
    for min_shared, micro_batches in ((1, 2), (32, 4)):
        plan = kvt.balance_groups(trees, 1, max_tokens=420, trees=True, min_shared=min_shared)
        assert plan.num_micro_batches == micro_batches
        for mb in plan[0]:
            packed = kvt.pack_trajectories([s for tree in mb for s in tree], min_shared=min_shared)
            assert packed.num_tokens <= 420, (min_shared, packed.num_tokens)


def test_tree_plan_counts_micro_batches_where_merging_trees_adds_tokens():
    """With min_shared > 1, trees packed together can take more tokens than apart: a run two trees share cuts a run
    of one of them, and the piece below min_shared is copied into each branch (19 planned tokens packed to 29). The
    plan packs each micro-batch to count it and plans again, so every micro-batch fits max_tokens."""
    a = [[1, 2, 3, 4, 5, 6, 100 + i] for i in range(8)]  # 8 trajectories sharing 6 tokens: 14 tokens alone
    b = [[1, 2, 3, 4, 50]]  # shares 4 of them: 5 tokens alone; together the 2-token rest is copied 8 times
    assert kvt.pack_trajectories(a + b, min_shared=4).num_tokens == 29
    plan = kvt.balance_groups([a, b], 1, max_tokens=19, trees=True, min_shared=4)
    for mb, tokens in zip(plan[0], plan.micro_batch_tokens[0]):
        packed = kvt.pack_trajectories([s for tree in mb for s in tree], min_shared=4).num_tokens
        assert packed == tokens <= 19
    assert plan.num_micro_batches == 2  # (planned by sizes alone: one micro-batch of 19)
    many = [[[t, 2, 3, 4, 5, 6, 100 + i] for i in range(8)] for t in range(1, 4)] + [[[t, 2, 3, 4, 50]] for t in
                                                                                    range(1, 4)]
    plan = kvt.balance_groups(many, 2, max_tokens=20, trees=True, min_shared=4)
    for rank, counts in zip(plan, plan.micro_batch_tokens):
        for mb, tokens in zip(rank, counts):
            assert kvt.pack_trajectories([s for t in mb for s in t], min_shared=4).num_tokens == tokens <= 20
