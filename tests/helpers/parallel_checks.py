"""Small pieces the parallel layer tests share: seeded inputs, this rank's sequence slice, and
the check that every rank's errors are within tolerance."""

from __future__ import annotations

import torch

from meshlm.parallel.tensor.sharding import shard_tensor


def seeded(*shape, seed: int) -> torch.Tensor:
    """Standard-normal values of ``shape``, the same for a given seed on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def sequence_slice(full: torch.Tensor, context) -> torch.Tensor:
    """This rank's tokens of a [b, s, ...] tensor: its sequence-parallel slice under SP, else all."""
    if not context.sequence_parallel:
        return full
    return shard_tensor(full, 1, [full.shape[1]], context.tp_rank, context.tp_size)


def assert_all_within_tolerance(every_rank: list[dict], tolerance: float) -> None:
    """Every rank's {case: relative error} is at most ``tolerance`` (a NaN error fails too)."""
    for rank, errors in enumerate(every_rank):
        bad = {case: error for case, error in errors.items() if not error <= tolerance}
        assert not bad, f"rank {rank}: {bad}"
