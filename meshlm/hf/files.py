"""Reading and writing Hugging Face model folders: ``config.json`` + safetensors weights.

An HF folder holds ``config.json`` and either one ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``), plus tokenizer
files. Only safetensors are read: pickled ``pytorch_model.bin`` files can run code when loaded.
``open_hf_tensors`` reads the headers only and hands out a ``StoredTensor`` per name; a tensor's
bytes are read when the conversion needs them, one tensor (or one expert's rows) at a time
(``meshlm/checkpoint/safetensors_stream.py``), so a model larger than the host's memory converts.

Writing is the same shape: one ``model.safetensors`` (metadata ``format: pt``, which
transformers expects) written one tensor at a time, and ``config.json``, each under a temporary
name and renamed, so an interrupted conversion never leaves a half-written file under the real
name. An output
folder that exists and is not empty is refused unless the caller passes ``overwrite``; then
files of the same name are replaced, and a stale shard index (which transformers would prefer
over our single file) is removed with its shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from meshlm.checkpoint.files import copy_tokenizer_files, write_json_atomic
from meshlm.checkpoint.safetensors_stream import SafetensorsFiles, write_safetensors
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


def hf_weight_files(directory: Path) -> list[Path]:
    """The folder's single safetensors file, or every shard its index names (checked to exist)."""
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index_path}: not a safetensors index (no 'weight_map': {error}).") from error
        for shard in shards:
            if not (directory / shard).is_file():
                raise CheckpointError(f"{directory / shard}: missing; {INDEX_FILE} lists it as a shard.")
        return [directory / shard for shard in shards]
    pickled = sorted(path.name for path in directory.glob("pytorch_model*.bin"))
    hint = (f" It holds {', '.join(pickled)}: re-save the model with safetensors "
            "(model.save_pretrained(path) does by default)." if pickled else "")
    raise CheckpointError(f"{directory}: no {WEIGHTS_FILE} and no {INDEX_FILE}.{hint}")


def open_hf_tensors(directory: Path) -> SafetensorsFiles:
    """The folder's tensors as ``StoredTensor`` handles (``.tensors``: {name: handle}); nothing is
    read until a handle's ``load()``. Use as a context manager."""
    return SafetensorsFiles(hf_weight_files(directory))


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


def write_hf_folder(directory: Path, hf_config: dict, tensors: Mapping, tokenizer_dir: Path | None = None,
                    overwrite: bool = False) -> Path:
    """Write an HF model folder that ``AutoModelForCausalLM.from_pretrained`` loads; ``tensors``:
    {name: tensor or PlannedTensor}, written one at a time."""
    check_output_dir(directory, overwrite)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_shards(directory)
    write_safetensors(directory / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    write_json_atomic(directory / CONFIG_FILE, encode_special_floats(hf_config))
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), directory)
    return directory
