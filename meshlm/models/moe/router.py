"""The top-k router: which experts each token visits, and with what weight.

A Mixture-of-Experts layer (Shazeer et al. 2017) sends each token to k of E expert MLPs and
adds their outputs, weighted by the router. The router is one linear map, logits = x W^T
([tokens, E]; plus a learned bias b_r with ``model.moe_router_bias``, gpt-oss's), computed in
fp32 even inside a bf16/fp16 autocast region, because small differences between logits decide
which expert a token visits. Three ways to turn logits into a choice and weights are in use:

- softmax, then top-k (Mixtral, Qwen3-MoE): p = softmax(logits) over all E; the k largest p
  are chosen and are the weights, optionally renormalized to sum to one over the k.
- top-k, then softmax: the k largest logits are chosen; the weights are a softmax over those k.
- sigmoid (DeepSeek-V3, Nemotron 3): s = sigmoid(logits), one independent score per expert;
  the k largest are chosen and are the weights, optionally divided by their sum (+1e-20).

**Expert bias.** The choice ranks the scores (p, the logits, or s) *plus* a per-expert bias b
(``expert_bias``, DeepSeek-V3's "score correction bias"); the weights never include b. The
aux-loss-free balancing rule in ``balancing.py`` nudges b so that under-used experts get picked
more often; while it is on, each router counts the assignments it makes (``record_load``).

**Group-limited top-k** (DeepSeek-V3 §2.1.2 "node-limited routing"; DeepSeek-V2's device-limited
routing). The E experts form G equal groups (under expert parallelism, a group is the experts
of one device or node). Each group is scored by the sum of its two best biased scores; only
the top ``moe_router_group_top_k`` groups stay eligible and the k experts are chosen among
their experts. A token's traffic then reaches at most that many groups, which bounds the
all-to-all fan-out.

Finally every weight is multiplied by ``routed_scaling_factor`` (DeepSeek-V3). Ties in the
choice go to the lower expert (and group) index, a stable sort, so routing is deterministic.

The router also hands back the per-token distribution over all experts (``Routing.probs``)
and the logits, from which ``balancing.py`` computes the load-balancing and z-losses.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.init import constant, initialize_own_tensors, normal
from meshlm.models.moe.dispatch import count_per_expert


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


def group_limited_top_k(scores: torch.Tensor, top_k: int, num_groups: int, group_top_k: int) -> torch.Tensor:
    """Top-k of ``scores`` [n, E] among the experts of each row's ``group_top_k`` best groups.

    The E experts form ``num_groups`` consecutive groups; a group's score is the sum of its two
    largest expert scores (its one score if groups have one expert).
    """
    num_tokens, num_experts = scores.shape
    grouped = scores.reshape(num_tokens, num_groups, num_experts // num_groups)
    best_per_group = min(2, grouped.shape[-1])
    group_scores = grouped.topk(best_per_group, dim=-1).values.sum(dim=-1)            # [n, G]
    chosen_groups = top_k_by_score(group_scores, group_top_k)                          # [n, g]
    eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen_groups, True)
    masked = grouped.masked_fill(~eligible.unsqueeze(-1), float("-inf")).reshape(num_tokens, num_experts)
    return top_k_by_score(masked, top_k)


def full_precision(device_type: str):
    """A context in which autocast is off for ``device_type`` (no-op where autocast does not exist)."""
    if device_type in ("cpu", "cuda", "xpu", "mps", "hpu"):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


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
        self.num_groups = config.moe_router_num_groups
        self.group_top_k = config.moe_router_group_top_k
        self.bias_update_rate = config.moe_bias_update_rate
        self.weight = nn.Parameter(torch.empty(config.moe_num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.moe_num_experts)) if config.moe_router_bias else None
        """[E]: the logits' learned bias (``model.moe_router_bias``), None without one."""
        self.register_buffer("expert_bias", torch.zeros(config.moe_num_experts), persistent=True)
        self.recorded_load: torch.Tensor | None = None
        """[E] float: assignments made in training forwards since the last bias update (only
        while ``bias_update_rate`` > 0); a plain attribute, not state: it is never saved."""
        initialize_own_tensors(self, config)

    def init_rules(self, config) -> dict:
        return {"weight": normal(config.init_std), "bias": constant(0.0), "expert_bias": constant(0.0)}

    def forward(self, tokens: torch.Tensor, record_load: bool = True) -> Routing:
        """Route ``tokens`` [n, hidden]. ``record_load=False``: the caller records the load itself
        (expert parallelism routes a share of the micro-batch and records the whole one's)."""
        with full_precision(tokens.device.type):
            logits = F.linear(tokens.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            if self.score_function == "sigmoid":
                choice_scores = logits.sigmoid()
                probs = choice_scores / choice_scores.sum(dim=-1, keepdim=True)
            else:
                probs = logits.softmax(dim=-1)
                choice_scores = probs if self.softmax_before_topk else logits
            expert_ids = self.choose(choice_scores + self.expert_bias.float())
            if self.score_function == "softmax" and not self.softmax_before_topk:
                weights = logits.gather(1, expert_ids).softmax(dim=-1)
            else:
                weights = choice_scores.gather(1, expert_ids)
                if self.normalize_topk:
                    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * self.routed_scaling_factor
        if record_load and self.training and self.bias_update_rate > 0:
            self.record_load(expert_ids)
        return Routing(expert_ids=expert_ids, weights=weights, logits=logits, probs=probs)

    def choose(self, biased_scores: torch.Tensor) -> torch.Tensor:
        """The k experts of each token [n, k], best first (group-limited when configured)."""
        if self.num_groups is not None:
            return group_limited_top_k(biased_scores, self.top_k, self.num_groups, self.group_top_k)
        return top_k_by_score(biased_scores, self.top_k)

    @torch.no_grad()
    def record_load(self, expert_ids: torch.Tensor) -> None:
        """Add this forward's assignments per expert to ``recorded_load``."""
        counts = count_per_expert(expert_ids, self.num_experts).float()
        self.recorded_load = counts if self.recorded_load is None else self.recorded_load + counts

    def take_recorded_load(self) -> torch.Tensor:
        """The load recorded since the last call ([E] float, zeros if none), and reset it."""
        load = self.recorded_load if self.recorded_load is not None else torch.zeros(
            self.num_experts, device=self.expert_bias.device)
        self.recorded_load = None
        return load.to(self.expert_bias.device, torch.float32)

    def extra_repr(self) -> str:
        groups = f", groups={self.num_groups} (top {self.group_top_k})" if self.num_groups is not None else ""
        return (f"experts={self.num_experts}, top_k={self.top_k}, score={self.score_function}, "
                f"softmax_before_topk={self.softmax_before_topk}, normalize_topk={self.normalize_topk}, "
                f"scaling={self.routed_scaling_factor}{groups}")


def routers_of(model: nn.Module) -> list[nn.Module]:
    """Every ``TopKRouter`` of ``model``, in module order."""
    return [module for module in model.modules() if isinstance(module, TopKRouter)]
