"""Tensor (and sequence) parallelism for the Mixture-of-Experts block: experts split on F.

Every routed expert is an MLP of width F, so it is split like Megatron-LM's MLP (Shoeybi et
al. 2019): the gate/up weights [E, F, d] by output rows (column-parallel, the activation stays
local), the down weights [E, d, F] by input columns (row-parallel). Rank r's experts give a
*partial* output whose sum over the TP group is the expert's output. This is "expert tensor
parallelism" with etp = tp and ep = 1; any other expert grid (whole experts per rank, or an
etp other than tp) is ``meshlm/parallel/expert/expert_parallel.py``.

Token flow on each rank of a TP group (n = all tokens of the micro-batch):

    tokens = all_gather_along(x, seq)  (SP)  |  copy_to_group(x)  (no SP)       [n, h]
    routing = router(tokens)               the same full token set, the same replicated router:
                                           every rank routes (and drops) exactly alike
    partial = unpermute(local_expert_shards(permute(latent_in(tokens))), routing.weights)
    routed = reduce_scatter_along(partial, seq)  (SP)  |  reduce_from_group(partial)
    out = latent_out(routed) + gate(x) * shared_expert(tokens)      (each only when configured)

The layer enters the parallel region once: the router, the experts and the shared expert's
column-parallel gate/up all read the same gathered ``tokens``, so the backward sums all their
input gradients in one all-reduce (one reduce-scatter under SP). The shared expert's row-parallel
down projection reduces on its own, a second reduction beside the routed one.

Because routing is identical everywhere, capacity dropping and ``tokens_per_expert`` equal
the single-process ones, and so do the router losses.

**Exact gradients.** The gradient reaching the replicated tokens must be *partial* on every
rank -- the backward of ``copy_to_group`` / ``all_gather_along`` sums it over the group. The
expert path is partial by construction (each rank differentiates its own shard), and so is the
path through the routing weights (a weight multiplies a partial expert output). But the
load-balancing and z-losses are computed identically on every TP rank from the same logits, and
every rank backpropagates the same total loss: summed over the group, their gradient would count
tp times. So the layer hands back losses whose *value* is exact and whose *gradient* is scaled
by 1/tp (``scale_gradient``); then every term reaching the router is partial and the group sum
is exact up to summation order (the 1/tp scaling itself is exact when tp is a power of two).
Consequently:

- ``router.weight`` (and its bias) gets a partial gradient on every rank (``tp_partial_grad``).
- The experts' biases (``model.moe_expert_linear_bias``): gate and up biases are cut on F with their
  weights; the down bias [E, d] is cut on d, each rank adding its share of the columns to its partial
  sum (``meshlm/models/moe/experts.py``): shards, not flagged.
- ``latent_in_proj`` (LatentMoE) is replicated and fed by the partial expert gradient: partial.
- ``latent_out_proj`` is replicated and runs *after* the reduction, at the latent width (so the
  reduction moves n * latent numbers, not n * h). Without SP every rank applies it to the same
  full tokens and gets the full gradient (no flag); under SP it applies to the rank's slice of
  the sequence, so its gradient is partial (flagged). We replicate the latent projections rather
  than split them: they are small (that is LatentMoE's point), and splitting latent_in's output
  would need an all-gather before the experts, which read the whole latent vector.
- The shared expert is an ordinary column/row-parallel MLP (its down bias is flagged by
  ``RowParallelLinear`` under SP, where it is added to the rank's tokens only).
- The shared expert's gate (``moe_shared_expert_gate``) is replicated and reads the block's input
  ``x`` as it arrives, outside the parallel region: the whole sequence without SP (every rank
  computes the full gradient, no flag), the rank's slice under SP (partial: flagged). Its
  gradient into ``x`` is whole for the tokens it reads, and adds to what the region's entry hands
  back.

The parallel block keeps the full block's parameter names (only the class is swapped, as
FSDP2's ``fully_shard`` does), so checkpoints stay in the single-process format.
"""

from __future__ import annotations

import torch
from meshlm.models.moe.layer import MoELayer
from meshlm.models.moe.router import MoELosses, Routing
from meshlm.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, column_parallel_input,
                                           row_parallel_output)
from meshlm.parallel.tensor.sharding import mark_partial_grad, shard_parameter


class ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the incoming gradient by ``factor`` in backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return ScaleGradient.apply(tensor, factor)


class TensorParallelMoELayer(MoELayer):
    """An ``MoELayer`` whose experts are FFN-width shards; built by ``parallelize_moe``."""

    parallel_context = None

    def forward(self, x: torch.Tensor, context=None) -> tuple[torch.Tensor, MoELosses]:
        """x [b, s, h] (or [b, s/tp, h] under SP) -> (output shaped like x, MoELosses)."""
        full = column_parallel_input(x, self.parallel_context)  # [b, s, h]: one entry for all readers
        tokens = full.reshape(-1, full.shape[-1])
        routing = self.router(tokens)
        partial, dropped = self.routed_partial_sums(tokens, routing)
        routed = row_parallel_output(partial.reshape(*full.shape[:2], -1), self.parallel_context)
        if self.latent_out_proj is not None:
            routed = self.latent_out_proj(routed)
        if self.shared_expert is not None:  # column layers read the gathered input; down reduces
            routed = routed + self.gated_shared_expert(full, x, context)  # the gate reads this rank's tokens
        return routed, self.replicated_losses(routing, dropped, num_sequences=full.shape[0])

    def replicated_losses(self, routing: Routing, dropped: torch.Tensor, num_sequences: int = 1) -> MoELosses:
        """The exact losses, with their gradient split evenly over the TP ranks (module docstring)."""
        losses = self.losses(routing, dropped, num_sequences)
        factor = 1.0 / self.parallel_context.tp_size
        losses.aux_loss = scale_gradient(losses.aux_loss, factor)
        losses.z_loss = scale_gradient(losses.z_loss, factor)
        return losses


@torch.no_grad()
def parallelize_moe(layer: MoELayer, context) -> MoELayer:
    """Split a full ``MoELayer`` in place over the TP group (see the module docstring). Any other
    expert grid (ep > 1, etp != tp, cp > 1) is ``parallelize_expert_moe``
    (``meshlm/parallel/expert/expert_parallel.py``); ``meshlm.parallel.parallelize.parallelize_moe_block``
    picks between the two for a layout."""
    if context.tp_size == 1:
        return layer
    experts = layer.experts
    for name, ffn_dim in (("gate_weight", 1), ("up_weight", 1), ("down_weight", 2),  # [E, F, d], [E, d, F]
                          ("gate_bias", 1), ("up_bias", 1), ("down_bias", 1)):  # [E, F]; [E, d]: a share of d
        if getattr(experts, name) is not None:
            setattr(experts, name, shard_parameter(getattr(experts, name), ffn_dim, context, what=f"experts.{name}"))
    if experts.down_bias is not None:  # added to its columns of the partial sums (models/moe/experts.py)
        share = experts.down_bias.shape[1]
        experts.down_bias_columns = (context.tp_rank * share, (context.tp_rank + 1) * share)
    experts.tensor_parallel = "ffn"  # how the experts are cut, for a low-precision recipe (precision/model_recipe.py)
    shared = layer.shared_expert
    if shared is not None:  # an MLP split on its width, fed the input the layer already gathered
        if shared.gate_proj is not None:
            shared.gate_proj = ColumnParallelLinear.from_full(shared.gate_proj, context, gather_input=False)
        shared.up_proj = ColumnParallelLinear.from_full(shared.up_proj, context, gather_input=False)
        shared.down_proj = RowParallelLinear.from_full(shared.down_proj, context)
    mark_partial_grad(layer.router, layer.latent_in_proj)
    if context.sequence_parallel:
        mark_partial_grad(layer.latent_out_proj, layer.shared_expert_gate)
    layer.__class__ = TensorParallelMoELayer
    layer.parallel_context = context
    return layer


__all__ = ["TensorParallelMoELayer", "parallelize_moe", "scale_gradient"]
