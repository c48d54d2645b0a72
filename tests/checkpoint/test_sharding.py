"""Global coordinates of local shards: TP partitions, vocabulary padding, ZeRO-1 flat ranges, EP."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from meshlm.checkpoint.sharding import flat_chunks, flat_range_boxes, tensor_chunks
from meshlm.parallel.tensor.sharding import mark_shard, shard_tensor


def context(tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, etp_size=1, etp_rank=0):
    return SimpleNamespace(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank, etp_size=etp_size,
                           etp_rank=etp_rank)


def assemble(shape, chunk_lists) -> tuple[torch.Tensor, torch.Tensor]:
    """Write every chunk into a NaN tensor of ``shape``; also count how often each element was written."""
    full, hits = torch.full(shape, float("nan")), torch.zeros(shape, dtype=torch.int64)
    for chunks in chunk_lists:
        for offsets, view in chunks:
            region = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
            full[region] = view
            hits[region] += 1
    return full, hits


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_flat_ranges_tile_into_contiguous_boxes(shape):
    numel = math.prod(shape)
    values = torch.arange(numel).reshape(shape)
    for start in range(numel):
        for end in range(start + 1, numel + 1):
            boxes = flat_range_boxes(shape, start, end)
            assert len(boxes) <= 2 * len(shape) - 1
            covered = []
            for offsets, sizes in boxes:
                block = values[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
                assert torch.equal(block, torch.arange(block[0], block[0] + block.numel()))  # contiguous
                covered += block.tolist()
            assert covered == list(range(start, end))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_partitions_map_back_to_the_global_tensor(tp_size):
    """Mamba-style in_proj rows [z, x, B, C, dt] and a row-parallel weight split on dim 1."""
    torch.manual_seed(0)
    for dim, sizes, shape in ((0, [8, 8, 4, 4, 4], (28, 3)), (1, [12], (2, 12))):
        full = torch.randn(shape)
        chunk_lists = []
        for rank in range(tp_size):
            local = shard_tensor(full, dim, sizes, rank, tp_size)
            mark_shard(local, dim, sizes)
            global_shape, chunks = tensor_chunks(local, local, context(tp_size, rank))
            assert global_shape == shape
            assert len(chunks) == len(sizes)  # one chunk per partition
            chunk_lists.append(chunks)
        assembled, hits = assemble(shape, chunk_lists)
        assert torch.equal(assembled, full) and torch.all(hits == 1)


def test_vocabulary_padding_is_left_out():
    full = torch.randn(10, 4)
    padded = torch.cat([full, torch.zeros(2, 4)])
    chunk_lists = []
    for rank in range(4):
        local = shard_tensor(padded, 0, [12], rank, 4)
        mark_shard(local, 0, [12], unpadded_size=10)
        global_shape, chunks = tensor_chunks(local, local, context(4, rank))
        assert global_shape == (10, 4)
        chunk_lists.append(chunks)
    assert chunk_lists[3][0][1].shape == (1, 4)  # rows 9 (real) and 10, 11 (padding) of the last rank
    assembled, hits = assemble((10, 4), chunk_lists)
    assert torch.equal(assembled, full) and torch.all(hits == 1)


@pytest.mark.parametrize("pieces", [2, 3, 5])
def test_zero_segments_of_a_tp_shard_map_back(pieces):
    """A TP shard of a partitioned matrix, flattened and cut into uneven ranges (ZeRO-1 over DP)."""
    torch.manual_seed(1)
    shape, sizes = (12, 5), [4, 4, 4]
    full = torch.randn(shape)
    chunk_lists = []
    for rank in range(2):
        local = shard_tensor(full, 0, sizes, rank, 2)
        mark_shard(local, 0, sizes)
        flat = local.reshape(-1).clone()
        cuts = [0, *sorted(torch.randperm(flat.numel() - 1)[:pieces - 1].add(1).tolist()), flat.numel()]
        for start, end in zip(cuts, cuts[1:]):
            buffer = torch.cat([torch.zeros(3), flat[start:end], torch.zeros(2)])  # a segment inside a bigger buffer
            segment = buffer[3:3 + end - start]
            global_shape, chunks = flat_chunks(local, segment, start, context(2, rank))
            assert global_shape == shape
            chunk_lists.append(chunks)
    assembled, hits = assemble(shape, chunk_lists)
    assert torch.equal(assembled, full) and torch.all(hits == 1)


def test_chunks_are_views_that_loading_writes_through():
    local = torch.zeros(4, 3)
    mark_shard(local, 0, [8])
    _, chunks = tensor_chunks(local, local, context(2, 1))
    offsets, view = chunks[0]
    assert offsets == (4, 0)
    view.copy_(torch.ones(4, 3))
    assert torch.all(local == 1)
    flat = torch.zeros(20)
    _, chunks = flat_chunks(local, flat[5:11], 2, context(2, 1))  # elements 2..7 of the shard
    for _, view in chunks:
        view.fill_(7)
    assert flat.nonzero().flatten().tolist() == list(range(5, 11))


def test_expert_parallel_and_expert_tensor_parallel_compose():
    full = torch.randn(4, 6, 3)  # [experts, ffn, hidden]
    chunk_lists = []
    for ep_rank in range(2):
        for etp_rank in range(3):
            local = full[2 * ep_rank:2 * ep_rank + 2, 2 * etp_rank:2 * etp_rank + 2].clone()
            local.expert_parallel = True
            local.expert_partition_dim, local.expert_partition_sizes = 1, [6]
            global_shape, chunks = tensor_chunks(local, local, context(ep_size=2, ep_rank=ep_rank, etp_size=3,
                                                                       etp_rank=etp_rank))
            assert global_shape == (4, 6, 3)
            chunk_lists.append(chunks)
    assembled, hits = assemble((4, 6, 3), chunk_lists)
    assert torch.equal(assembled, full) and torch.all(hits == 1)
