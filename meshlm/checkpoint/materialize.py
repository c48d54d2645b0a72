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
    SafetensorsFile   a model folder's ``model.safetensors``, read by slice (a read-only mapping,
                      ``meshlm/checkpoint/safetensors_stream.py``): a rank reads its boxes only.
    CheckpointShards  a distributed training checkpoint: DCP reads the overlaps of the stored
                      chunks with this rank's boxes (``meshlm/checkpoint/planners.py``).

The two file sources also say what they hold without reading it (``layout``: {name: (shape,
stored dtype)}), and ``read_tensor(source, name)`` reads one whole tensor: what the one-process
commands (load, consolidate, convert, upcycle) use to go through a model one tensor at a time.

Where a local tensor sits in the global one comes from the same metadata the checkpoints use
(``meshlm/checkpoint/sharding.py``: one box per tensor-parallel partition, expert slices,
vocabulary padding left at zero), so a rank's values are, by construction, those it would hold
had it built the whole model and kept its slices. The peak is the rank's shards plus one full
tensor (``InitialValues``) or plus the box being copied (the files).
"""

from __future__ import annotations

import warnings
from functools import cached_property
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
from meshlm.checkpoint.safetensors_stream import SafetensorsReader
from meshlm.checkpoint.sharding import box_slices, box_view, tensor_chunks
from meshlm.errors import CheckpointError
from meshlm.models.init import init_rules, initial_value, state_tensors
from meshlm.models.language_model import LanguageModel


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
                dtype: torch.dtype | dict[str, torch.dtype] = torch.float32) -> nn.Module:
    """Allocate ``model``'s meta tensors on ``device`` and fill them from ``source``; tensors
    already holding values are left alone. ``dtype``: the floating-point parameters' dtype, or
    {name: dtype} for every tensor (a saved model loaded in the dtypes it was saved in).
    Returns ``model``."""
    targets = {}
    for name, tensor in state_tensors(model).items():
        if not tensor.is_meta:
            continue
        if isinstance(dtype, dict):
            value_dtype = dtype[name]
        else:
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
        self.shapes = {name: tuple(tensor.shape) for name, tensor in state_tensors(reference).items()}

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
        self._reader = None

    @property
    def reader(self) -> SafetensorsReader:
        if self._reader is None:
            self._reader = SafetensorsReader(self.path)  # the header only; CheckpointError if unreadable
        return self._reader

    @cached_property
    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{file key: (shape, stored dtype)}, without reading any tensor."""
        return {name: (shape, dtype) for name, (dtype, shape, _) in self.reader.entries.items()}

    def fill(self, targets: dict[str, GlobalTensor]) -> None:
        entries = self.reader.entries
        _check_names(targets, set(entries), self.rename, self.path)
        for name, target in targets.items():
            _check_shape(name, entries[self.rename(name)][1], target.shape, self.path)
            for offsets, view in target.chunks:
                self.reader.read(self.rename(name), box_slices(offsets, view.shape), out=view)  # straight into place on CPU


class CheckpointShards:
    """A distributed checkpoint's ``model/NAME`` tensors (or ``master/NAME``, its fp32 masters,
    when it has them), read chunk by chunk by this process alone. The index is read once and each
    shard file is checked against the completion marker once, however many calls read from it."""

    def __init__(self, directory: str | Path, prefer_masters: bool = True):
        self.directory = Path(directory)
        self.prefer_masters = prefer_masters
        self._metadata, self._verified = None, set()

    def _stored(self) -> dict:
        if self._metadata is None:
            check_folder(self.directory)
            self._marker = read_json(self.directory / COMPLETE_FILE)
            self._metadata = read_metadata(self.directory, self._marker)
            self._reader = _IndexedReader(self.directory, self._metadata)
        return {key: value for key, value in self._metadata.state_dict_metadata.items()
                if isinstance(value, TensorStorageMetadata)}

    def _key(self, name: str, stored: dict) -> str:
        master = f"master/{name}"
        return master if self.prefer_masters and master in stored else f"model/{name}"

    @cached_property
    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{model name: (global shape, stored dtype)} from the index, without reading any tensor."""
        stored = self._stored()
        names = [key.removeprefix("model/") for key in stored if key.startswith("model/")]
        return {name: (tuple(stored[self._key(name, stored)].size), stored[self._key(name, stored)].properties.dtype)
                for name in names}

    def fill(self, targets: dict[str, GlobalTensor]) -> None:
        stored = self._stored()
        _check_names(targets, set(stored), lambda name: self._key(name, stored), self.directory / METADATA_FILE)
        requests = {}
        for name, target in targets.items():
            key = self._key(name, stored)
            _check_shape(name, tuple(stored[key].size), target.shape, self.directory / METADATA_FILE)
            requests[key] = _in_stored_dtype(target, stored[key].properties.dtype)
        planner = ChunkLoadPlanner({key: request for key, (request, _) in requests.items()})
        files = set(read_items_by_file(planner, self._metadata)) - self._verified
        verify_files(self.directory, files, self._marker)
        self._verified |= files
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process": it is
            try:
                dcp.load({}, storage_reader=self._reader, planner=planner, no_dist=True)
            except Exception as error:
                raise CheckpointError(f"reading {self.directory} failed: {error}") from error
        for request, copies in requests.values():
            for staged, view in copies:
                view.copy_(staged)


class _IndexedReader(FileSystemReader):
    """DCP's file reader with the index already read: a command that reads a checkpoint one
    tensor at a time loads once per tensor, and DCP would otherwise unpickle ``.metadata`` each time."""

    def __init__(self, directory: Path, metadata):
        super().__init__(directory)
        self.known_metadata = metadata

    def read_metadata(self, *args, **kwargs):
        return self.known_metadata


class WholeTensors:
    """A source of whole tensors computed by ``read(name)`` ({name: (shape, dtype)} in ``layout``):
    a model seen through a transformation, such as its LoRA adapters folded into its weights
    (``meshlm/models/lora.py``'s ``merged_weights``). Each tensor is read whole and its boxes copied;
    ``where`` names the files they come from in errors."""

    def __init__(self, layout: dict[str, tuple], read, where: Path):
        self.layout, self.read, self.where = layout, read, where

    def fill(self, targets: dict[str, GlobalTensor]) -> None:
        _check_names(targets, set(self.layout), lambda name: name, self.where)
        for name, target in targets.items():
            full = self.read(name)
            _copy_boxes(full.to(target.dtype), target)
            del full


def read_tensor(source, name: str) -> torch.Tensor:
    """One whole tensor of ``source`` (SafetensorsFile, CheckpointShards), in its stored dtype, on CPU."""
    shape, dtype = source.layout[name]
    value = torch.empty(shape, dtype=dtype)
    source.fill({name: GlobalTensor(tuple(shape), dtype, [((0,) * len(shape), value)])})
    return value


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
        view.copy_(box_view(full, (offsets, view.shape)))


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


__all__ = ["CheckpointShards", "InitialValues", "SafetensorsFile", "WholeTensors", "materialize", "read_tensor"]
