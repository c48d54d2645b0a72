"""Give a model built on the ``meta`` device its values, one tensor at a time, shards only.

A parallel run never builds its model whole. Every rank builds the single-process model on the
``meta`` device (shapes, no storage), cuts it down to its share exactly as it would cut a real
one (tensor, expert and pipeline parallelism: ``meshlm/parallel/``), and only then allocates
storage -- for its shards -- and fills it. The values come from a *source of global tensors*:
something that, asked for a box of a single-process tensor, returns it.

    InitialValues     the initialization rules (``meshlm/models/init.py``): each tensor from its
                      own generator seeded by (seed, name), so a shard equals the slice of the
                      single-process model. The tensor is computed whole (one, never the model),
                      sliced, and dropped.
    SafetensorsFile   a model folder's ``model.safetensors``, read by slice (``get_slice``): a
                      rank reads its boxes only.
    CheckpointShards  a distributed training checkpoint: DCP reads the overlaps of the stored
                      chunks with this rank's boxes (``meshlm/checkpoint/planners.py``).

Where a local tensor sits in the global one comes from the same metadata the checkpoints use
(``meshlm/checkpoint/sharding.py``: one box per tensor-parallel partition, expert slices,
vocabulary padding left at zero), so a rank's values are, by construction, those it would hold
had it built the whole model and kept its slices. The peak is the rank's shards plus one full
tensor (``InitialValues``) or plus nothing (the files).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.files import COMPLETE_FILE, METADATA_FILE, read_json
from meshlm.checkpoint.folders import check_folder, read_metadata, verify_files
from meshlm.checkpoint.global_state import GlobalTensor
from meshlm.checkpoint.planners import ChunkLoadPlanner, read_items_by_file
from meshlm.checkpoint.sharding import tensor_chunks
from meshlm.errors import CheckpointError
from meshlm.models.init import init_rules, initial_value
from meshlm.models.language_model import LanguageModel


def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied ones once) and persistent buffer of ``model``, by name."""
    tensors = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set and buffer is not None:
                tensors[f"{module_name}.{name}" if module_name else name] = buffer
    return tensors


def _replace(model: nn.Module, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Put ``new`` wherever ``old`` is registered (a parameter keeps its attributes: the shard marks)."""
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for key, value in registry.items():
                if value is old:
                    registry[key] = new
    return new


@torch.no_grad()
def materialize(model: nn.Module, context, source, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Allocate ``model``'s meta tensors on ``device`` (parameters in ``dtype``) and fill them from
    ``source``; tensors already holding values are left alone. Returns ``model``."""
    targets = {}
    for name, tensor in local_tensors(model).items():
        if not tensor.is_meta:
            continue
        value_dtype = dtype if isinstance(tensor, nn.Parameter) and tensor.is_floating_point() else tensor.dtype
        value = torch.zeros(tensor.shape, dtype=value_dtype, device=device)  # padding rows stay zero
        value = _replace(model, tensor, value)
        shape, chunks = tensor_chunks(value, value.data, context)
        targets[name] = GlobalTensor(shape, value.dtype, chunks)
    source.fill(targets)
    return model


class InitialValues:
    """The initial values of the model ``config`` with ``seed`` (see ``meshlm/models/init.py``)."""

    def __init__(self, config, seed: int):
        with torch.device("meta"):
            reference = LanguageModel(config, seed=seed)
        self.config, self.seed = config, int(seed)
        self.rules = init_rules(reference, config)
        self.shapes = {name: tuple(tensor.shape) for name, tensor in local_tensors(reference).items()}

    def fill(self, targets: dict[str, GlobalTensor]) -> None:
        for name, target in targets.items():
            if name not in self.rules:
                raise KeyError(f"{name} is not a tensor of the single-process model; cannot initialize it.")
            full = initial_value(self.rules[name], name, self.shapes[name], self.seed)
            _copy_boxes(full, target)
            del full  # one full tensor at a time


class SafetensorsFile:
    """A ``model.safetensors`` read box by box; ``rename`` maps a model name to the file's key."""

    def __init__(self, path: str | Path, rename=None):
        self.path = Path(path)
        self.rename = rename or (lambda name: name)

    def fill(self, targets: dict[str, GlobalTensor]) -> None:
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(self.path), framework="pt") as file:
                keys = set(file.keys())
                _check_names(targets, keys, self.rename, self.path)
                for name, target in targets.items():
                    stored = file.get_slice(self.rename(name))
                    _check_shape(name, tuple(stored.get_shape()), target.shape, self.path)
                    for offsets, view in target.chunks:
                        box = tuple(slice(start, start + size) for start, size in zip(offsets, view.shape))
                        view.copy_(stored[box] if box else stored[:])
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{self.path}: unreadable or truncated safetensors file ({error}).") from error


class CheckpointShards:
    """A distributed checkpoint's ``model/NAME`` tensors (or ``master/NAME``, its fp32 masters,
    when it has them), read chunk by chunk by this process alone."""

    def __init__(self, directory: str | Path, prefer_masters: bool = True):
        self.directory = Path(directory)
        self.prefer_masters = prefer_masters

    def fill(self, targets: dict[str, GlobalTensor]) -> None:
        check_folder(self.directory)
        marker = read_json(self.directory / COMPLETE_FILE)
        metadata = read_metadata(self.directory, marker)
        stored = {key: value for key, value in metadata.state_dict_metadata.items()
                  if isinstance(value, TensorStorageMetadata)}

        def key_of(name: str) -> str:
            master = f"master/{name}"
            return master if self.prefer_masters and master in stored else f"model/{name}"

        _check_names(targets, set(stored), key_of, self.directory / METADATA_FILE)
        requests = {}
        for name, target in targets.items():
            key = key_of(name)
            _check_shape(name, tuple(stored[key].size), target.shape, self.directory / METADATA_FILE)
            requests[key] = _in_stored_dtype(target, stored[key].properties.dtype)
        planner = ChunkLoadPlanner({key: request for key, (request, _) in requests.items()})
        verify_files(self.directory, read_items_by_file(planner, metadata), marker)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            try:
                dcp.load({}, storage_reader=FileSystemReader(self.directory), planner=planner, no_dist=True)
            except Exception as error:
                raise CheckpointError(f"reading {self.directory} failed: {error}") from error
        for request, copies in requests.values():
            for staged, view in copies:
                view.copy_(staged)


def _in_stored_dtype(target: GlobalTensor, dtype: torch.dtype):
    """(a request in the stored dtype, [(staging tensor, live view)] to copy after reading): DCP
    reads into tensors of the stored dtype; the run's dtype may differ (bf16 saved, fp32 run)."""
    if dtype == target.dtype:
        return target, []
    staged = [(offsets, torch.empty(view.shape, dtype=dtype, device=view.device)) for offsets, view in target.chunks]
    copies = [(staging, view) for (_, staging), (_, view) in zip(staged, target.chunks)]
    return GlobalTensor(target.shape, dtype, staged), copies


def _copy_boxes(full: torch.Tensor, target: GlobalTensor) -> None:
    for offsets, view in target.chunks:
        box = tuple(slice(start, start + size) for start, size in zip(offsets, view.shape))
        view.copy_(full[box])


def _check_names(targets: dict, keys: set, key_of, where: Path) -> None:
    missing = sorted(name for name in targets if key_of(name) not in keys)
    if missing:
        raise CheckpointError(f"{where} lacks {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; "
                              "is it a checkpoint of this model?")


def _check_shape(name: str, stored: tuple, expected: tuple, where: Path) -> None:
    if tuple(stored) != tuple(expected):
        raise CheckpointError(f"{where}: {name} has shape {tuple(stored)}, the model needs {tuple(expected)}; "
                              "the folder holds a different model.")


__all__ = ["CheckpointShards", "InitialValues", "SafetensorsFile", "local_tensors", "materialize"]
