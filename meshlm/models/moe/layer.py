"""The Mixture-of-Experts block: route, permute, run the experts, combine.

    tokens = flatten(x)                                [n, h]
    routing = router(tokens)                           top-k experts and weights per token
    z = latent_in(tokens)                              [n, latent]  (LatentMoE only)
    rows = permute(z, plan)                            [m, d] grouped by expert (m <= n*k)
    y = unpermute(experts(rows), plan, weights)        sum_k weight * expert output, [n, d]
    y = latent_out(y)                                  [n, h]       (LatentMoE only)
    out = y + gate(tokens) * shared_expert(tokens)     (only with a shared expert; gate only if set)

This is a sparse replacement for the dense MLP (Shazeer et al. 2017; Switch Transformer; Mixtral;
Qwen3-MoE): each token pays for k experts of width F while the layer holds E of them. Three
variations of recent models are built in:

- a *shared expert* (DeepSeekMoE, Nemotron 3): an ordinary MLP every token goes through, added
  to the routed output, so common knowledge need not be copied into every routed expert;
- *LatentMoE* (Nemotron 3): tokens are projected from the hidden size h down to a smaller latent
  size before the experts and back up after the weighted sum, so the experts (and, under expert
  parallelism, the all-to-all traffic) work at the latent width. The router and the shared
  expert still see the full hidden state (like Hugging Face's NemotronHMoE fc1/fc2_latent_proj);
- a *gated* shared expert (Qwen1.5-MoE, Qwen2-MoE; ``moe_shared_expert_gate``): each token scales
  the shared expert's output by sigmoid(x w), so it can lean on the shared expert more or less.

The block returns its output and a ``MoELosses`` (load-balancing and z-loss, unscaled, and the
per-expert traffic); the language model weights and sums the losses over blocks. Which tokens
the balance loss balances (micro-batch, sequence, or the global batch across data-parallel
ranks, whose counts a function the trainer hands to ``set_load_balancing_sum`` sums) is
``moe_aux_loss_type``; see balancing.py. Bias terms (``mlp_bias``) apply to the shared expert
and the latent projections; routed experts have none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.init import initialize_own_tensors, normal
from meshlm.models.mlp import MLP
from meshlm.models.moe.dispatch import count_per_expert, expert_capacity, permute, plan_dispatch, unpermute
from meshlm.models.moe.experts import GroupedExperts
from meshlm.models.moe.balancing import balance_loss, router_z_loss
from meshlm.models.moe.router import MoELosses, Routing, TopKRouter


class SharedExpertGate(nn.Module):
    """sigmoid(x w^T), one scale in (0, 1) per token for the shared expert's output: transformers'
    Qwen2-MoE ``shared_expert_gate``, an ``nn.Linear(hidden, 1, bias=False)``. Its own class rather
    than an ``nn.Linear`` so that low-precision recipes and LoRA leave this one-output layer alone.
    Under tensor parallelism it is replicated and reads the block's input in attention's layout,
    so under sequence parallelism each rank gates its own tokens (its gradient then partial)."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, config.hidden_size))
        initialize_own_tensors(self, config)

    def init_rules(self, config) -> dict:
        return {"weight": normal(config.init_std)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., 1]."""
        return torch.sigmoid(F.linear(x, self.weight))


class MoELayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_experts = config.moe_num_experts
        self.top_k = config.moe_top_k
        self.capacity_factor = config.moe_capacity_factor
        self.drop_policy = config.moe_drop_policy
        self.aux_loss_type = config.moe_aux_loss_type
        self.sum_over_ranks = None
        """With moe_aux_loss_type 'global': sums the token counts in place over the data- and
        context-parallel ranks (``balancing.SumOverRanks``); None in a single process."""
        hidden, latent = config.hidden_size, config.moe_latent_size
        self.router = TopKRouter(config)
        self.latent_in_proj = nn.Linear(hidden, latent, bias=config.mlp_bias) if latent else None
        self.experts = GroupedExperts(config, model_size=latent or hidden)
        self.latent_out_proj = nn.Linear(latent, hidden, bias=config.mlp_bias) if latent else None
        shared_size = config.moe_shared_expert_ffn_hidden_size
        self.shared_expert = (MLP(hidden, shared_size, config.mlp_activation, config.mlp_bias, config.lora_dropout,
                                  config.swiglu_limit, config.swiglu_alpha)
                              if shared_size > 0 else None)
        self.shared_expert_gate = SharedExpertGate(config) if config.moe_shared_expert_gate else None

    def forward(self, x: torch.Tensor, context=None) -> tuple[torch.Tensor, MoELosses]:
        """x [batch, seq, hidden] -> (MoE output [batch, seq, hidden], MoELosses)."""
        batch, seq, hidden = x.shape
        tokens = x.reshape(batch * seq, hidden)
        routing = self.router(tokens)
        routed, dropped = self.routed_experts(tokens, routing)
        if self.shared_expert is not None:  # token by token: fed x as [b, t, h], whose tokens context describes
            routed = routed + self.gated_shared_expert(x, x, context).reshape(batch * seq, hidden)
        return routed.reshape(batch, seq, hidden), self.losses(routing, dropped, num_sequences=batch)

    def gated_shared_expert(self, x: torch.Tensor, gate_input: torch.Tensor, context=None) -> torch.Tensor:
        """The shared expert's output for ``x``, scaled by the gate of ``gate_input`` (the same
        tokens, in the layout of the output) when the block has one."""
        shared = self.shared_expert(x, context)
        return shared if self.shared_expert_gate is None else self.shared_expert_gate(gate_input) * shared

    def routed_experts(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted sum of each token's expert outputs [n, hidden], and the dropped count."""
        combined, dropped = self.routed_partial_sums(tokens, routing)
        if self.latent_out_proj is not None:
            combined = self.latent_out_proj(combined)
        return combined, dropped

    def routed_partial_sums(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """sum_k weight * expert output [n, latent or hidden], before the latent out-projection, and
        the dropped count. With FFN-width expert shards (tensor parallelism) it is this rank's
        partial sum, which the caller reduces over the group."""
        num_tokens = tokens.shape[0]
        capacity = (None if self.capacity_factor is None
                    else expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor))
        plan = plan_dispatch(routing.expert_ids, routing.weights, self.num_experts, capacity, self.drop_policy)
        expert_input = self.latent_in_proj(tokens) if self.latent_in_proj is not None else tokens
        expert_output = self.experts(permute(expert_input, plan), plan.tokens_per_expert)
        return unpermute(expert_output, plan, routing.weights, num_tokens), plan.dropped

    def losses(self, routing: Routing, dropped: torch.Tensor, num_sequences: int = 1) -> MoELosses:
        """The router losses of ``routing`` over ``num_sequences`` equal-length sequences of tokens."""
        tokens_per_expert = count_per_expert(routing.expert_ids, self.num_experts)
        return MoELosses(
            aux_loss=balance_loss(self.aux_loss_type, routing, tokens_per_expert, num_sequences,
                                  self.sum_over_ranks),
            z_loss=router_z_loss(routing.logits),
            tokens_per_expert=tokens_per_expert,
            dropped_tokens=dropped,
        )


def set_load_balancing_sum(model: nn.Module, sum_over_ranks) -> int:
    """Hand every MoE block of ``model`` the function that sums a 'global' balance loss's token
    counts over the data-parallel ranks (``balancing.SumOverRanks``; None: one process)."""
    layers = [module for module in model.modules() if isinstance(module, MoELayer)]
    for layer in layers:
        layer.sum_over_ranks = sum_over_ranks
    return len(layers)
