"""Token dispatchers: carry each token to the ranks that hold its experts, and the outputs back.

Under expert parallelism (GShard, Lepikhin et al. 2020; Megatron Core MoE) the E routed experts
are split over the ``ep`` ranks of an expert-parallel (EP) group: EP rank j holds the contiguous
experts [j E/ep, (j+1) E/ep). With expert tensor parallelism (etp > 1) each of those experts is
further split on its FFN width over the ``etp`` ranks of an ETP group, like a tensor-parallel
MLP (gate/up by output rows, down by input columns), so a token must reach *every* ETP rank of
its expert's EP rank and their partial outputs must be summed. Every rank starts with its own,
distinct tokens (``expert_parallel.py`` explains how they are chosen) and their routing.

Both dispatchers begin and end the same way. The ETP group all-gathers its tokens and routing,
so that its etp ranks share one *source* token set U (sequence parallelism's all-gather), and
at the end the partial outputs for U are reduce-scattered over ETP, every rank keeping the sum
for its own tokens (the adjoint pair; both are no-ops when etp is 1). In between:

* **all-gather**: every rank of the EP group all-gathers the group's U, runs its local experts
  on the assignments routed to them, weights the outputs and adds them into a [tokens, d]
  partial sum that a reduce-scatter over EP adds up across the experts' owners, returning each
  rank its own rows. No counts to exchange and nothing data-dependent in the communication, but
  every rank receives every token of the group: (ep-1)/ep of them cross the wire whatever the
  routing.
* **all-to-all**: the kept assignments of U are permuted by expert, which is also by destination
  rank (each rank owns a contiguous range of experts); the per-expert row counts are exchanged
  first (an all-to-all of E integers), so every rank knows how many rows it will receive from
  every source for every local expert; then the rows travel in one uneven all-to-all. The
  received rows come in (source, expert) order and are regrouped into (expert, source) order so
  that each local expert's rows are contiguous for the grouped computation. The outputs return
  the same way backwards: regrouped back, the reverse all-to-all, then ``unpermute``. Each rank
  sends exactly its k |U| assignment rows (fewer when tokens are dropped).

Dropping is the caller's decision, made once from the routing of the whole micro-batch so that
it is the single-process one: the expert id of a dropped assignment is -1 and no dispatcher
sends it. A rank may send or receive zero rows, and an expert may get none: every exchange and
the grouped computation take empty pieces, and every rank runs every collective in the same
order whatever its counts, so no rank waits for a message that never comes.

The routing weights never travel with the tokens: they are applied on the token side, by
``unpermute`` over U, after the outputs are back. The weights of U are all-gathered over ETP
(and, for the all-gather dispatcher, over EP) with the autograd-aware all-gather, whose adjoint
sums the partial weight gradients of the ranks holding expert shards.

``dispatch`` only *starts* the token all-to-all; the caller computes something independent (the
shared expert) and then asks for the rows (``Dispatched.expert_rows``), so that the exchange
overlaps that computation where the backend runs collectives in the background.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.errors import ConfigError
from meshlm.models.moe.dispatch import DispatchPlan, count_per_expert, permute, plan_dispatch, unpermute
from meshlm.parallel.collectives import (PendingExchange, all_gather_along, all_to_all_along, all_to_all_uneven,
                                         gather_along, reduce_scatter_along, start_all_to_all_uneven)

DISPATCHERS = ("all_to_all", "all_gather")


@dataclass
class Dispatched:
    """A dispatch in progress: what ``combine`` needs to bring the outputs home."""

    plan: DispatchPlan
    """The permutation of the source token set whose rows were sent."""
    num_source_tokens: int
    pending: PendingExchange
    """The rows for this rank's experts (possibly still in flight)."""
    tokens_per_local_expert: torch.Tensor
    """[E/ep] rows each local expert processes."""
    rows_per_source: torch.Tensor
    """[E/ep, EP sources]: how many of each local expert's rows came from each EP rank, in that
    order within the expert (a low-precision recipe quantizes them apart)."""
    by_local_expert: torch.Tensor | None = None
    """all-to-all: the order that turns received (source, expert) rows into (expert, source) rows."""
    input_splits: list[int] | None = None
    """all-to-all: rows sent to each EP rank."""
    output_splits: list[int] | None = None
    """all-to-all: rows received from each EP rank."""

    def expert_rows(self) -> torch.Tensor:
        """Wait for the exchange; the rows grouped by local expert (for ``GroupedExperts``)."""
        rows = self.pending.wait()
        return rows if self.by_local_expert is None else rows.index_select(0, self.by_local_expert)


class TokenDispatcher:
    """The part both dispatchers share: the ETP gather of the source set, and the weighted combine."""

    def __init__(self, context, num_experts: int):
        self.ep_group, self.etp_group = context.ep_group, context.etp_group
        self.ep_size, self.num_experts = context.ep_size, num_experts
        self.num_local_experts = num_experts // context.ep_size
        self.first_local_expert = context.ep_rank * self.num_local_experts

    def gathered(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rows of the source set from every rank that shares it (autograd: adjoint sums)."""
        return all_gather_along(tensor, 0, self.etp_group)

    def scattered(self, partial: torch.Tensor) -> torch.Tensor:
        """The adjoint of ``gathered``: sum the partial rows over those ranks, keep one's own."""
        return reduce_scatter_along(partial, 0, self.etp_group)

    def gathered_ids(self, expert_ids: torch.Tensor) -> torch.Tensor:
        return gather_along(expert_ids, 0, self.etp_group)

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> Dispatched:
        """Start moving ``tokens`` [n, d] to their experts ``expert_ids`` [n, k] (-1: dropped)."""
        raise NotImplementedError

    def returned_rows(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The experts' output rows back in the plan's order, on the source side."""
        raise NotImplementedError

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weight * expert output for this rank's own tokens: [n, d]."""
        rows = self.returned_rows(expert_output, dispatched)
        partial = unpermute(rows, dispatched.plan, self.gathered(weights), dispatched.num_source_tokens)
        return self.scattered(partial)


class AllToAllDispatcher(TokenDispatcher):
    """Permute by destination, exchange counts, then rows (see the module docstring)."""

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> Dispatched:
        source, source_ids = self.gathered(tokens), self.gathered_ids(expert_ids)
        plan = plan_dispatch(source_ids, None, self.num_experts, kept=source_ids >= 0)
        sent_counts = plan.tokens_per_expert.view(self.ep_size, self.num_local_experts)
        received_counts = all_to_all_along(sent_counts, 0, 0, self.ep_group)  # row i: from rank i
        input_splits, output_splits = sent_counts.sum(1).tolist(), received_counts.sum(1).tolist()
        pending = start_all_to_all_uneven(permute(source, plan), output_splits, input_splits, self.ep_group)
        return Dispatched(plan, source.shape[0], pending, received_counts.sum(0), received_counts.t(),
                          by_local_expert_order(received_counts), input_splits, output_splits)

    def returned_rows(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        by_source = expert_output.index_select(0, inverse_permutation(dispatched.by_local_expert))
        return all_to_all_uneven(by_source, dispatched.input_splits, dispatched.output_splits, self.ep_group)


class AllGatherDispatcher(TokenDispatcher):
    """Gather the EP group's tokens, run the local experts on their share, reduce-scatter back."""

    def gathered(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_gather_along(super().gathered(tensor), 0, self.ep_group)

    def scattered(self, partial: torch.Tensor) -> torch.Tensor:
        return super().scattered(reduce_scatter_along(partial, 0, self.ep_group))

    def gathered_ids(self, expert_ids: torch.Tensor) -> torch.Tensor:
        return gather_along(super().gathered_ids(expert_ids), 0, self.ep_group)

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> Dispatched:
        source, source_ids = self.gathered(tokens), self.gathered_ids(expert_ids)
        local_ids = source_ids - self.first_local_expert
        mine = (source_ids >= 0) & (local_ids >= 0) & (local_ids < self.num_local_experts)
        plan = plan_dispatch(local_ids, None, self.num_local_experts, kept=mine)
        per_source = torch.stack([count_per_expert(ids[kept], self.num_local_experts) for ids, kept in
                                  zip(local_ids.chunk(self.ep_size), mine.chunk(self.ep_size))], dim=1)
        return Dispatched(plan, source.shape[0], PendingExchange(permute(source, plan)), plan.tokens_per_expert,
                          per_source)

    def returned_rows(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return expert_output


def by_local_expert_order(counts: torch.Tensor) -> torch.Tensor:
    """Rows arrive as consecutive chunks of ``counts`` [sources, local experts] rows, in (source,
    expert) order; the index that lists them in (expert, source) order instead."""
    num_sources, num_local = counts.shape
    chunk_of_row = torch.arange(num_sources * num_local, device=counts.device).repeat_interleave(counts.flatten())
    return torch.sort(chunk_of_row % num_local, stable=True).indices


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def build_dispatcher(name: str, context, num_experts: int) -> TokenDispatcher:
    """The dispatcher ``parallel.moe_dispatcher`` names, over ``context``'s EP and ETP groups."""
    if name not in DISPATCHERS:
        raise ConfigError(f"parallel.moe_dispatcher={name!r} is not one of {', '.join(DISPATCHERS)}.")
    return (AllToAllDispatcher if name == "all_to_all" else AllGatherDispatcher)(context, num_experts)


__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "DISPATCHERS", "Dispatched", "TokenDispatcher",
           "build_dispatcher", "by_local_expert_order", "inverse_permutation"]
