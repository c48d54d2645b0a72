"""A distributed checkpoint's tensors read whole, in one process, whatever layout saved them.

DCP can load without a process group: given one chunk per key that covers the whole global
tensor, its planner reads every stored chunk into it (``read_global_tensors``): every key of a
checkpoint (weights, fp32 masters, Adam moments) at once, to compare two checkpoints or look
inside one. The commands that read a model (``load_model``, ``meshlm checkpoint consolidate``,
``meshlm convert``) go one tensor at a time instead (``CheckpointShards`` in
``meshlm/checkpoint/materialize.py``). Files are checked against the completion marker's sizes
and CRC-32 before they are read.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.files import COMPLETE_FILE, METADATA_FILE, read_json
from meshlm.checkpoint.folders import check_folder, read_metadata, verify_files
from meshlm.checkpoint.global_state import GlobalTensor
from meshlm.checkpoint.planners import ChunkLoadPlanner, read_items_by_file
from meshlm.errors import CheckpointError


def read_global_tensors(directory, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole single-process tensors of a distributed checkpoint (all keys, or ``keys``), in one process."""
    directory = Path(directory)
    check_folder(directory)
    marker = read_json(directory / COMPLETE_FILE)
    metadata = read_metadata(directory, marker)
    stored = {key: value for key, value in metadata.state_dict_metadata.items()
              if isinstance(value, TensorStorageMetadata)}
    keys = sorted(stored) if keys is None else list(keys)
    missing = [key for key in keys if key not in stored]
    if missing:
        raise CheckpointError(f"{directory / METADATA_FILE} has no {', '.join(missing[:8])}.")
    tensors = {}
    for key in keys:
        value = torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype)
        tensors[key] = GlobalTensor(tuple(value.shape), value.dtype, [((0,) * value.dim(), value)])
    planner = ChunkLoadPlanner(tensors)
    verify_files(directory, read_items_by_file(planner, metadata), marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
        try:
            dcp.load({}, storage_reader=FileSystemReader(directory), planner=planner, no_dist=True)
        except Exception as error:
            raise CheckpointError(f"reading {directory} failed: {error}") from error
    return {key: tensor.chunks[0][1] for key, tensor in tensors.items()}


__all__ = ["read_global_tensors"]
