"""The top-k router: which experts each token visits, with what weight, and the router losses.

A Mixture-of-Experts layer (Shazeer et al. 2017) sends each token to k of E expert MLPs and
adds their outputs, weighted by the router. The router is one linear map, logits = x W^T
([tokens, E]), computed in fp32 because small differences between logits decide which expert
a token visits. Three ways to turn logits into a choice and weights are in use:

- softmax, then top-k (Mixtral, Qwen3-MoE): p = softmax(logits) over all E; the k largest p
  are chosen and are the weights, optionally renormalized to sum to one over the k.
- top-k, then softmax: the k largest logits are chosen; the weights are a softmax over those k.
- sigmoid (DeepSeek-V3, Nemotron 3): s = sigmoid(logits), one independent score per expert.
  The choice uses s + b, where b (``expert_bias``, DeepSeek-V3's "score correction bias") is a
  per-expert offset that a load-balancing rule nudges so that under-used experts get picked
  more often. The bias only steers the *choice*: the weights are the plain s of the chosen
  experts, optionally divided by their sum (+1e-20).

Finally every weight is multiplied by ``routed_scaling_factor`` (DeepSeek-V3). Ties in the
choice go to the lower expert index (a stable sort), so routing is deterministic.

Two auxiliary losses keep the router healthy; both are returned unscaled and the language model
multiplies them by their coefficients:

- load balancing (Switch Transformer, Fedus et al. 2021, eq. 4):
      aux = E * sum_i f_i * P_i,
  f_i = (assignments to expert i) / (tokens * k) is the fraction of the k-way traffic expert i
  receives (a count, no gradient) and P_i = mean over tokens of the probability the router gives
  expert i (differentiable). It is 1 when traffic and probability are uniform and grows as both
  pile onto the same experts. For sigmoid scores, which do not sum to one, P uses the scores
  normalized per token, s_i / sum_j s_j (as in DeepSeek-V3's sequence-wise balance loss).
- router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): z = mean over tokens of logsumexp(logits)^2.
  It keeps logits small, which keeps the softmax out of its saturated, round-off-prone regime.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    """The router's decision for a flat batch of n tokens."""

    expert_ids: torch.Tensor
    """[n, k] int64: the experts each token visits, best first."""
    weights: torch.Tensor
    """[n, k] fp32: the weight of each visit (the output is the weighted sum of expert outputs)."""
    logits: torch.Tensor
    """[n, E] fp32 router logits (for the z-loss)."""
    probs: torch.Tensor
    """[n, E] fp32 per-token distribution over all experts (for the load-balancing loss):
    softmax(logits), or the sigmoid scores normalized to sum to one per token."""


@dataclass
class MoELosses:
    """What one MoE block reports besides its output; the language model sums these over blocks."""

    aux_loss: torch.Tensor
    """Scalar load-balancing loss, before moe_aux_loss_coeff."""
    z_loss: torch.Tensor
    """Scalar router z-loss, before moe_z_loss_coeff."""
    tokens_per_expert: torch.Tensor
    """[E] int64: assignments each expert received from the router, before any dropping."""
    dropped_tokens: torch.Tensor | None = None
    """Scalar int64: (token, expert) assignments dropped by the capacity limit (0 when dropless)."""


def top_k_by_score(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices [n, k] of the k largest scores per row; ties go to the lower index."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :top_k]


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-style aux = E * sum_i f_i * P_i (see the module docstring)."""
    num_tokens, num_experts = probs.shape
    traffic_fraction = tokens_per_expert.to(probs.dtype) / (num_tokens * top_k)
    mean_probability = probs.mean(dim=0)
    return num_experts * (traffic_fraction * mean_probability).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class TopKRouter(nn.Module):
    """logits = x W^T in fp32, then one of the score functions above; returns a ``Routing``."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.moe_num_experts
        self.top_k = config.moe_top_k
        self.score_function = config.moe_score_function
        self.softmax_before_topk = config.moe_softmax_before_topk
        self.normalize_topk = config.moe_normalize_topk
        self.routed_scaling_factor = config.moe_routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.moe_num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.moe_num_experts), persistent=True)
        self.reset_parameters_from_config(config)

    @torch.no_grad()
    def reset_parameters_from_config(self, config) -> None:
        nn.init.normal_(self.weight, std=config.init_std)

    def forward(self, tokens: torch.Tensor) -> Routing:
        """Route ``tokens`` [n, hidden]."""
        logits = F.linear(tokens.float(), self.weight.float())
        if self.score_function == "sigmoid":
            expert_ids, weights, probs = self._sigmoid_routing(logits)
        elif self.softmax_before_topk:
            probs = logits.softmax(dim=-1)
            expert_ids = top_k_by_score(probs, self.top_k)
            weights = probs.gather(1, expert_ids)
            if self.normalize_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            probs = logits.softmax(dim=-1)
            expert_ids = top_k_by_score(logits, self.top_k)
            weights = logits.gather(1, expert_ids).softmax(dim=-1)
        weights = weights * self.routed_scaling_factor
        return Routing(expert_ids=expert_ids, weights=weights, logits=logits, probs=probs)

    def _sigmoid_routing(self, logits: torch.Tensor):
        scores = logits.sigmoid()
        expert_ids = top_k_by_score(scores + self.expert_bias.float(), self.top_k)
        weights = scores.gather(1, expert_ids)
        if self.normalize_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return expert_ids, weights, probs

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, score={self.score_function}, "
                f"softmax_before_topk={self.softmax_before_topk}, normalize_topk={self.normalize_topk}, "
                f"scaling={self.routed_scaling_factor}")
