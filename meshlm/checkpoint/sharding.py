"""Where this rank's pieces of a tensor sit in the single-process ("global") tensor.

A distributed checkpoint stores every tensor in global coordinates -- the shape it has in one
process, without vocabulary padding -- as a set of rectangular *chunks*, each written by the
rank that holds it. A run at any other layout then asks for the chunks it holds in the new
layout and reads the overlaps (``meshlm/checkpoint/distributed.py``). This file is only the
coordinate arithmetic, derived from the metadata that parallel code puts on parameters
(``meshlm.parallel.tensor.sharding.mark_shard``):

* **Tensor parallelism** (``tensor_parallel``, ``partition_dim``, ``partition_sizes``): the
  dim is a concatenation of partitions (Mamba's in_proj rows are [z, x, B, C, dt]) and each
  partition is split evenly over the tp ranks, so rank r's local rows are

      local  [L_p, L_p + S_p/t)   ->   global  [G_p + r S_p/t, G_p + (r+1) S_p/t)

  for every partition p (L_p, G_p: the partition's start locally and globally). One TP shard
  is therefore one chunk per partition. ``unpadded_size`` cuts the global extent back to the
  real vocabulary; rows of padding belong to no chunk.
* **Expert parallelism** (``expert_parallel``): the expert dim 0 is one partition split over
  ep; expert tensor parallelism (``expert_partition_dim``, ``expert_partition_sizes``) splits
  an expert's FFN width over etp, like TP. Splits act on different dims.
* **ZeRO-1** (``meshlm.parallel.data.distributed_optimizer``): a rank owns a contiguous *flat*
  range [a, b) of a (local) parameter. ``flat_range_boxes`` cuts it into boxes that are each
  contiguous in row-major order -- a partial row, whole rows, a partial row (recursively for
  more dims) -- at most 2 * ndim - 1 of them; each box then goes through the splits above.
  Views into the flat buffer come from ``as_strided`` with the parameter's strides.
* Pipeline stages simply lack other stages' names; replicated tensors are one chunk at the
  origin on every replica, and the checkpoint writer keeps one copy.

A chunk is (global offsets, a view of this rank's storage shaped like the chunk), so saving
reads through the view and loading writes through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a rectangular block."""


@dataclass(frozen=True)
class Split:
    """One dim of a local tensor that is a shard: partitions, each split evenly over ``size`` ranks."""

    dim: int
    partition_sizes: tuple[int, ...]
    """Global sizes of the consecutive partitions along ``dim``."""
    rank: int
    size: int


def splits_of(param: torch.Tensor, context) -> list[Split]:
    """How ``param`` (a local shard, or a replicated tensor: no splits) is cut from the global one."""
    splits = []
    if context is None:
        return splits
    if getattr(param, "tensor_parallel", False) and context.tp_size > 1:
        splits.append(Split(param.partition_dim, tuple(param.partition_sizes), context.tp_rank, context.tp_size))
    if getattr(param, "expert_parallel", False) and context.ep_size > 1:
        splits.append(Split(0, (param.shape[0] * context.ep_size,), context.ep_rank, context.ep_size))
    if getattr(param, "expert_partition_dim", None) is not None and context.etp_size > 1:
        splits.append(Split(param.expert_partition_dim, tuple(param.expert_partition_sizes), context.etp_rank,
                            context.etp_size))
    dims = [split.dim for split in splits]
    if len(set(dims)) != len(dims):
        raise ValueError(f"two splits of one parameter act on the same dim ({dims}); the checkpoint "
                         "coordinates support one split per dim.")
    return splits


def global_shape(local_shape, splits: list[Split], param: torch.Tensor | None = None) -> tuple[int, ...]:
    """The single-process shape: every split dim back to its full size, vocabulary padding dropped."""
    shape = list(local_shape)
    for split in splits:
        shape[split.dim] = sum(split.partition_sizes)
    unpadded = getattr(param, "unpadded_size", None)
    if unpadded is not None and splits:
        shape[param.partition_dim] = min(shape[param.partition_dim], unpadded)
    return tuple(shape)


def to_global(box: Box, splits: list[Split], shape: tuple[int, ...]) -> list[tuple[Box, tuple[int, ...]]]:
    """A box of the local tensor -> [(local sub-box, its global offsets)], dropping padding."""
    items = [(box, box[0])]
    for split in splits:
        items = [piece for item in items for piece in _through_split(item, split)]
    clipped = []
    for (offsets, sizes), global_offsets in items:
        sizes = tuple(min(size, extent - start) for size, start, extent in zip(sizes, global_offsets, shape))
        if all(size > 0 for size in sizes):
            clipped.append(((offsets, sizes), global_offsets))
    return clipped


def _through_split(item, split: Split):
    (offsets, sizes), global_offsets = item
    dim, low, high = split.dim, offsets[split.dim], offsets[split.dim] + sizes[split.dim]
    local_start = global_start = 0
    for partition in split.partition_sizes:
        share = partition // split.size
        start, end = max(low, local_start), min(high, local_start + share)
        if start < end:
            mapped = global_start + split.rank * share + start - local_start
            yield ((_replace(offsets, dim, start), _replace(sizes, dim, end - start)),
                   _replace(global_offsets, dim, mapped))
        local_start += share
        global_start += partition


def _replace(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    return values[:index] + (value,) + values[index + 1:]


def flat_range_boxes(shape, start: int, end: int) -> list[Box]:
    """Elements [start, end) of a row-major tensor of ``shape`` as boxes, each contiguous in memory."""
    shape = tuple(shape)
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, end // inner
    if first == last:
        return [((first, *offsets), (1, *sizes)) for offsets, sizes in flat_range_boxes(shape[1:], start % inner,
                                                                                         end % inner)]
    boxes = []
    if start % inner:
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start % inner, inner)]
        first += 1
    if last > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:])))
    if end % inner:
        boxes += [((last, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, end % inner)]
    return boxes


def box_slices(offsets, sizes) -> tuple[slice, ...]:
    """The index of the block at ``offsets`` with ``sizes`` (one slice per dim)."""
    return tuple(slice(offset, offset + size) for offset, size in zip(offsets, sizes))


def box_view(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[box_slices(*box)]


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(tuple(shape)):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


def flat_box_view(flat: torch.Tensor, shape, first: int, box: Box) -> torch.Tensor:
    """The box of a ``shape``-d tensor whose elements [first, first + flat.numel()) are ``flat``."""
    strides = contiguous_strides(shape)
    origin = sum(offset * stride for offset, stride in zip(box[0], strides))
    return flat.as_strided(box[1], strides, flat.storage_offset() + origin - first)


Chunk = tuple[tuple[int, ...], torch.Tensor]
"""(global offsets, a view of local storage shaped like the chunk)."""


def tensor_chunks(param: torch.Tensor, tensor: torch.Tensor, context) -> tuple[tuple[int, ...], list[Chunk]]:
    """(global shape, chunks) of ``tensor``, a tensor shaped like the local ``param`` (its value,
    its fp32 master, an Adam moment): one chunk per TP partition, none for padding rows."""
    splits = splits_of(param, context)
    shape = global_shape(tensor.shape, splits, param)
    whole = ((0,) * tensor.dim(), tuple(tensor.shape))
    return shape, [(offsets, box_view(tensor, box)) for box, offsets in to_global(whole, splits, shape)]


def flat_chunks(param: torch.Tensor, flat: torch.Tensor, first: int, context) -> tuple[tuple[int, ...], list[Chunk]]:
    """(global shape, chunks) of ``flat``: elements [first, first + flat.numel()) of a tensor shaped
    like the local ``param`` (a ZeRO-1 segment of its master or moments)."""
    splits = splits_of(param, context)
    shape = global_shape(param.shape, splits, param)
    chunks = []
    for box in flat_range_boxes(param.shape, first, first + flat.numel()):
        for sub_box, offsets in to_global(box, splits, shape):
            chunks.append((offsets, flat_box_view(flat, param.shape, first, sub_box)))
    return shape, chunks


__all__ = ["Box", "Chunk", "Split", "box_slices", "box_view", "flat_box_view", "flat_chunks", "flat_range_boxes", "global_shape",
           "splits_of", "tensor_chunks", "to_global"]
