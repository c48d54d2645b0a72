"""Keeping the experts evenly loaded: auxiliary losses and the aux-loss-free expert bias.

A router left alone tends to collapse onto a few experts (they train faster, so they get picked
more, so they train faster). Two remedies are in use, and meshlm has both.

**Auxiliary balance losses** (Switch Transformer, Fedus et al. 2021, eq. 4). For E experts,
top-k routing and T tokens,

    aux = E * sum_i f_i * P_i,     f_i = (assignments to expert i) / (T * k),
                                   P_i = mean over the T tokens of the router probability of i.

f is a count (no gradient); P carries the gradient that pushes probability away from busy
experts. aux is 1 for uniform traffic and probabilities and grows as both pile onto the same
experts. For sigmoid scores, which do not sum to one, P uses the scores normalized per token.
*Which T tokens* is the choice ``moe_aux_loss_type`` makes:

- ``micro_batch``: all tokens of the micro-batch on this rank (Switch, Megatron's "aux_loss").
- ``sequence``: each sequence on its own, then the mean over sequences (DeepSeek-V3's
  "complementary sequence-wise balance loss", eqs. 17-20): it forbids imbalance *within* a
  sequence too, which the micro-batch version lets cancel out across sequences.
- ``global``: f counts the tokens of every data-parallel rank (the counts are summed by a
  function passed in explicitly, ``sum_over_ranks``), P stays local. Averaged over the ranks by the ordinary
  gradient averaging, this is E * sum_i f_i^global * mean_ranks(P_i), the balance loss of the
  whole global micro-batch (Qiu et al. 2025, "Demons in the Detail": balancing over more tokens
  lets experts specialize by domain instead of being forced uniform within every small batch).

**Router z-loss** (ST-MoE, Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2;
it keeps logits small, away from the saturated, round-off-prone regime of the softmax.

**Aux-loss-free balancing** (Wang et al. 2024; DeepSeek-V3 §2.1.2). No loss at all: every
router keeps a per-expert bias b (``expert_bias``, a buffer saved with the model) that is added
to the scores *for choosing experts only* (never for the weights). After each optimizer step,

    b_i += u * sign(mean_j load_j - load_i)

where load_i is the number of assignments expert i received during the step (summed over the
data-parallel ranks, so every replica of the router applies the same update).

**Communication comes in as a function.** This file is single-device math (``meshlm.models``
sits below ``meshlm.parallel``), so the two sums over ranks above are done by a function the
caller hands in, ``sum_over_ranks(tensor)``, which sums a tensor in place over the ranks that
read different tokens -- the trainer passes ``meshlm.parallel.collectives.summing_over`` of the
data- and context-parallel group, so the sum is a checked collective like every other. None
(one process) means no sum. Over-loaded
experts get a lower bias and lose marginal tokens; idle ones gain them. u is
``moe_bias_update_rate`` (DeepSeek-V3 used 0.001). Each router counts its own load while
training (``TopKRouter.record_load``), so the update needs no bookkeeping of which block is
where (pipeline stages, MTP depths). A block recomputed in backward counts its tokens twice;
that scales all of that router's loads alike, which the sign rule ignores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshlm.models.config import AUX_LOSS_TYPES
from meshlm.models.moe.router import routers_of

SumOverRanks = Callable[[torch.Tensor], object]
"""Sums a tensor in place over the ranks whose tokens are balanced together (see the module docstring)."""


def load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-style aux = E * sum_i f_i * P_i over all rows of ``probs`` [T, E]."""
    num_tokens, num_experts = probs.shape
    traffic_fraction = tokens_per_expert.to(probs.dtype) / (num_tokens * top_k)
    mean_probability = probs.mean(dim=0)
    return num_experts * (traffic_fraction * mean_probability).sum()


def sequence_load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """The aux loss of each sequence on its own, averaged over sequences (DeepSeek-V3 eqs. 17-20).

    ``probs`` [B*S, E] and ``expert_ids`` [B*S, k] hold the tokens of ``num_sequences`` = B
    sequences one after the other (the [batch, seq] flattening of the MoE block).
    """
    num_tokens, num_experts = probs.shape
    top_k = expert_ids.shape[1]
    seq_len = num_tokens // num_sequences
    per_sequence_ids = expert_ids.reshape(num_sequences, seq_len * top_k)
    counts = torch.zeros(num_sequences, num_experts, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, per_sequence_ids, torch.ones_like(per_sequence_ids, dtype=probs.dtype))
    traffic_fraction = counts / (seq_len * top_k)                            # [B, E]
    mean_probability = probs.reshape(num_sequences, seq_len, num_experts).mean(dim=1)
    return num_experts * (traffic_fraction * mean_probability).sum(dim=-1).mean()


def global_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int,
                               sum_over_ranks: SumOverRanks | None) -> torch.Tensor:
    """aux = E * sum_i f_i * P_i with f_i from the token counts summed by ``sum_over_ranks``, P_i local.

    One sum of E + 1 numbers (the counts and the token total). Every rank it sums over must call
    it (it is part of the MoE forward). With ``sum_over_ranks`` None (one process) it is
    ``load_balancing_loss``.
    """
    num_tokens, num_experts = probs.shape
    counts = torch.cat([tokens_per_expert.detach().to(probs.dtype), probs.new_tensor([num_tokens])])
    if sum_over_ranks is not None:
        sum_over_ranks(counts)
    traffic_fraction = counts[:num_experts] / (counts[num_experts] * top_k)
    return num_experts * (traffic_fraction * probs.mean(dim=0)).sum()


def balance_loss(kind: str, routing, tokens_per_expert: torch.Tensor, num_sequences: int,
                 sum_over_ranks: SumOverRanks | None) -> torch.Tensor:
    """The load-balancing loss ``moe_aux_loss_type`` = ``kind`` selects (see the module docstring)."""
    if kind == "sequence":
        return sequence_load_balancing_loss(routing.probs, routing.expert_ids, num_sequences)
    if kind == "global":
        return global_load_balancing_loss(routing.probs, tokens_per_expert, routing.expert_ids.shape[1],
                                          sum_over_ranks)
    return load_balancing_loss(routing.probs, tokens_per_expert, routing.expert_ids.shape[1])


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


@torch.no_grad()
def update_expert_biases(model: nn.Module, sum_over_ranks: SumOverRanks | None = None) -> int:
    """After an optimizer step: b += u * sign(mean load - load) on every router that balances
    without a loss (``moe_bias_update_rate`` > 0), from the loads counted since the last update,
    summed by ``sum_over_ranks`` (over the ranks that read different tokens: data and context
    parallel; None in one process).

    One sum for all routers; every rank it sums over must call it. Returns the number of
    routers updated.
    """
    routers = [router for router in routers_of(model) if router.bias_update_rate > 0]
    if not routers:
        return 0
    loads = torch.cat([router.take_recorded_load() for router in routers])
    if sum_over_ranks is not None:
        sum_over_ranks(loads)
    for router, load in zip(routers, loads.split([router.num_experts for router in routers])):
        step = router.bias_update_rate * torch.sign(load.mean() - load)
        router.expert_bias.add_(step.to(router.expert_bias.dtype))
    return len(routers)


__all__ = ["AUX_LOSS_TYPES", "balance_loss", "global_load_balancing_loss", "load_balancing_loss", "router_z_loss",
           "sequence_load_balancing_loss", "update_expert_biases"]
