"""meshlm/rl/grpo.py against hand computations: advantages, the clipped surrogate, k3, averaging."""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.rl.grpo import ADVANTAGE_EPS, TokenWeights, clipped_surrogate, group_advantages, grpo_loss, k3_kl


def test_advantages_are_normalized_within_each_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    advantages = group_advantages(rewards)
    # group 1: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps)
    one = 0.5 / (0.5 + ADVANTAGE_EPS)
    assert advantages[0].tolist() == pytest.approx([one, -one, -one, one], rel=1e-6)
    # group 2: mean 0.75, std sqrt(mean of 0.5625 x3 and 5.0625) = sqrt(27/16) = 1.299...
    std = math.sqrt((3 * 0.75 ** 2 + 2.25 ** 2) / 4)
    expected = [(-0.75) / (std + ADVANTAGE_EPS)] * 3 + [2.25 / (std + ADVANTAGE_EPS)]
    assert advantages[1].tolist() == pytest.approx(expected, rel=1e-6)
    # equal rewards teach nothing
    assert advantages[2].tolist() == [0.0] * 4
    assert advantages.sum(dim=-1).abs().max() < 1e-6


@pytest.mark.parametrize("ratio, advantage, expected, clipped", [
    (1.1, 2.0, 2.2, False),    # inside the clip: ratio * A
    (1.5, 2.0, 2.4, True),     # A > 0, ratio above 1 + eps: clipped to 1.2 * A
    (0.5, 2.0, 1.0, False),    # A > 0, ratio below 1 - eps: the min keeps ratio * A (pessimistic)
    (0.5, -2.0, -1.6, True),   # A < 0, ratio below 1 - eps: clipped to 0.8 * A
    (1.5, -2.0, -3.0, False),  # A < 0, ratio above 1 + eps: the min keeps ratio * A
    (0.9, -2.0, -1.8, False),  # inside
])
def test_clipped_surrogate_by_hand(ratio, advantage, expected, clipped):
    old = torch.tensor([-1.3], dtype=torch.float64)
    new = (old + math.log(ratio)).requires_grad_()
    surrogate, was_clipped = clipped_surrogate(new, old, torch.tensor([advantage], dtype=torch.float64), 0.2)
    assert surrogate.item() == pytest.approx(expected, rel=1e-12)
    assert bool(was_clipped) == clipped
    surrogate.sum().backward()
    # d/dlogp of ratio * A is ratio * A; a clipped token gets no gradient
    assert new.grad.item() == pytest.approx(0.0 if clipped else ratio * advantage, rel=1e-12)


def test_k3_kl_by_hand():
    log_probs = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    reference = torch.tensor([-1.0, -1.5, -2.5], dtype=torch.float64)
    expected = [math.exp(r - p) - (r - p) - 1 for p, r in zip(log_probs.tolist(), reference.tolist())]
    assert k3_kl(log_probs, reference).tolist() == pytest.approx(expected, rel=1e-12)
    assert expected[0] == 0.0 and min(expected) >= 0.0


def test_k3_is_an_unbiased_estimate_of_the_kl():
    """E_{x ~ p}[k3] = KL(p || q) over a small categorical distribution."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    assert float((p * k3_kl(p.log(), q.log())).sum()) == pytest.approx(exact, rel=1e-12)


def hand_loss(log_probs, old, reference, advantages, mask, averaging, beta, eps=0.2):
    """The GRPO loss written out token by token in Python floats."""
    per_sequence, tokens = [], []
    for row in range(len(mask)):
        terms = []
        for t in range(len(mask[row])):
            if not mask[row][t]:
                continue
            ratio = math.exp(log_probs[row][t] - old[row][t])
            a = advantages[row]
            surrogate = min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
            d = reference[row][t] - log_probs[row][t]
            terms.append(-surrogate + beta * (math.exp(d) - d - 1))
        per_sequence.append(sum(terms) / len(terms))
        tokens += terms
    return sum(per_sequence) / len(per_sequence) if averaging == "sequence" else sum(tokens) / len(tokens)


@pytest.mark.parametrize("averaging", ["sequence", "token"])
def test_grpo_loss_split_over_micro_batches_equals_the_hand_mean(averaging):
    torch.manual_seed(0)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    log_probs = -torch.rand(4, 5, dtype=torch.float64) * 3
    old = log_probs + torch.randn(4, 5, dtype=torch.float64) * 0.3  # ratios inside and outside the clip
    reference = log_probs + torch.randn(4, 5, dtype=torch.float64) * 0.5
    advantages = torch.tensor([1.5, -0.7, 0.2, -1.0], dtype=torch.float64)
    expected = hand_loss(log_probs.tolist(), old.tolist(), reference.tolist(), advantages.tolist(), mask.tolist(),
                         averaging, beta=0.1)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):  # two micro-batches, weighted by the whole step's counts
        weights = TokenWeights.build(mask[rows], averaging, step_sequences=4, step_tokens=int(mask.sum()))
        terms = grpo_loss(log_probs[rows], old[rows], reference[rows], advantages[rows], weights, 0.2, 0.1)
        total += terms.loss.item()
    assert total == pytest.approx(expected, rel=1e-10)


def test_no_reference_means_no_kl():
    mask = torch.ones(2, 3, dtype=torch.bool)
    log_probs = torch.zeros(2, 3)
    weights = TokenWeights.build(mask, "sequence", 2, 6)
    terms = grpo_loss(log_probs, log_probs, None, torch.tensor([1.0, -1.0]), weights, 0.2, 0.0)
    assert terms.kl.item() == 0.0 and terms.loss.item() == pytest.approx(0.0)
    assert terms.clip_fraction.item() == 0.0
