"""Sharding units: the pieces of a model that ZeRO-2/3 reduce and gather as one.

Fully sharded data parallelism (Rajbhandari et al. 2020, ZeRO stages 2 and 3; PyTorch FSDP, Zhao
et al. 2023) does not communicate parameter by parameter: the parameters of one *unit* -- here a
block -- sit together in one flat bucket, padded to a multiple of the DP size, so one
reduce-scatter sums the unit's gradients and one all-gather brings its parameters back. Rank r
owns the r-th contiguous 1/dp of every bucket (``grad_reducer.Bucket.shard``), exactly the
segments the ZeRO-1 optimizer already updates (``distributed_optimizer.owned_segments``).

The units of a language model, in forward order:

    embedding      ``embedding.*`` (a later pipeline stage's copy of a tied embedding too: it is
                   cut exactly like the first stage's, so the two can be summed shard by shard)
    blocks.i       every parameter of block i (its routed experts in their own bucket, under
                   expert parallelism: they are reduced over another group)
    tail           everything else: the final norm, the output projection, the MTP modules

Buckets follow the units in *backward* order (the tail first), like ``plan_buckets``'s reverse
layout, so ``bucket_size_mb`` plays no part here: a unit is one bucket whatever its size.
"""

from __future__ import annotations

import torch

from meshlm.parallel.data.grad_reducer import Bucket, BufferLayout

EMBEDDING, TAIL = "embedding", "tail"


def unit_of(name: str) -> str:
    """The unit holding parameter ``name``: 'embedding' (with learned positions), 'blocks.{i}' or 'tail'."""
    top, _, rest = name.partition(".")
    if top in ("embedding", "position_embedding"):
        return EMBEDDING
    if top == "blocks":
        return f"blocks.{rest.partition('.')[0]}"
    return TAIL


def block_index(unit: str) -> int | None:
    """i for 'blocks.i'; None for the embedding and the tail."""
    return int(unit.split(".")[1]) if unit.startswith("blocks.") else None


def forward_order(units) -> list[str]:
    """The units in the order a forward reaches them: embedding, blocks by index, tail."""
    def position(unit: str) -> tuple[int, int]:
        if unit == EMBEDDING:
            return (0, 0)
        index = block_index(unit)
        return (1, index) if index is not None else (2, 0)
    return sorted(set(units), key=position)


def plan_unit_buckets(shapes: list[torch.Size], units: list[str], pad_multiple: int) -> tuple[BufferLayout, dict]:
    """A flat layout with one bucket per unit, units in backward order (each unit's parameters in
    reverse order inside its bucket), every bucket padded to a multiple of ``pad_multiple``.
    Returns (layout, {unit: bucket index})."""
    offsets, bucket_of = [0] * len(shapes), [0] * len(shapes)
    buckets, bucket_of_unit, cursor = [], {}, 0
    for unit in reversed(forward_order(units)):
        members = [index for index in reversed(range(len(shapes))) if units[index] == unit]
        start = cursor
        for index in members:
            offsets[index], bucket_of[index] = cursor, len(buckets)
            cursor += shapes[index].numel()
        end = start + -(-(cursor - start) // pad_multiple) * pad_multiple
        bucket_of_unit[unit] = len(buckets)
        buckets.append(Bucket(start, end, tuple(members)))
        cursor = end
    return BufferLayout(tuple(shapes), tuple(offsets), tuple(buckets), tuple(bucket_of), cursor), bucket_of_unit


__all__ = ["EMBEDDING", "TAIL", "block_index", "forward_order", "plan_unit_buckets", "unit_of"]
