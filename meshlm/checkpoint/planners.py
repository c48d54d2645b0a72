"""torch.distributed.checkpoint (DCP) planners that speak in chunks of global tensors.

DCP splits a save into a *plan* (every rank lists the pieces it will write, the coordinator
merges the lists into the checkpoint's metadata) and the writes themselves; a load lists the
pieces each rank needs and DCP computes which stored pieces overlap them
(``create_read_items_for_chunk_list``: the resharding step). Its default planners take a
state dict of DTensors / ShardedTensors / plain tensors. Our shards do not fit those types
well: a TP shard of Mamba's in_proj is five separate blocks of the global tensor, and a ZeRO-1
segment of a flattened parameter is up to 2*ndim - 1 blocks. So these planners take the chunks
directly -- {key: GlobalTensor(shape, dtype, [(global offsets, view)])} from
``meshlm/checkpoint/global_state.py`` -- and emit one DCP WriteItem / ReadItem per chunk. Everything
else is DCP's own: the global plan, the deduplication of chunks that several replicas hold
(each is written once, by the least loaded of them), the check that the chunks of every
tensor tile it exactly, the file format, and the overlap arithmetic on load. (DTensor would
also have worked for even splits; ``_StridedShard`` placements could describe the partitioned
tensors, but not the ZeRO-1 segments, which end mid-row.)

Small non-tensor objects (each rank's RNG state) travel as BYTE_IO items.
"""

from __future__ import annotations

import dataclasses
import io

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


def _chunk(offsets, view: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape)


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes ``tensors`` ({key: GlobalTensor}) chunk by chunk, and ``objects`` ({key: picklable})."""

    def __init__(self, tensors: dict, objects: dict | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.objects = tensors, dict(objects or {})
        self.views = {(key, tuple(offsets)): view for key, tensor in tensors.items() for offsets, view in tensor.chunks}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, tensor in self.tensors.items():
            properties = TensorProperties(dtype=tensor.dtype)
            for offsets, view in tensor.chunks:
                items.append(WriteItem(index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=_chunk(offsets, view), properties=properties,
                                                                   size=torch.Size(tensor.shape))))
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self.objects[write_item.index.fqn], buffer)
            return buffer
        return self.views[(write_item.index.fqn, tuple(write_item.index.offset))].detach()


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into ``tensors``' chunk views; ``sources`` maps a requested key to the stored key it
    is read from (default: itself); ``objects`` are keys of BYTE_IO items, read into ``self.loaded``.
    The caller has checked that every source exists with the requested shape."""

    def __init__(self, tensors: dict, sources: dict[str, str] | None = None, objects: list[str] = ()):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors, self.sources, self.object_keys = tensors, dict(sources or {}), list(objects)
        self.loaded: dict[str, object] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, tensor in self.tensors.items():
            source = self.sources.get(key, key)
            chunks = [_chunk(offsets, view) for offsets, view in tensor.chunks]
            for item in create_read_items_for_chunk_list(source, self.metadata.state_dict_metadata[source], chunks):
                items.append(dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, fqn=key)))
        for key in self.object_keys:
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.tensors[read_item.dest_index.fqn].chunks[read_item.dest_index.index][1]
        return narrow_tensor_by_index(view, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the reader copied straight into our view

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def read_items_by_file(planner: ChunkLoadPlanner, metadata) -> dict[str, int]:
    """{file name: items read from it} for this rank's plan (to verify those files before reading)."""
    planner.set_up_planner({}, metadata)
    counts: dict[str, int] = {}
    for item in planner.create_local_plan().items:
        name = metadata.storage_data[item.storage_index].relative_path
        counts[name] = counts.get(name, 0) + 1
    return counts


__all__ = ["ChunkLoadPlanner", "ChunkSavePlanner", "read_items_by_file"]
