"""Reading and writing Hugging Face model folders: ``config.json`` + safetensors weights.

An HF folder holds ``config.json`` and either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``), plus tokenizer
files. Only safetensors are read: pickled ``pytorch_model.bin`` files can run code when loaded.

Writing is the same shape: one ``model.safetensors`` (metadata ``format: pt``, which
transformers expects) and ``config.json``, each written under a temporary name and renamed, so
an interrupted conversion never leaves a half-written file under the real name. An output
folder that exists and is not empty is refused unless the caller passes ``overwrite``; then
files of the same name are replaced, and a stale shard index (which transformers would prefer
over our single file) is removed with its shards.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from meshlm.checkpoint.files import copy_tokenizer_files, write_json_atomic
from meshlm.errors import CheckpointError
from meshlm.hf.common import encode_special_floats

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(directory: Path) -> dict:
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such Hugging Face model folder.")
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing; a Hugging Face model folder holds config.json and "
                              f"{WEIGHTS_FILE} (or {INDEX_FILE} with its shards).")
    try:
        payload = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path}: not valid JSON ({error}).") from error
    if payload.get("format") == "meshlm":
        raise CheckpointError(f"{config_path}: this is already a meshlm model; convert it the other way with "
                              "`meshlm convert meshlm-to-hf`.")
    return payload


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({error}).") from error


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of the folder's single file or of every shard its index names."""
    if (directory / WEIGHTS_FILE).is_file():
        return _load_safetensors(directory / WEIGHTS_FILE)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path}: not a safetensors index (no 'weight_map': {error}).") from error
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).is_file():
                raise CheckpointError(f"{directory / shard}: missing; {INDEX_FILE} lists it as a shard.")
            tensors.update(_load_safetensors(directory / shard))
        return tensors
    pickled = sorted(path.name for path in directory.glob("pytorch_model*.bin"))
    hint = (f" It holds {', '.join(pickled)}: re-save the model with safetensors "
            "(model.save_pretrained(path) does by default)." if pickled else "")
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} and no {INDEX_FILE}.{hint}")


def check_output_dir(directory: Path, overwrite: bool) -> None:
    """Refuse a non-folder, or a non-empty folder unless ``overwrite`` (nothing is created yet)."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: exists and is not a folder; choose another output path.")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise CheckpointError(f"{directory}: output folder exists and is not empty; choose another folder or pass "
                              "--overwrite to replace the files of the same names.")


def remove_stale_shards(directory: Path) -> None:
    """Drop an old shard index and its shards, which transformers would otherwise load instead."""
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        return
    try:
        shards = set(json.loads(index_path.read_text()).get("weight_map", {}).values())
    except (json.JSONDecodeError, AttributeError):
        shards = set()
    for shard in shards:
        if (directory / shard).is_file() and "/" not in shard:
            (directory / shard).unlink()
    index_path.unlink()


def write_hf_folder(directory: Path, hf_config: dict, tensors: dict[str, torch.Tensor],
                    tokenizer_dir: Path | None = None, overwrite: bool = False) -> Path:
    """Write an HF model folder that ``AutoModelForCausalLM.from_pretrained`` loads."""
    check_output_dir(directory, overwrite)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_shards(directory)
    temporary = directory / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(temporary), metadata={"format": "pt"})
    os.replace(temporary, directory / WEIGHTS_FILE)
    write_json_atomic(directory / CONFIG_FILE, encode_special_floats(hf_config))
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), directory)
    return directory
