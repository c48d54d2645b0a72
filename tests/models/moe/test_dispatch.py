import pytest
import torch

from meshlm.models.moe.dispatch import expert_capacity, kept_assignments, permute, plan_dispatch, unpermute


def random_assignments(num_tokens, num_experts, top_k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_permute_then_unpermute_round_trips_exactly(top_k):
    tokens = torch.randn(12, 8)
    expert_ids = random_assignments(12, 6, top_k)
    weights = torch.full((12, top_k), 1 / top_k)
    plan = plan_dispatch(expert_ids, weights, num_experts=6)
    assert torch.equal(unpermute(permute(tokens, plan), plan, weights, num_tokens=12), tokens)


def test_permuted_rows_are_grouped_by_expert_and_conserve_tokens():
    tokens = torch.randn(10, 4)
    expert_ids = random_assignments(10, 5, 2, seed=1)
    plan = plan_dispatch(expert_ids, torch.rand(10, 2), num_experts=5)
    rows = permute(tokens, plan)
    assert plan.tokens_per_expert.sum().item() == 10 * 2 == rows.shape[0]
    assert torch.equal(plan.tokens_per_expert, torch.bincount(expert_ids.flatten(), minlength=5))
    row_experts = expert_ids.flatten()[plan.assignment_ids]
    assert torch.equal(row_experts, torch.sort(row_experts).values)  # contiguous segment per expert
    assert sorted(plan.assignment_ids.tolist()) == list(range(20))  # each assignment exactly once
    for row, assignment in zip(rows, plan.assignment_ids.tolist()):
        assert torch.equal(row, tokens[assignment // 2])
    for expert in range(5):  # token order is kept inside each expert's segment
        segment = plan.token_ids[row_experts == expert]
        assert torch.equal(segment, torch.sort(segment).values)
    assert plan.dropped.item() == 0


def test_unpermute_is_the_weighted_sum_over_visits():
    tokens = torch.randn(6, 4)
    expert_ids = random_assignments(6, 3, 2, seed=2)
    weights = torch.rand(6, 2)
    plan = plan_dispatch(expert_ids, weights, num_experts=3)
    scale = torch.tensor([1.0, 2.0, 3.0])  # "expert e" multiplies its rows by e + 1
    rows = permute(tokens, plan) * scale[expert_ids.flatten()[plan.assignment_ids]].unsqueeze(-1)
    expected = torch.stack([sum(weights[j, s] * scale[expert_ids[j, s]] * tokens[j] for s in range(2))
                            for j in range(6)])
    torch.testing.assert_close(unpermute(rows, plan, weights, num_tokens=6), expected)


def test_expert_capacity_formula():
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=4, capacity_factor=1.0) == 5
    assert expert_capacity(num_tokens=10, top_k=2, num_experts=4, capacity_factor=1.1) == 6  # ceil(5.5)
    assert expert_capacity(num_tokens=3, top_k=1, num_experts=4, capacity_factor=0.1) == 1


# Four tokens, top-1, all on expert 0 (token 4 goes to expert 1); expert 0 has capacity 2.
HAND_IDS = torch.tensor([[0], [0], [0], [0], [1]])
HAND_WEIGHTS = torch.tensor([[0.1], [0.9], [0.9], [0.9], [0.2]])


def test_probs_policy_keeps_the_highest_weights_and_breaks_ties_by_position():
    keep = kept_assignments(HAND_IDS, HAND_WEIGHTS, num_experts=2, capacity=2, drop_policy="probs")
    assert keep.tolist() == [False, True, True, False, True]


def test_position_policy_keeps_the_earliest_tokens():
    keep = kept_assignments(HAND_IDS, HAND_WEIGHTS, num_experts=2, capacity=2, drop_policy="position")
    assert keep.tolist() == [True, True, False, False, True]


def test_dropping_with_top_2_and_the_plan_it_gives():
    # Expert 0 is everyone's choice; with capacity 2 it keeps tokens 2 and 0 (weights .8 and .7).
    expert_ids = torch.tensor([[0, 1], [0, 2], [0, 1]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]])
    plan = plan_dispatch(expert_ids, weights, num_experts=3, capacity=2, drop_policy="probs")
    assert plan.assignment_ids.tolist() == [0, 4, 1, 5, 3]  # expert 0: tokens 0, 2; expert 1: 0, 2; expert 2: 1
    assert plan.tokens_per_expert.tolist() == [2, 2, 1]
    assert plan.dropped.item() == 1
    ones = torch.ones(3, 1)
    combined = unpermute(permute(ones, plan), plan, weights, num_tokens=3)
    assert combined.flatten().tolist() == pytest.approx([1.0, 0.4, 1.0])  # token 1 lost its 0.6 visit


def test_a_large_capacity_drops_nothing_and_matches_dropless():
    expert_ids = random_assignments(16, 4, 2, seed=3)
    weights = torch.rand(16, 2)
    dropless = plan_dispatch(expert_ids, weights, num_experts=4)
    roomy = plan_dispatch(expert_ids, weights, num_experts=4, capacity=32, drop_policy="probs")
    assert torch.equal(dropless.assignment_ids, roomy.assignment_ids) and roomy.dropped.item() == 0


def test_dropping_is_deterministic():
    expert_ids = random_assignments(32, 4, 2, seed=4)
    weights = torch.rand(32, 2).round(decimals=1)  # many ties
    first = plan_dispatch(expert_ids, weights, num_experts=4, capacity=10)
    second = plan_dispatch(expert_ids, weights, num_experts=4, capacity=10)
    assert torch.equal(first.assignment_ids, second.assignment_ids)
    assert (first.tokens_per_expert <= 10).all() and first.dropped.item() == 64 - first.tokens_per_expert.sum()
