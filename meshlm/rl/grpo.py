"""GRPO's arithmetic: group-normalized advantages, the clipped surrogate and the k3 KL estimate.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath", §4.1; used for reasoning in
DeepSeek-R1, 2025) is PPO without a value network. For a prompt q the policy samples a group of G
completions o_1..o_G; each gets a scalar reward r_i, and the baseline is the group itself:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)          every token of o_i gets A_i

(std is the population standard deviation; a group whose rewards are all equal has A = 0 and
teaches nothing, as it should: no completion did better than another). Per completion token t,
with the probability ratio of the policy being trained to the one that sampled (``old``):

    ratio_t   = exp(logp_t - old_logp_t)
    surrogate = min(ratio_t * A, clip(ratio_t, 1 - eps_clip, 1 + eps_clip) * A)   (PPO, Schulman et al. 2017)
    kl_t      = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1             (k3, Schulman 2020)
    loss_t    = -surrogate + beta * kl_t

k3 is an unbiased, always non-negative estimate of KL(pi || pi_ref) from samples of pi; GRPO puts
it in the loss instead of in the reward. The min makes the objective pessimistic: once the ratio
has moved past the clip in the direction the advantage favours, the gradient of that token is zero
("clipped"), so several passes over the same rollouts (``rl.epochs``) cannot push the policy far.

The token losses are averaged one of two ways (``rl.loss_averaging``): 'sequence' -- each
completion's mean over its tokens, then the mean over completions (GRPO's 1/G sum_i 1/|o_i| sum_t)
-- or 'token' -- one mean over every completion token of the step (DAPO, Yu et al. 2025, §3.3:
long completions are not down-weighted per token). Either way the functions here return sums
with the weights already applied, divided by a count of the whole step, so that the pieces of a
step summed over micro-batches and data-parallel ranks give exactly the single-process loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-4
"""eps of the advantage normalization (as TRL's GRPO): keeps a group of nearly equal rewards finite."""


def group_advantages(rewards: torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """A [groups, G] from rewards [groups, G]: each row minus its mean, over its population std plus eps."""
    rewards = rewards.double()
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, unbiased=False, keepdim=True)
    return ((rewards - mean) / (std + eps)).float()


def clipped_surrogate(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      clip_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(surrogate per token, clipped per token as a bool) -- the PPO objective to maximize.

    ``advantages`` broadcasts against the token tensors (e.g. [b, 1] for [b, s]). A token counts as
    clipped when the min picked the clipped term strictly (its gradient is then zero).
    """
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def k3_kl(log_probs: torch.Tensor, reference_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    difference = reference_log_probs - log_probs
    return torch.exp(difference) - difference - 1


@dataclass
class TokenWeights:
    """How much each completion token weighs in the step's mean loss: [b, s], zero off the completions."""

    weights: torch.Tensor

    @classmethod
    def build(cls, mask: torch.Tensor, averaging: str, step_sequences: int, step_tokens: int) -> TokenWeights:
        """``mask`` [b, s] of completion tokens; 'sequence': 1 / (|o_i| * sequences of the step),
        'token': 1 / (completion tokens of the step). The counts are the whole step's, all ranks."""
        mask = mask.double()  # cast to the values' dtype in total()
        if averaging == "token":
            return cls(mask / step_tokens)
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        return cls(mask / (lengths * step_sequences))

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """Sum of ``values`` [b, s] under the weights: this micro-batch's share of the step's mean."""
        return (values * self.weights.to(values.dtype)).sum()


@dataclass
class LossTerms:
    """One micro-batch's weighted sums (their sum over a step is the step's mean of each)."""

    loss: torch.Tensor
    """-surrogate + beta * kl: what backward runs on."""
    surrogate: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor


def grpo_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, reference_log_probs: torch.Tensor | None,
              advantages: torch.Tensor, weights: TokenWeights, clip_epsilon: float,
              kl_coeff: float) -> LossTerms:
    """GRPO's loss on one micro-batch: token tensors [b, s] (any values off the completions: their
    weight is zero), ``advantages`` [b]; ``reference_log_probs`` None when ``kl_coeff`` is 0."""
    surrogate, clipped = clipped_surrogate(log_probs, old_log_probs, advantages[:, None], clip_epsilon)
    surrogate_sum = weights.total(surrogate)
    loss = -surrogate_sum
    kl_sum = torch.zeros((), device=log_probs.device)
    if reference_log_probs is not None:
        kl_sum = weights.total(k3_kl(log_probs, reference_log_probs))
        loss = loss + kl_coeff * kl_sum
    return LossTerms(loss=loss, surrogate=surrogate_sum.detach(), kl=kl_sum.detach(),
                     clip_fraction=weights.total(clipped.float()).detach())


__all__ = ["ADVANTAGE_EPS", "LossTerms", "TokenWeights", "clipped_surrogate", "group_advantages", "grpo_loss",
           "k3_kl"]
