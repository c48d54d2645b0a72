"""Token permutation: group the router's (token, expert) assignments by expert, and back.

After routing, token j visits experts ``expert_ids[j, 0..k-1]``. The experts are fastest when
each one sees its tokens as one contiguous block, so the n*k assignments are *permuted*:
flattened (assignment a = j*k + slot), stable-sorted by expert id, and the token rows gathered
into one [m, d] tensor whose first ``tokens_per_expert[0]`` rows go to expert 0, the next to
expert 1, and so on (Megatron Core's token permutation). Within an expert, rows keep token
order. ``unpermute`` is the adjoint: it multiplies each expert output row by its routing weight
and adds it back into its token's row (index_add), which sums over the token's k visits.

Capacity (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021). With a
capacity factor c each expert accepts at most C = ceil(c * n * k / E) assignments; beyond that
it keeps the best ones and *drops* the rest: by routing weight (policy "probs", ties to the
earlier assignment) or by arrival order (policy "position", earliest tokens first). A dropped
assignment contributes nothing; a token whose every assignment is dropped gets a zero MoE
output, so its block output is just the residual (plus the shared expert, if any).

Everything here is a pure function of tensors, so that expert parallelism can later insert an
all-to-all between ``permute`` and the experts, and its inverse before ``unpermute``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DROP_POLICIES = ("probs", "position")


@dataclass
class DispatchPlan:
    """Where each permuted row comes from; built once per forward by ``plan_dispatch``."""

    assignment_ids: torch.Tensor
    """[m] int64: flat assignment index (token * k + slot) of each permuted row, grouped by
    expert; only the kept assignments (m = n*k when nothing is dropped)."""
    token_ids: torch.Tensor
    """[m] int64: the token each permuted row is a copy of (assignment_ids // k)."""
    tokens_per_expert: torch.Tensor
    """[E] int64: rows each expert processes (after dropping); sums to m."""
    dropped: torch.Tensor
    """Scalar int64: number of assignments dropped by the capacity limit."""


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * tokens * top_k / experts): the most assignments one expert takes."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def count_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many of ``expert_ids`` (any shape, values in [0, E)) name each expert.

    The counts ``torch.bincount(ids, minlength=E)`` gives, but with a shape that does not depend on
    the data: bincount's output grows past ``minlength`` for a larger id, so ``torch.compile`` must
    break the graph at it (a "dynamic shape operator"); adding ones into E fixed slots compiles
    into the block's graph, and integer sums do not depend on the order of the adds.
    """
    flat = expert_ids.flatten().long()
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def rank_within_expert(sorted_expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For ids already grouped by expert, each entry's 0-based position inside its group."""
    counts = count_per_expert(sorted_expert_ids, num_experts)
    group_starts = counts.cumsum(0) - counts
    return torch.arange(sorted_expert_ids.numel(), device=sorted_expert_ids.device) - group_starts[sorted_expert_ids]


def kept_assignments(expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     capacity: int, drop_policy: str) -> torch.Tensor:
    """Bool mask [n*k] of the assignments that fit in their expert's capacity.

    Each expert's assignments are put in priority order (highest weight first for "probs", the
    original order for "position"; stable sorts keep earlier assignments first among equals)
    and the first ``capacity`` of them are kept.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r} is not one of {', '.join(DROP_POLICIES)}.")
    flat_experts = expert_ids.flatten()
    priority = torch.arange(flat_experts.numel(), device=flat_experts.device)
    if drop_policy == "probs":
        priority = torch.sort(weights.detach().flatten(), descending=True, stable=True).indices
    by_expert = torch.sort(flat_experts[priority], stable=True).indices
    order = priority[by_expert]
    keep = torch.zeros_like(flat_experts, dtype=torch.bool)
    keep[order] = rank_within_expert(flat_experts[order], num_experts) < capacity
    return keep


def plan_dispatch(expert_ids: torch.Tensor, weights: torch.Tensor | None, num_experts: int,
                  capacity: int | None = None, drop_policy: str = "probs",
                  kept: torch.Tensor | None = None) -> DispatchPlan:
    """Group the assignments ``expert_ids`` [n, k] by expert, dropping beyond ``capacity``.

    ``kept`` ([n, k] bool) instead keeps exactly the assignments it marks: expert parallelism
    decides dropping once, from the routing of the whole micro-batch (meshlm/parallel/expert/expert_parallel.py).
    """
    top_k = expert_ids.shape[1]
    flat_experts = expert_ids.flatten()
    assignment_ids = torch.arange(flat_experts.numel(), device=flat_experts.device)
    if kept is not None:
        assignment_ids = assignment_ids[kept.flatten()]
    elif capacity is not None:
        assignment_ids = assignment_ids[kept_assignments(expert_ids, weights, num_experts, capacity, drop_policy)]
    kept_experts = flat_experts[assignment_ids]
    order = torch.sort(kept_experts, stable=True).indices
    assignment_ids = assignment_ids[order]
    return DispatchPlan(
        assignment_ids=assignment_ids,
        token_ids=assignment_ids // top_k,
        tokens_per_expert=count_per_expert(kept_experts, num_experts),
        dropped=torch.tensor(flat_experts.numel() - assignment_ids.numel(), device=flat_experts.device),
    )


def permute(tokens: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Rows of ``tokens`` [n, d] copied into expert order: [m, d]."""
    return tokens.index_select(0, plan.token_ids)


def unpermute(expert_output: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """sum over a token's kept visits of weight * expert output: [m, d] -> [n, d].

    Accumulates in the weights' dtype (fp32 from the router) and returns the experts' dtype.
    """
    row_weights = weights.flatten().index_select(0, plan.assignment_ids)
    weighted = expert_output.to(row_weights.dtype) * row_weights.unsqueeze(-1)
    combined = weighted.new_zeros(num_tokens, expert_output.shape[-1])
    combined = combined.index_add(0, plan.token_ids, weighted)
    return combined.to(expert_output.dtype)
