"""Expert parallelism with parallel folding: the MoE block over the expert grid (edp, ep, etp).

The routed experts are the bulk of an MoE model's parameters but each token uses only k of them,
so instead of splitting every expert over the tensor-parallel ranks, expert parallelism
(GShard, Lepikhin et al. 2020) gives each of the ``ep`` ranks of an EP group E/ep *whole*
experts and sends every token to the ranks of its experts (``dispatchers.py``). Expert tensor
parallelism (``etp``) may still split each expert's FFN width, and the expert weights are
replicated over the remaining ``edp`` ranks, whose gradients are summed over that expert-data-
parallel group. MoE Parallel Folding (Liu et al. 2025) lays this grid over the same ranks as
attention's (tp, cp, dp): within a pipeline stage the tp*cp*dp ranks are re-split as
edp*ep*etp (``meshlm/parallel/mesh.py``), so an EP group may span ranks that are TP, CP or DP ranks for
attention.

**How tokens enter the expert grid.** The block's input arrives in attention's layout, and the
grid needs every rank of the stage to hold a *distinct* share of the stage's tokens (each token
must be sent to its experts exactly once):

* with sequence parallelism (or tp = 1) it already does: rank r holds its slice of the sequence;
* without SP the ranks of a TP group hold the same tokens, so each keeps the r-th 1/tp of the
  sequence (``scatter_along``, free) and the outputs are all-gathered again on the way out
  (``gather_along``); the pair is each other's adjoint. (Megatron instead requires SP whenever
  ep > 1 and tp > 1; this costs one all-gather per layer and lets every layout run.)
* under context parallelism each CP rank holds its own chunks of the sequence: distinct already.

Each rank then routes its own tokens with the replicated router. Three things depend on the
routing of the *whole micro-batch*, not of one rank's share: the load-balancing loss (traffic
fractions and mean probabilities over all tokens), the z-loss (a mean), and capacity dropping
(which assignments are "the first C" of an expert). So the routing (ids, weights, logits,
probabilities: a few numbers per token, against the k*d of the token exchange) is all-gathered
over the ranks that share the micro-batch -- first over TP, then over CP, whose chunk pairs are
put back in sequence order -- and the layer's own ``losses`` and the single-process drop rule
run on it. Two different gathers, because the two groups count the losses differently: the TP
ranks all hold the same loss (it counts once), so the TP gather is ``gather_along``, whose
adjoint keeps each rank's slice of the identical gradient; every CP rank adds 1/cp of the loss
terms (``context_parallel.share_losses``), so the CP gather is ``all_gather_along``, whose
adjoint sums the ranks' gradients. Both are exact, with no scaling. Dropping marks the dropped
assignments of this rank's tokens with expert id -1, so every layout drops exactly what the
single process drops. ``dropped_tokens`` is the micro-batch's; ``tokens_per_expert`` (and the
load recorded for the aux-loss-free bias) counts the CP rank's tokens, which the trainer sums
over dp_cp.

The experts' biases (``model.moe_expert_linear_bias``) go with their experts over ep; over etp the
gate and up biases split on F with their rows, and the down bias on d, each etp rank adding its
share of the columns to its partial sums (``meshlm/models/moe/experts.py``).

**Gradients.** Expert weights carry ``expert_parallel`` (and ``expert_partition_dim`` /
``expert_partition_sizes`` when etp splits them) and are summed over ``edp`` (the folding makes
the edp groups partition the stage's ranks the way dp_cp does for dense weights). The router
and the LatentMoE projections are dense weights applied to this rank's own tokens: their
gradient is this rank's share, flagged ``tp_partial_grad`` when tp > 1 and summed over TP,
then over dp_cp, like every dense weight -- together that is a sum over all the stage's ranks,
each token counted once. The shared expert is an ordinary tensor-parallel MLP on the block's
input in attention's layout.

**Overlap.** The shared expert runs between the start of the token all-to-all and the wait for
it (``dispatchers.Dispatched.expert_rows``; ``overlap_shared_expert`` turns it off). With NCCL
the exchange proceeds on its own stream meanwhile. Gloo runs an asynchronous collective on the
process group's own worker thread, so on CPU the exchange of the EP group progresses while the
shared expert's matmuls (and its TP collectives, on another group) run -- which only helps when
there are idle cores: on our 2-core test machine, shared with other jobs, 4 ranks' forward +
backward of a block (ep 4, 4096 tokens per rank, hidden 256) took 1.1-1.9 s either way, the
faster order changing from run to run (``bench/moe_all_to_all.py`` prints the pair).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.moe.dispatch import count_per_expert, expert_capacity, kept_assignments
from meshlm.models.moe.layer import MoELayer
from meshlm.models.moe.router import MoELosses, Routing
from meshlm.parallel.collectives import all_gather_along, gather_along, scatter_along
from meshlm.parallel.context.chunks import local_token_positions
from meshlm.parallel.expert.dispatchers import build_dispatcher
from meshlm.parallel.tensor.mlp import parallelize_mlp
from meshlm.parallel.tensor.sharding import mark_expert_shard, mark_partial_grad, shard_tensor


def needs_expert_parallel(context) -> bool:
    """Whether the MoE blocks need the expert grid: ep > 1, experts split other than by tp, or
    context parallelism (even at ep 1: the layer's losses and dropping then see the routing of the
    whole micro-batch, gathered over CP, instead of each CP rank's chunks -- see above)."""
    return context.ep_size > 1 or context.etp_size != context.tp_size or context.cp_size > 1


# --- entering and leaving the expert grid -----------------------------------------------------------

def splits_tokens_over_tp(context) -> bool:
    """Without SP the TP ranks hold the same tokens; each keeps 1/tp of the sequence (see above)."""
    return context.tp_size > 1 and not context.sequence_parallel


def enter_expert_grid(x: torch.Tensor, context) -> torch.Tensor:
    """This rank's own tokens [b, s', h] of the block input in attention's layout."""
    if not splits_tokens_over_tp(context):
        return x
    if x.shape[1] % context.tp_size:
        raise ConfigError(f"expert parallelism without sequence parallelism splits the sequence over parallel.tp="
                          f"{context.tp_size} ranks, but this batch has {x.shape[1]} positions; use a multiple "
                          "of tp (or parallel.sp=true).")
    return scatter_along(x, 1, context.tp_group)


def leave_expert_grid(y: torch.Tensor, context) -> torch.Tensor:
    """The adjoint of ``enter_expert_grid``: back to attention's layout."""
    return gather_along(y, 1, context.tp_group) if splits_tokens_over_tp(context) else y


def map_routing(routing: Routing, function) -> Routing:
    """``routing`` with ``function`` applied to each of its per-token tensors."""
    return dataclasses.replace(routing, **{field.name: function(getattr(routing, field.name))
                                           for field in dataclasses.fields(routing)
                                           if getattr(routing, field.name) is not None})


def cp_rank_tokens(tensor: torch.Tensor, batch: int, context) -> torch.Tensor:
    """[n', ...] per-token values of this rank -> [b, s/cp, ...] of its CP rank's tokens (all TP
    shares, in sequence order), replicated over the TP group: ``gather_along``, whose adjoint
    keeps this rank's slice of the (then identical) gradient."""
    per_sequence = tensor.reshape(batch, -1, *tensor.shape[1:])
    return gather_along(per_sequence, 1, context.tp_group) if context.tp_size > 1 else per_sequence


def cp_gather_order(seq_len: int, context) -> torch.Tensor:
    """Global positions of the tokens of a CP-gathered sequence (rank 0's chunks, rank 1's, ...)."""
    return torch.cat([local_token_positions(seq_len, rank, context.cp_size) for rank in range(context.cp_size)])


def whole_micro_batch(cp_tokens: torch.Tensor, context) -> torch.Tensor:
    """[b, s/cp, ...] of this CP rank -> [b * s, ...] of the micro-batch in single-process order,
    on every CP rank. Each CP rank adds 1/cp of the losses computed from it (``share_losses``),
    so this gather is ``all_gather_along``, whose adjoint sums the ranks' gradients."""
    if context.cp_size == 1:
        return cp_tokens.flatten(0, 1)
    gathered = all_gather_along(cp_tokens, 1, context.cp_group)
    order = cp_gather_order(gathered.shape[1], context).to(gathered.device)
    return gathered.index_select(1, torch.argsort(order)).flatten(0, 1)


def own_part(whole: torch.Tensor, batch: int, context) -> torch.Tensor:
    """This rank's rows of a [b * s, ...] tensor over the micro-batch (the inverse of the gathers)."""
    per_sequence = whole.reshape(batch, -1, *whole.shape[1:])
    if context.cp_size > 1:
        per_sequence = per_sequence.index_select(1, cp_gather_order(per_sequence.shape[1], context).to(whole.device))
    share = per_sequence.shape[1] // (context.cp_size * context.tp_size)
    offset = (context.cp_rank * context.tp_size + context.tp_rank) * share
    return per_sequence.narrow(1, offset, share).flatten(0, 1)


# --- the layer ---------------------------------------------------------------------------------------------

class ExpertParallelMoELayer(MoELayer):
    """An ``MoELayer`` holding E/ep experts (FFN-split over etp); built by ``parallelize_expert_moe``."""

    parallel_context = None
    dispatcher = None
    overlap_shared_expert = True
    """Compute the shared expert while the token all-to-all is in flight (False: after it, for
    ``bench/moe_all_to_all.py``'s comparison)."""

    def forward(self, x: torch.Tensor, context=None) -> tuple[torch.Tensor, MoELosses]:
        """x in attention's layout [b, s/(cp tp) or s/cp, h] -> (output in the same layout, MoELosses)."""
        parallel = self.parallel_context
        local = enter_expert_grid(x, parallel)
        batch, hidden = local.shape[0], local.shape[-1]
        tokens = local.reshape(-1, hidden)
        routing, cp_part, whole = self.route(tokens, batch)
        expert_ids, dropped = self.kept_expert_ids(routing, whole, batch)
        expert_input = self.latent_in_proj(tokens) if self.latent_in_proj is not None else tokens
        dispatched = self.dispatcher.dispatch(expert_input, expert_ids)
        rows = None if self.overlap_shared_expert else dispatched.expert_rows()
        shared = None if self.shared_expert is None else self.gated_shared_expert(x, x, context)  # while rows travel
        rows = dispatched.expert_rows() if rows is None else rows
        expert_output = self.experts(rows, dispatched.tokens_per_local_expert, dispatched.rows_per_source)
        routed = self.dispatcher.combine(expert_output, dispatched, routing.weights)
        if self.latent_out_proj is not None:
            routed = self.latent_out_proj(routed)
        out = leave_expert_grid(routed.reshape(batch, -1, hidden), parallel)
        losses = self.losses(whole, dropped, num_sequences=batch)
        losses.tokens_per_expert = count_per_expert(cp_part.expert_ids, self.num_experts)
        return (out if shared is None else out + shared), losses

    def route(self, tokens: torch.Tensor, batch: int) -> tuple[Routing, Routing, Routing]:
        """The routing of this rank's tokens, of its CP rank's (every TP share: summed over dp_cp
        they count each token once, for the logged traffic and the aux-loss-free bias), and of the
        whole micro-batch in single-process order (for the losses and dropping)."""
        routing = self.router(tokens, record_load=False)
        cp_part = map_routing(routing, lambda tensor: cp_rank_tokens(tensor, batch, self.parallel_context))
        whole = map_routing(cp_part, lambda tensor: whole_micro_batch(tensor, self.parallel_context))
        if self.router.training and self.router.bias_update_rate > 0:
            self.router.record_load(cp_part.expert_ids)
        return routing, cp_part, whole

    def kept_expert_ids(self, routing: Routing, whole: Routing, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's expert ids with -1 where the capacity limit drops the assignment -- decided
        on the whole micro-batch, as the single process does -- and the micro-batch's dropped count."""
        if self.capacity_factor is None:
            return routing.expert_ids, torch.zeros((), dtype=torch.long, device=routing.expert_ids.device)
        num_tokens = whole.expert_ids.shape[0]
        capacity = expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)
        kept = kept_assignments(whole.expert_ids, whole.weights, self.num_experts, capacity, self.drop_policy)
        own = own_part(kept.view(num_tokens, self.top_k), batch, self.parallel_context)
        return routing.expert_ids.masked_fill(~own, -1), kept.numel() - kept.sum()


# --- splitting a full layer ----------------------------------------------------------------------------------

def shard_expert_weight(full: nn.Parameter, ffn_dim: int, context, what: str) -> nn.Parameter:
    """This rank's experts (dim 0 over ep) of a stacked [E, ...] weight, split on ``ffn_dim`` over etp
    (the FFN width; the model width of the experts' down bias)."""
    num_local = full.shape[0] // context.ep_size
    local = full.detach().narrow(0, context.ep_rank * num_local, num_local)
    sizes = [full.shape[ffn_dim]]
    if context.etp_size > 1:
        if sizes[0] % context.etp_size:
            raise ConfigError(f"{what}: its split dim of {sizes[0]} is not divisible by parallel.etp="
                              f"{context.etp_size}; choose an etp that divides model.moe_ffn_hidden_size (and, "
                              "with model.moe_expert_linear_bias, the hidden size).")
        local = shard_tensor(local, ffn_dim, sizes, context.etp_rank, context.etp_size)
    shard = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
    mark_expert_shard(shard, ffn_dim if context.etp_size > 1 else None, sizes)
    return shard


@torch.no_grad()
def parallelize_expert_moe(layer: MoELayer, context) -> MoELayer:
    """Split a full ``MoELayer`` in place over the expert grid (see the module docstring)."""
    if layer.num_experts % context.ep_size:
        raise ConfigError(f"model.moe_num_experts={layer.num_experts} is not divisible by parallel.ep="
                          f"{context.ep_size}; each expert-parallel rank holds whole experts.")
    experts = layer.experts
    for name, ffn_dim in (("gate_weight", 1), ("up_weight", 1), ("down_weight", 2),  # [E, F, d], [E, d, F]
                          ("gate_bias", 1), ("up_bias", 1), ("down_bias", 1)):  # [E, F]; [E, d]: a share of d
        if getattr(experts, name) is not None:
            setattr(experts, name, shard_expert_weight(getattr(experts, name), ffn_dim, context, f"experts.{name}"))
    if experts.down_bias is not None and context.etp_size > 1:  # its columns of the partial sums (experts.py)
        share = experts.down_bias.shape[1]
        experts.down_bias_columns = (context.etp_rank * share, (context.etp_rank + 1) * share)
    experts.tensor_parallel = "expert grid"  # for a low-precision recipe (precision/model_recipe.py)
    if layer.shared_expert is not None and context.tp_size > 1:
        parallelize_mlp(layer.shared_expert, context)
    if context.tp_size > 1:  # applied to this rank's own tokens: a share of the gradient
        mark_partial_grad(layer.router, layer.latent_in_proj, layer.latent_out_proj)
    if context.sequence_parallel:  # reads x in attention's layout: whole over TP without SP
        mark_partial_grad(layer.shared_expert_gate)
    layer.__class__ = ExpertParallelMoELayer
    layer.parallel_context = context
    layer.dispatcher = build_dispatcher(context.moe_dispatcher, context, layer.num_experts)
    return layer


def moe_blocks(model):
    """Every MoE block of a language model, main stack and MTP depths."""
    blocks = list(model.blocks)
    if getattr(model, "mtp", None) is not None:
        blocks += [block for depth in model.mtp.depths for block in depth.blocks]
    return [block for block in blocks if block.kind == "E"]


def parallelize_experts(model, context):
    """With tp = 1 only the MoE blocks change (when the expert grid is not trivial)."""
    if needs_expert_parallel(context):
        for block in moe_blocks(model):
            parallelize_expert_moe(block.mixer, context)
    return model


def expert_parallel_names(model: nn.Module) -> set[str]:
    """Names of the expert-grid parameters (summed over edp, not dp_cp)."""
    return {name for name, param in model.named_parameters() if getattr(param, "expert_parallel", False)}


__all__ = ["ExpertParallelMoELayer", "enter_expert_grid", "expert_parallel_names", "leave_expert_grid",
           "needs_expert_parallel", "own_part", "whole_micro_batch", "parallelize_expert_moe", "parallelize_experts",
           "shard_expert_weight"]
