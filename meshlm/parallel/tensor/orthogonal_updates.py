"""Muon's Newton-Schulz on matrices that tensor parallelism cuts: each matrix whole on one rank.

Orthogonalizing a shard is not orthogonalizing the matrix (``meshlm/optim/muon.py``), so a
TP-cut matrix must be whole somewhere. Gathering it on every rank of the group and running
Newton-Schulz there would repeat the same work t times. Instead the matrices a step orthogonalizes
are dealt round-robin over the ranks of the group that cuts them: in each round of t matrices,
rank j owns the j-th. One all-to-all sends every rank's shard of matrix j to rank j (which
reassembles the whole matrix with the checkpoints' shard bookkeeping -- Mamba's in_proj is [z, x,
B, C, dt], each partition split on its own: ``unshard_tensor``), each owner orthogonalizes its
matrix, and a second all-to-all sends every rank its shard of every result. Per round a rank
sends and receives 2 (t - 1) shards -- an all-gather of each matrix on every rank would move
t (t - 1) -- and runs one Newton-Schulz instead of t.

Which group cuts a matrix: TP for a dense weight marked ``tensor_parallel``
(``meshlm/parallel/tensor/sharding.py``), ETP for an expert weight split on its FFN width
(``expert_partition_dim``); the EP split of the expert dim leaves whole experts on each rank,
and replicated weights (KV projections with fewer heads than TP ranks) are whole already: those
are orthogonalized where they are, by every rank that holds them (the same values everywhere).
The ranks of a group call with the same names in the same order (the optimizer's parameter
order, and under ZeRO the same owned segments: TP peers cut the same flat layout), so the rounds
line up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlm.parallel.plain_collectives import all_to_all_
from meshlm.parallel.tensor.sharding import shard_tensor, unshard_tensor


@dataclass(frozen=True)
class MatrixCut:
    """How a parallel group cuts one matrix: ``dim`` of the whole matrix is a concatenation of
    ``partition_sizes``, each split evenly over the ``size`` ranks of ``group`` (``label`` names it)."""

    label: str
    group: object
    rank: int
    size: int
    dim: int
    partition_sizes: tuple[int, ...]

    def whole_shape(self, shard: torch.Tensor) -> torch.Size:
        shape = list(shard.shape)
        shape[self.dim] = sum(self.partition_sizes)
        return torch.Size(shape)

    def whole(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return unshard_tensor(shards, self.dim, list(self.partition_sizes))

    def shard(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        return shard_tensor(whole, self.dim, list(self.partition_sizes), rank, self.size)


def matrix_cut(param: torch.Tensor, context) -> MatrixCut | None:
    """The group that cuts ``param``'s rows or columns, or None where it is whole on this rank."""
    if getattr(param, "tensor_parallel", False) is True and context.tp_size > 1:
        if getattr(param, "unpadded_size", None) is not None:
            raise ValueError("a vocabulary shard (padded rows) is not a hidden matrix.")
        return MatrixCut("tp", context.tp_group, context.tp_rank, context.tp_size, param.partition_dim,
                         tuple(param.partition_sizes))
    etp_dim = getattr(param, "expert_partition_dim", None)
    if etp_dim is not None and context.etp_size > 1:
        return MatrixCut("etp", context.etp_group, context.etp_rank, context.etp_size, etp_dim,
                         tuple(param.expert_partition_sizes))
    return None


def orthogonalize_round(shards: list[torch.Tensor], cuts: list[MatrixCut], transform: Callable) -> list[torch.Tensor]:
    """``transform`` of the whole matrix of each of ``shards`` (this rank's shards of up to
    ``size`` matrices, the j-th owned by rank j, all cut by one group), as this rank's shards.
    Collective over the group: two all-to-alls."""
    group, rank, size = cuts[0].group, cuts[0].rank, cuts[0].size
    device = shards[0].device
    numels = [shard.numel() for shard in shards] + [0] * (size - len(shards))
    incoming = torch.empty(size * numels[rank], dtype=torch.float32, device=device)
    outgoing = torch.cat([shard.reshape(-1).float() for shard in shards])
    all_to_all_(incoming, outgoing, group, output_splits=[numels[rank]] * size, input_splits=numels)
    results = torch.empty(0, dtype=torch.float32, device=device)
    if rank < len(shards):  # this rank owns a matrix of the round: reassemble, transform, cut for every rank
        cut, shape = cuts[rank], shards[rank].shape
        done = transform(cut.whole(list(incoming.view(size, *shape).unbind(0))))
        results = torch.cat([cut.shard(done, peer).reshape(-1) for peer in range(size)])
    back = torch.empty(sum(numels), dtype=torch.float32, device=device)
    all_to_all_(back, results, group, output_splits=numels, input_splits=[numels[rank]] * size)
    return [piece.view(shard.shape) for piece, shard in zip(back.split(numels[:len(shards)]), shards)]


def sharded_orthogonalizer(named_sources, context):
    """``orthogonalize_many(named, transform) -> [(result shard, whole shape)]`` for Muon over
    parameters cut by ``context``'s TP/ETP groups (the model's parameters carry the shard
    metadata; the optimizer's fp32 masters may not), or None where no group cuts a matrix."""
    if context is None or (context.tp_size == 1 and getattr(context, "etp_size", 1) == 1):
        return None
    sources = dict(named_sources)

    def orthogonalize_many(named: list[tuple[str, torch.Tensor]], transform: Callable) -> list:
        results: list = [None] * len(named)
        by_group: dict[str, list[tuple[int, MatrixCut]]] = {}
        for position, (name, tensor) in enumerate(named):
            cut = matrix_cut(sources[name], context)
            if cut is None:
                results[position] = (transform(tensor), tensor.shape)
            else:
                by_group.setdefault(cut.label, []).append((position, cut))
        for members in by_group.values():  # the same groups, matrices and order on every peer
            size = members[0][1].size
            for first in range(0, len(members), size):
                round_members = members[first:first + size]
                shards = [named[position][1] for position, _ in round_members]
                done = orthogonalize_round(shards, [cut for _, cut in round_members], transform)
                for (position, cut), shard in zip(round_members, done):
                    results[position] = (shard, cut.whole_shape(shard))
        return results
    return orthogonalize_many


__all__ = ["MatrixCut", "matrix_cut", "orthogonalize_round", "sharded_orthogonalizer"]
