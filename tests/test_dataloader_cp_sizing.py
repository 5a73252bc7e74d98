"""Dynamic CP sizing: the smallest CP size under budget, and even work across the ranks of a step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from services.dataloader.cp_sizing import (CPBudget, attention_cost, deal_by_cost, choose_cp_size, dp_rank_time,
                                           segment_lengths, work)


def test_segment_lengths_and_attention_cost_follow_cu_seqlens():
    lengths = segment_lengths(torch.tensor([0, 3, 10, 16], dtype=torch.int32))
    assert lengths == [3, 7, 6] and attention_cost(lengths) == 9 + 49 + 36


def test_one_long_document_needs_more_cp_ranks_than_many_short_ones_of_the_same_total():
    budget = CPBudget(max_attn_per_rank=4096 ** 2 // 4)
    assert choose_cp_size([4096], [1, 2, 4, 8], budget) == 4
    assert choose_cp_size([256] * 16, [1, 2, 4, 8], budget) == 1


def test_token_budget_alone_decides_when_attention_is_unlimited():
    assert choose_cp_size([1000, 1000], [1, 2, 4], CPBudget(max_tokens_per_rank=1000)) == 2
    assert choose_cp_size([1000, 1000], [4, 2, 1], CPBudget()) == 1  # no limits: the smallest allowed size


def test_when_nothing_fits_the_largest_size_is_used():
    assert choose_cp_size([10_000], [1, 2], CPBudget(max_tokens_per_rank=100)) == 2


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=20), st.integers(1, 10 ** 8), st.integers(1, 20000))
def test_chosen_size_is_the_smallest_that_fits(lengths, attn, tokens):
    sizes = [1, 2, 4, 8]
    budget = CPBudget(max_tokens_per_rank=tokens, max_attn_per_rank=attn)
    c = choose_cp_size(lengths, sizes, budget)
    fits = lambda k: sum(lengths) <= tokens * k and attention_cost(lengths) <= attn * k  # noqa: E731
    assert fits(c) or c == 8
    assert not any(fits(k) for k in sizes if k < c)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=8).flatmap(
    lambda base: st.tuples(st.just(base), st.integers(1, 4))))
def test_equal_count_balance_uses_every_item_once_and_fills_every_group_exactly(args):
    base, per_group = args
    groups = len(base)
    costs = (base * per_group)[: groups * per_group]
    plan = deal_by_cost(costs, groups, per_group)
    assert sorted(i for g in plan for i in g) == list(range(len(costs)))
    assert all(len(g) == per_group for g in plan)


def test_equal_count_balance_pairs_heavy_with_light():
    # Dealt in order the loads would be 9+8 and 1+2; balanced they are 9+1 and 8+2.
    assert deal_by_cost([9, 8, 1, 2], 2, 2) == [[0, 2], [1, 3]]


def test_equal_count_balance_rejects_a_mismatched_count():
    with pytest.raises(ValueError, match="cannot fill"):
        deal_by_cost([1, 2, 3], 2, 2)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=30), st.integers(1, 6))
def test_dealing_without_a_count_limit_stays_within_lpt_s_bound_and_leaves_no_group_empty(costs, groups):
    """Graham's bound for longest-processing-time-first: the heaviest group's last item went to the least-loaded group,
    so that group ends at most (1 - 1/groups) of that item above the mean; the item is at most the (groups+1)-th
    costliest unless it is the group's only one (then no plan does better)."""
    plan = deal_by_cost(costs, groups)
    assert sorted(i for g in plan for i in g) == list(range(len(costs)))
    assert all(plan) or len(costs) < groups
    ranked = sorted(costs, reverse=True)
    bound = max(ranked[0], sum(costs) / groups + (1 - 1 / groups) * (ranked[groups] if len(costs) > groups else 0))
    assert max(sum(costs[i] for i in g) for g in plan) <= bound * (1 + 1e-9) + 1e-6


def test_dealing_without_a_count_limit_evens_the_loads_and_breaks_ties_by_item_count():
    # Round robin in order would load 9+2 and 8+1; costliest first to the least loaded: 9+1 and 8+2.
    # Free items at equal load go to the group holding fewer, so none stays empty.
    assert deal_by_cost([9, 8, 2, 1], 2) == [[0, 3], [1, 2]]
    assert deal_by_cost([0, 0, 0], 3) == [[0], [1], [2]]


def test_a_micro_batch_costs_its_dp_rank_the_same_work_whatever_its_cp_size():
    """On a CP group of 2, a size-1 micro-batch runs on one rank while the other rank runs another
    (context_parallel.cp_share), and one left over runs on both; a size-2 one runs on both. So a dp rank's time is
    its micro-batches' summed work / 2 whatever their sizes, up to how the blocks split. Dealt by work / c instead,
    the size-2 micro-batches look half as costly as they are and land on one rank together."""
    scale = 1 << 30  # attention negligible: a micro-batch's work is its tokens
    step = [([12], 1), ([2], 1), ([20], 2), ([18], 2)]
    assert [work(lengths, scale) for lengths, _ in step] == pytest.approx([12, 2, 20, 18])

    def times(costs):
        return sorted(dp_rank_time([step[i] for i in g], 2, scale) for g in deal_by_cost(costs, 2, 2))
    # by work: 20 (both ranks: 10) + 2 (left over, both ranks: 1); 18 (9) + 12 (6); the ideal is 52 / 4 = 13
    assert times([work(lengths, scale) for lengths, _ in step]) == pytest.approx([11, 15])
    # by work / c: 12 and 2 on one rank each (12); 20 and 18 on both ranks (10 + 9)
    assert times([work(lengths, scale) / c for lengths, c in step]) == pytest.approx([12, 19])
