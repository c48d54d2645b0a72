"""A distributed checkpoint read in one process: whole tensors, a single-file model, a summary.

DCP can load without a process group: given one chunk per key that covers the whole global
tensor, its planner reads every stored chunk into it (``read_global_tensors``), whatever
layout wrote them. On top of that:

* ``consolidate`` writes ``config.json`` + ``model.safetensors`` (+ tokenizer files): the
  single-file model that ``meshlm generate``, ``meshlm convert meshlm-to-hf`` and
  ``load_model`` take -- in the model's dtype, or with ``fp32_masters`` the fp32 master weights
  of a bf16/fp16 run;
* ``load_model`` (``meshlm/checkpoint/model_files.py``) reads a distributed checkpoint's
  weights through ``consolidated_model_state`` directly, so those commands also take
  training checkpoints without a consolidation step;
* ``inspect_checkpoint`` summarizes step, layout, config and every tensor's shape and dtype
  without reading any tensor.

Files are checked against the completion marker's sizes and CRC-32 before they are read.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.distributed import METADATA_FILE, TRAINING_FILE
from meshlm.checkpoint.global_state import GlobalTensor
from meshlm.checkpoint.loading import check_folder, read_json, read_metadata, verify_files
from meshlm.checkpoint.model_files import (CONFIG_FILE, WEIGHTS_FILE, CheckpointError, read_model_config,
                                           save_model)
from meshlm.checkpoint.planners import ChunkLoadPlanner, read_items_by_file
from meshlm.checkpoint.training_checkpoint import COMPLETE_FILE, STATE_FILE, latest_checkpoint


def is_distributed_checkpoint(directory: Path) -> bool:
    return (Path(directory) / METADATA_FILE).is_file()


def resolve_checkpoint(path) -> Path:
    """A checkpoint folder itself, or a run directory's newest complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or run directory.")
    if (path / CONFIG_FILE).is_file() or (path / COMPLETE_FILE).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: neither a checkpoint (no {CONFIG_FILE}) nor a run directory with complete "
                              "checkpoints/step_N folders.")
    return latest


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


def consolidated_model_state(directory, fp32_masters: bool = False) -> dict[str, torch.Tensor]:
    """{parameter or buffer name: whole tensor} of the model in a distributed checkpoint."""
    metadata = read_metadata(Path(directory), read_json(Path(directory) / COMPLETE_FILE))
    names = [key.removeprefix("model/") for key in metadata.state_dict_metadata if key.startswith("model/")]
    keys = [f"master/{name}" if fp32_masters and f"master/{name}" in metadata.state_dict_metadata
            else f"model/{name}" for name in names]
    return {key.split("/", 1)[1]: tensor for key, tensor in read_global_tensors(directory, keys).items()}


class _StateModel:
    """What ``save_model`` reads from a model: its config and a state dict."""

    def __init__(self, config, state: dict[str, torch.Tensor]):
        self.config, self.state = config, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


def consolidate(checkpoint, out, overwrite: bool = False, fp32_masters: bool = False) -> Path:
    """Write the model of a checkpoint (any layout, or a run directory's newest) as ``out``."""
    source, out = resolve_checkpoint(checkpoint), Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} exists and is not empty; choose a new folder or pass --overwrite "
                              "(files of the same names are replaced, others kept).")
    if out.resolve() == source.resolve():
        raise CheckpointError(f"{out} is the checkpoint itself; choose another output folder.")
    config = read_model_config(source)
    if is_distributed_checkpoint(source):
        state = consolidated_model_state(source, fp32_masters)
    else:  # already a single-file model (an older checkpoint, or a consolidated one)
        from safetensors.torch import load_file
        state = load_file(str(source / WEIGHTS_FILE))
    extra = {key: value for key, value in read_json(source / CONFIG_FILE).items()
             if key not in ("format", "version", "model")}
    return save_model(_StateModel(config, state), out, extra_config=extra, tokenizer_dir=source)


def inspect_checkpoint(checkpoint) -> dict:
    """Step, layout, model config and every tensor's shape and dtype (no tensor is read)."""
    directory = resolve_checkpoint(checkpoint)
    info = {"checkpoint": str(directory), "model": read_json(directory / CONFIG_FILE).get("model")}
    if (directory / STATE_FILE).is_file():
        info["trainer_state"] = read_json(directory / STATE_FILE)
    if not is_distributed_checkpoint(directory):
        from safetensors import safe_open
        with safe_open(str(directory / WEIGHTS_FILE), "pt") as weights:
            info["tensors"] = {f"model/{name}": {"shape": list(weights.get_slice(name).get_shape()),
                                                 "dtype": weights.get_slice(name).get_dtype()}
                               for name in weights.keys()}
        info["format"] = "single-process"
        return info
    check_folder(directory)
    metadata = read_metadata(directory, read_json(directory / COMPLETE_FILE))
    training = read_json(directory / TRAINING_FILE)
    info.update(format="distributed", layout=training.get("layout"), optimizers=training.get("optimizers"),
                loss_scaler=training.get("loss_scaler"))
    info["tensors"] = {key: {"shape": list(value.size), "dtype": str(value.properties.dtype).removeprefix("torch."),
                             "chunks": len(value.chunks)}
                       for key, value in sorted(metadata.state_dict_metadata.items())
                       if isinstance(value, TensorStorageMetadata)}
    info["files"] = read_json(directory / COMPLETE_FILE).get("files")
    return info


def format_inspection(info: dict) -> str:
    """A human-readable summary of ``inspect_checkpoint``'s result."""
    state, layout = info.get("trainer_state") or {}, info.get("layout") or {}
    lines = [f"checkpoint {info['checkpoint']} ({info['format']})",
             f"step {state.get('step')}, samples consumed {state.get('consumed_samples')}, "
             f"last loss {state.get('last_loss')}"]
    if layout:
        lines.append("saved at " + ", ".join(f"{key} {value}" for key, value in layout.items()))
    if info.get("files"):
        total = sum(entry["bytes"] for entry in info["files"].values())
        lines.append(f"{len(info['files'])} files, {total / 2**20:.2f} MiB")
    lines.append("model: " + json.dumps(info.get("model"), sort_keys=True))
    width = max((len(key) for key in info["tensors"]), default=0)
    for key, entry in info["tensors"].items():
        chunks = f"  ({entry['chunks']} chunks)" if "chunks" in entry else ""
        lines.append(f"  {key:<{width}}  {entry['dtype']:<8} {tuple(entry['shape'])}{chunks}")
    return "\n".join(lines)


__all__ = ["consolidate", "consolidated_model_state", "format_inspection", "inspect_checkpoint",
           "is_distributed_checkpoint", "read_global_tensors", "resolve_checkpoint"]
