"""A distributed checkpoint read in one process: a single-file model, a summary.

DCP can load without a process group, reading the stored chunks of one global tensor into it
whatever layout wrote them (``CheckpointShards``, ``meshlm/checkpoint/materialize.py``). On top:

* ``consolidate`` writes ``config.json`` + ``model.safetensors`` (+ tokenizer files): the
  single-file model that ``meshlm generate``, ``meshlm convert meshlm-to-hf`` and
  ``load_model`` take -- in the model's dtype, or with ``fp32_masters`` the fp32 master weights
  of a bf16/fp16 run. One tensor at a time: read one global tensor through the DCP planner,
  write it, let it go, so consolidating never holds more than the largest tensor (and the
  stored chunk being copied into it);
* ``load_model`` (``meshlm/checkpoint/model_files.py``) reads a distributed checkpoint's
  shards directly, so those commands also take training checkpoints without consolidating;
* ``inspect_checkpoint`` summarizes step, layout, config and every tensor's shape and dtype
  from the index, after checking every file as loading checks it (unless told not to).

Files are checked against the completion marker's sizes and CRC-32 before they are read.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshlm.checkpoint.files import COMPLETE_FILE, CONFIG_FILE, STATE_FILE, TRAINING_FILE, WEIGHTS_FILE, read_json
from meshlm.checkpoint.folders import check_folder, is_distributed_checkpoint, read_metadata, verify_files
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.materialize import SafetensorsFile, read_tensor
from meshlm.checkpoint.model_files import (check_stored_tensors, read_model_config, source_file, weights_source,
                                           write_model_folder)
from meshlm.checkpoint.safetensors_stream import DTYPE_NAMES, PlannedTensor
from meshlm.errors import CheckpointError


def consolidate(checkpoint, out, overwrite: bool = False, fp32_masters: bool = False) -> Path:
    """Write the model of a checkpoint (any layout, or a run directory's newest) as ``out``,
    one tensor at a time."""
    source_dir, out = resolve_model_dir(checkpoint), Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} exists and is not empty; choose a new folder or pass --overwrite "
                              "(files of the same names are replaced, others kept).")
    if out.resolve() == source_dir.resolve():
        raise CheckpointError(f"{out} is the checkpoint itself; choose another output folder.")
    config = read_model_config(source_dir)
    source = weights_source(source_dir, prefer_masters=fp32_masters)
    names = check_stored_tensors(config, source.layout, str(source_file(source_dir)))
    plan = {name: PlannedTensor(*source.layout[name], lambda name=name: read_tensor(source, name))
            for name in names}
    extra = {key: value for key, value in read_json(source_dir / CONFIG_FILE).items()
             if key not in ("format", "version", "model")}
    return write_model_folder(out, config, plan, extra_config=extra, tokenizer_dir=source_dir)


OPTIMIZER_PREFIX = "optim/"
"""Keys of the optimizer's tensors (AdamW's moments, Muon's momentum) in a distributed checkpoint."""


def inspect_checkpoint(checkpoint, verify: bool = True, all_tensors: bool = False) -> dict:
    """Step, layout, model config and every model tensor's shape and dtype (no tensor is read).

    With ``verify``, every file is first checked as loading checks it: against the sizes and
    CRC-32s of the completion marker (a distributed checkpoint; this reads each file once), or
    against its own header (a ``model.safetensors``); a truncated or corrupted file raises
    CheckpointError naming it. The optimizer's tensors are counted, and listed with ``all_tensors``."""
    directory = resolve_model_dir(checkpoint)
    info = {"checkpoint": str(directory), "model": read_json(directory / CONFIG_FILE).get("model")}
    if (directory / STATE_FILE).is_file():
        info["trainer_state"] = read_json(directory / STATE_FILE)
    if not is_distributed_checkpoint(directory):
        stored = SafetensorsFile(directory / WEIGHTS_FILE).layout  # its header against its size, always
        info["tensors"] = {f"model/{name}": {"shape": list(shape), "dtype": DTYPE_NAMES[dtype]}
                           for name, (shape, dtype) in sorted(stored.items())}
        info["format"] = "single-process"
        return info
    check_folder(directory)
    marker = read_json(directory / COMPLETE_FILE)
    metadata = read_metadata(directory, marker)
    if verify:
        verify_files(directory, marker.get("files", {}), marker)
    training = read_json(directory / TRAINING_FILE)
    info.update(format="distributed", layout=training.get("layout"), optimizers=training.get("optimizers"),
                loss_scaler=training.get("loss_scaler"), files=marker.get("files"), verified=verify)
    tensors = {key: {"shape": list(value.size), "dtype": str(value.properties.dtype).removeprefix("torch."),
                     "chunks": len(value.chunks)}
               for key, value in sorted(metadata.state_dict_metadata.items())
               if isinstance(value, TensorStorageMetadata)}
    optimizer = [key for key in tensors if key.startswith(OPTIMIZER_PREFIX)]
    info["optimizer_tensors"] = len(optimizer)
    info["tensors"] = tensors if all_tensors else {key: entry for key, entry in tensors.items()
                                                   if not key.startswith(OPTIMIZER_PREFIX)}
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
        check = ("sizes and CRC-32s verified" if info.get("verified")
                 else "not verified (--no-verify)")
        lines.append(f"{len(info['files'])} files, {total / 2**20:.2f} MiB, {check}")
    lines.append("model: " + json.dumps(info.get("model"), sort_keys=True))
    width = max((len(key) for key in info["tensors"]), default=0)
    for key, entry in info["tensors"].items():
        chunks = f"  ({entry['chunks']} chunks)" if "chunks" in entry else ""
        lines.append(f"  {key:<{width}}  {entry['dtype']:<8} {tuple(entry['shape'])}{chunks}")
    listed = any(key.startswith(OPTIMIZER_PREFIX) for key in info["tensors"])
    if info.get("optimizer_tensors") and not listed:
        lines.append(f"  ... and {info['optimizer_tensors']} optimizer tensors (optim/*; --all lists them)")
    return "\n".join(lines)


__all__ = ["OPTIMIZER_PREFIX", "consolidate", "format_inspection", "inspect_checkpoint"]
