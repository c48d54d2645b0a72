"""record_communication counts a known sequence of collectives: calls and bytes per kind and group."""

import warnings

import torch
import torch.distributed as dist

from meshlm.parallel.collectives import (all_gather_along, all_reduce_coalesced_, all_to_all_along, copy_to_group,
                                         reduce_from_group, reduce_scatter_along)
from meshlm.parallel.comm_log import record_communication
from meshlm.parallel.groups import group_of
from tests.helpers.distributed import run_distributed

FLOAT32, FLOAT64 = 4, 8


def known_sequence() -> dict:
    """A tensor-parallel-like sequence on pairs of ranks, then a few world collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([start, start + 1]) for start in range(0, world, 2)]
    pair_group = pairs[rank // 2]
    pair = group_of(pair_group, "tp", torch.device("cpu"))
    original_all_reduce = dist.all_reduce
    with record_communication(labels={"tp": pair}) as log:
        x = torch.randn(2, 4, 3, requires_grad=True)
        copied = copy_to_group(x, pair)                          # backward: 1 all-reduce of 2*4*3
        reduced = reduce_from_group(copied * 2, pair)            # 1 all-reduce of 2*4*3
        gathered = all_gather_along(reduced, 1, pair)            # 1 all-gather, output 2*8*3
        scattered = reduce_scatter_along(gathered, 1, pair)      # 1 reduce-scatter, input 2*8*3
        exchanged = all_to_all_along(scattered, 1, 2, pair)      # 1 all-to-all of 2*4*3; backward too
        exchanged.sum().backward()                               # + reduce-scatter, all-gather, all-to-all
        all_reduce_coalesced_([torch.ones(5), torch.ones(2, 3, dtype=torch.float64), torch.ones(7)], None)
        world_group = group_of(dist.group.WORLD, "world", torch.device("cpu"))
        all_reduce_coalesced_([torch.ones(5), torch.ones(3)], world_group)  # one float32 buffer of 8
        dist.broadcast(torch.ones(10), src=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(torch.empty(world * 6), torch.ones(6))  # counted once
        with record_communication() as inner:
            dist.all_reduce(torch.ones(4), group=pair_group)
    restored = dist.all_reduce is original_all_reduce
    dist.all_reduce(torch.ones(4), group=pair_group)  # outside: not counted
    counts = {key: (count.calls, count.bytes, count.group_size, count.ring_bytes_sent)
              for key, count in log.counts.items()}
    return {"counts": counts, "inner": {key: count.calls for key, count in inner.counts.items()},
            "restored": restored, "summary": log.summary(), "world": world}


def test_counts_a_known_sequence_of_collectives():
    for rank, result in enumerate(run_distributed(known_sequence, 4, timeout_s=90)):
        world, counts = result["world"], result["counts"]
        pair_tensor, gathered = 2 * 4 * 3 * FLOAT32, 2 * 8 * 3 * FLOAT32
        expected = {
            ("all_reduce", "tp"): (2 + 1, 2 * pair_tensor + 4 * FLOAT32, 2, 2 * 1 / 2 * (2 * pair_tensor + 16)),
            ("all_gather", "tp"): (2, 2 * gathered, 2, 1 / 2 * 2 * gathered),
            ("reduce_scatter", "tp"): (2, 2 * gathered, 2, 1 / 2 * 2 * gathered),
            ("all_to_all", "tp"): (2, 2 * pair_tensor, 2, 1 / 2 * 2 * pair_tensor),
            ("all_reduce", "world"): (1, 8 * FLOAT32, world, 2 * 3 / 4 * 8 * FLOAT32),
            ("broadcast", "world"): (1, 10 * FLOAT32, world, 10 * FLOAT32),
            ("all_gather", "world"): (1, world * 6 * FLOAT32, world, 3 / 4 * world * 6 * FLOAT32),
        }
        assert counts == expected, (rank, counts)
        pair_ranks = (rank - rank % 2, rank - rank % 2 + 1)
        assert result["inner"] == {("all_reduce", str(pair_ranks)): 1}, "unlabelled groups are named by their ranks"
        assert result["restored"], "the originals are put back after the block"
        assert "reduce_scatter" in result["summary"] and "tp" in result["summary"]
