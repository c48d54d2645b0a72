import math

import pytest
import torch

from meshlm.models.config import ModelConfig
from meshlm.models.moe.balancing import load_balancing_loss, router_z_loss
from meshlm.models.moe.router import TopKRouter, group_limited_top_k, top_k_by_score


def make_router(**overrides):
    values = dict(pattern="E", hidden_size=16, moe_num_experts=6, moe_top_k=2, moe_ffn_hidden_size=16)
    values.update(overrides)
    torch.manual_seed(0)
    router = TopKRouter(ModelConfig(**values))
    with torch.no_grad():
        router.weight.normal_(std=1.0)  # large logits so the choice is not a near-tie
    return router


def expected_routing(logits, top_k, score_function, softmax_before_topk, normalize, scaling, bias):
    """Token by token recomputation with plain Python sorting (independent of the router code)."""
    all_ids, all_weights = [], []
    for row in logits.tolist():
        if score_function == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row]
            choice_key = [s + b for s, b in zip(scores, bias)]
        else:
            exps = [math.exp(v) for v in row]
            scores = [e / sum(exps) for e in exps]
            choice_key = scores if softmax_before_topk else row
        ids = sorted(range(len(row)), key=lambda i: -choice_key[i])[:top_k]
        if score_function == "softmax" and not softmax_before_topk:
            chosen = [math.exp(row[i]) for i in ids]
            weights = [c / sum(chosen) for c in chosen]
        else:
            weights = [scores[i] for i in ids]
            if normalize:
                weights = [w / sum(weights) for w in weights]
        all_ids.append(ids)
        all_weights.append([w * scaling for w in weights])
    return torch.tensor(all_ids), torch.tensor(all_weights)


@pytest.mark.parametrize("score_function, softmax_before_topk, normalize, scaling", [
    ("softmax", True, False, 1.0),   # Qwen3-MoE with norm_topk_prob=False
    ("softmax", True, True, 1.0),    # Mixtral, Qwen3-MoE with norm_topk_prob=True
    ("softmax", False, False, 1.0),  # top-k of the logits, then softmax over the k
    ("sigmoid", True, True, 2.5),    # DeepSeek-V3 / Nemotron 3
    ("sigmoid", True, False, 1.0),
])
def test_router_variants_match_a_direct_recomputation(score_function, softmax_before_topk, normalize, scaling):
    router = make_router(moe_score_function=score_function, moe_softmax_before_topk=softmax_before_topk,
                         moe_normalize_topk=normalize, moe_routed_scaling_factor=scaling)
    tokens = torch.randn(10, 16)
    routing = router(tokens)
    torch.testing.assert_close(routing.logits, tokens @ router.weight.T)
    ids, weights = expected_routing(routing.logits, 2, score_function, softmax_before_topk, normalize, scaling,
                                    [0.0] * 6)
    assert torch.equal(routing.expert_ids, ids)
    torch.testing.assert_close(routing.weights, weights)
    assert routing.weights.dtype == torch.float32
    if normalize or not softmax_before_topk:
        torch.testing.assert_close(routing.weights.sum(-1), torch.full((10,), scaling))


def test_sigmoid_bias_steers_the_choice_but_not_the_weights():
    router = make_router(moe_score_function="sigmoid", moe_normalize_topk=False)
    tokens = torch.randn(10, 16)
    unbiased = router(tokens)
    bias = [0.0, 0.0, 0.0, 0.0, 0.0, 5.0]  # expert 5 now wins every token's first slot
    router.expert_bias.copy_(torch.tensor(bias))
    routing = router(tokens)
    assert (routing.expert_ids[:, 0] == 5).all()
    assert not torch.equal(routing.expert_ids, unbiased.expert_ids)
    scores = routing.logits.sigmoid()
    torch.testing.assert_close(routing.weights, scores.gather(1, routing.expert_ids))  # no bias in weights
    ids, weights = expected_routing(routing.logits, 2, "sigmoid", True, False, 1.0, bias)
    assert torch.equal(routing.expert_ids, ids)
    torch.testing.assert_close(routing.weights, weights)
    assert "expert_bias" in router.state_dict()


def test_ties_go_to_the_lower_expert_index():
    scores = torch.tensor([[0.2, 0.5, 0.5, 0.5, 0.1]])
    assert top_k_by_score(scores, 2).tolist() == [[1, 2]]


def test_aux_and_z_loss_on_a_hand_made_example():
    # Two tokens, three experts, top-1. Token 0: probs (1/4, 1/2, 1/4) -> expert 1;
    # token 1: probs (1/2, 1/4, 1/4) -> expert 0. Both rows have sum(exp(logits)) = 4.
    logits = torch.log(torch.tensor([[1.0, 2.0, 1.0], [2.0, 1.0, 1.0]]))
    tokens_per_expert = torch.tensor([1, 1, 0])
    # f = (1/2, 1/2, 0), P = (3/8, 3/8, 1/4)  ->  aux = 3 * (1/2 * 3/8 + 1/2 * 3/8) = 9/8
    aux = load_balancing_loss(logits.softmax(-1), tokens_per_expert, top_k=1)
    assert aux.item() == pytest.approx(9 / 8, abs=1e-6)
    # logsumexp = log 4 for both tokens  ->  z = (log 4)^2
    assert router_z_loss(logits).item() == pytest.approx(math.log(4) ** 2, abs=1e-6)


def test_aux_loss_of_uniform_probabilities_is_one_whatever_the_traffic():
    probs = torch.full((5, 4), 0.25)
    skewed = torch.tensor([10, 0, 0, 0])  # 5 tokens, top-2
    assert load_balancing_loss(probs, skewed, top_k=2).item() == pytest.approx(1.0)


def test_sigmoid_balance_probabilities_are_normalized_scores():
    router = make_router(moe_score_function="sigmoid")
    with torch.no_grad():
        router.weight.zero_()  # every score is sigmoid(0) = 1/2, normalized to 1/6 per expert
    routing = router(torch.randn(3, 16))
    torch.testing.assert_close(routing.probs, torch.full((3, 6), 1 / 6))


def identity_router(num_experts=6, **overrides):
    """hidden = E and W = I, so a token's logits are the token itself."""
    router = make_router(hidden_size=num_experts, moe_num_experts=num_experts, **overrides)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
    return router


def logit(probability):
    return math.log(probability / (1 - probability))


def test_group_limited_top_k_on_hand_made_scores():
    # Six experts in three groups {0,1} {2,3} {4,5}; group score = sum of its two best scores:
    # 0.9 + 0.0 = 0.9, 0.5 + 0.45 = 0.95, 0.1 + 0.2 = 0.3.
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.45, 0.1, 0.2]])
    assert top_k_by_score(scores, 2).tolist() == [[0, 2]]                             # no groups
    assert group_limited_top_k(scores, 2, num_groups=3, group_top_k=1).tolist() == [[2, 3]]  # group {2,3} only
    assert group_limited_top_k(scores, 2, num_groups=3, group_top_k=2).tolist() == [[0, 2]]  # groups {2,3}, {0,1}
    assert group_limited_top_k(scores, 3, num_groups=3, group_top_k=2).tolist() == [[0, 2, 3]]
    # groups of one expert: a group's score is its single score, so this is plain top-k
    assert group_limited_top_k(scores, 2, num_groups=6, group_top_k=2).tolist() == [[0, 2]]


def test_router_limits_groups_with_the_bias_and_keeps_unbiased_weights():
    router = identity_router(moe_score_function="sigmoid", moe_router_num_groups=3, moe_router_group_top_k=1)
    scores = [0.9, 0.01, 0.5, 0.45, 0.1, 0.2]  # group scores 0.91, 0.95, 0.3
    routing = router(torch.tensor([[logit(s) for s in scores]]))
    assert routing.expert_ids.tolist() == [[2, 3]]
    torch.testing.assert_close(routing.weights, torch.tensor([[0.5, 0.45]]))
    router.expert_bias[5] = 0.7  # biased group scores 0.91, 0.95, 0.1 + 0.9 = 1.0: group {4,5} wins
    routing = router(torch.tensor([[logit(s) for s in scores]]))
    assert routing.expert_ids.tolist() == [[5, 4]]
    torch.testing.assert_close(routing.weights, torch.tensor([[0.2, 0.1]]))  # the plain scores


@pytest.mark.parametrize("softmax_before_topk", [True, False])
def test_expert_bias_steers_softmax_routing_too(softmax_before_topk):
    router = make_router(moe_softmax_before_topk=softmax_before_topk)
    tokens = torch.randn(10, 16)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0, 0.0, 0.0]))
    routing = router(tokens)
    assert (routing.expert_ids[:, 0] == 3).all()
    unbiased_ids, _ = expected_routing(routing.logits, 2, "softmax", softmax_before_topk, False, 1.0, [0.0] * 6)
    assert not torch.equal(routing.expert_ids, unbiased_ids)
    if softmax_before_topk:  # the weights are the unbiased probabilities of the chosen experts
        torch.testing.assert_close(routing.weights, routing.probs.gather(1, routing.expert_ids))
    else:                    # the softmax over the chosen experts' unbiased logits
        torch.testing.assert_close(routing.weights, routing.logits.gather(1, routing.expert_ids).softmax(-1))


def test_router_runs_in_fp32_inside_a_bf16_autocast_region():
    router = make_router()
    tokens = torch.randn(32, 16).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.linear(tokens.float(), router.weight).dtype == torch.bfloat16  # autocast is on
        routing = router(tokens)
    assert routing.logits.dtype == routing.weights.dtype == routing.probs.dtype == torch.float32
    exact = tokens.double() @ router.weight.double().T
    assert (routing.logits.double() - exact).abs().max() < 1e-5  # bf16 logits would be off by ~1e-2
    assert torch.equal(routing.expert_ids, top_k_by_score(exact.softmax(-1), 2))


def test_group_config_is_validated():
    from meshlm.errors import ConfigError
    from meshlm.models.config import ModelConfig

    base = dict(pattern="E", moe_num_experts=8, moe_top_k=2)
    for bad, words in [(dict(moe_router_num_groups=3, moe_router_group_top_k=1), "divide"),
                       (dict(moe_router_num_groups=4), "set both"),
                       (dict(moe_router_num_groups=4, moe_router_group_top_k=5), "must lie in"),
                       (dict(moe_router_num_groups=8, moe_router_group_top_k=1), "exceeds"),
                       (dict(moe_router_num_groups=0, moe_router_group_top_k=1), "positive"),
                       (dict(moe_aux_loss_type="batch"), "moe_aux_loss_type"),
                       (dict(moe_bias_update_rate=-1.0), "moe_bias_update_rate")]:
        with pytest.raises(ConfigError, match=words):
            ModelConfig(**base, **bad)
