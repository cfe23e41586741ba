"""kvt.balance_groups: every group exactly once, never split, LPT bounds, micro-batch limits, clear errors."""
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
])
def test_errors(args, match):
    with pytest.raises(ValueError, match=match):
        kvt.balance_groups(*args)


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
