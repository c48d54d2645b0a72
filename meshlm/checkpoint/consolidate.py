"""A distributed checkpoint read in one process: a single-file model, a summary.

DCP can load without a process group, reading every stored chunk of a key into one whole tensor
whatever layout wrote them (``whole_tensors.py``). On top of that:

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
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.files import (COMPLETE_FILE, CONFIG_FILE, STATE_FILE, TRAINING_FILE, WEIGHTS_FILE,
                                     read_json)
from meshlm.checkpoint.folders import check_folder, is_distributed_checkpoint, latest_checkpoint, read_metadata
from meshlm.checkpoint.model_files import read_model_config, save_model
from meshlm.checkpoint.whole_tensors import consolidated_model_state
from meshlm.errors import CheckpointError


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


__all__ = ["consolidate", "format_inspection", "inspect_checkpoint", "resolve_checkpoint"]
