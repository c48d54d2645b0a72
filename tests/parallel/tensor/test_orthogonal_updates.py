"""Muon's Newton-Schulz on TP-cut matrices (meshlm/parallel/tensor/orthogonal_updates.py): dealt
round-robin over the TP ranks, each matrix is orthogonalized whole exactly once, and every rank
receives its shard of each result -- equal to orthogonalizing the whole matrices in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshlm.optim.muon import orthogonalize
from meshlm.parallel.groups import group_of
from meshlm.parallel.mesh import ParallelContext
from meshlm.parallel.tensor.orthogonal_updates import sharded_orthogonalizer
from meshlm.parallel.tensor.sharding import mark_shard, shard_tensor
from tests.helpers.distributed import run_distributed

MATRICES = [  # (name, whole shape, cut dim or None, partition sizes)
    ("blocks.0.mixer.in_proj.weight", (40, 16), 0, [8, 8, 16, 4, 4]),  # Mamba-like partitions
    ("blocks.1.mixer.q_proj.weight", (16, 16), 0, [16]),  # column-parallel
    ("blocks.1.mixer.k_proj.weight", (8, 16), None, None),  # replicated rows: whole everywhere
    ("blocks.1.mixer.o_proj.weight", (16, 32), 1, [32]),  # row-parallel
    ("blocks.3.mixer.up_proj.weight", (48, 16), 0, [48]),
    ("blocks.3.mixer.down_proj.weight", (16, 48), 1, [48]),
    ("mtp.depths.0.projection.weight", (16, 24), 1, [16, 8]),
]


def whole_matrices() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) for name, shape, _, _ in MATRICES}


def orthogonalize_on_ranks() -> dict:
    """In each spawned rank (the world is one TP group): this rank's shards through the
    orthogonalizer; what it returns and how many matrices this rank orthogonalized."""
    world, rank = dist.get_world_size(), dist.get_rank()
    context = ParallelContext(rank=rank, world_size=world, tp_size=world, tp_rank=rank,
                              tp_group=group_of(dist.group.WORLD, "tp", torch.device("cpu")))
    sources, named = [], []
    for name, whole in whole_matrices().items():
        _, _, dim, sizes = next(entry for entry in MATRICES if entry[0] == name)
        param = torch.nn.Parameter(whole if dim is None else shard_tensor(whole, dim, sizes, rank, world))
        if dim is not None:
            mark_shard(param, dim, sizes)
        sources.append((name, param))
        named.append((name, param.detach().clone()))
    calls = []

    def transform(matrix):
        calls.append(tuple(matrix.shape))
        return orthogonalize(matrix, 5)
    results = sharded_orthogonalizer(sources, context)(named, transform)
    return {"results": [(shard, tuple(shape)) for shard, shape in results], "calls": calls}


def test_each_cut_matrix_is_orthogonalized_once_and_every_rank_gets_its_shard():
    for world in (2, 4):
        by_rank = run_distributed(orthogonalize_on_ranks, world)
        wholes = whole_matrices()
        cut_count = sum(dim is not None for _, _, dim, _ in MATRICES)
        for rank, outcome in enumerate(by_rank):
            for (name, shape, dim, sizes), (shard, whole_shape) in zip(MATRICES, outcome["results"]):
                expected = orthogonalize(wholes[name], 5)
                if dim is not None:
                    expected = shard_tensor(expected, dim, sizes, rank, world)
                assert whole_shape == shape, (world, rank, name)
                torch.testing.assert_close(shard, expected, rtol=1e-5, atol=1e-6)
        # every cut matrix once over the group, dealt round-robin; the replicated one on every rank
        calls = [len(outcome["calls"]) - 1 for outcome in by_rank]
        assert sum(calls) == cut_count, (world, calls)
        assert max(calls) - min(calls) <= 1, (world, calls)
