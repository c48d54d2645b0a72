"""A model on disk: ``config.json`` + ``model.safetensors`` (+ tokenizer files), one directory.

This is the single-file, layout-free form of a meshlm model. ``meshlm convert hf-to-meshlm``
and ``meshlm checkpoint consolidate`` write it, ``meshlm generate`` and ``meshlm convert
meshlm-to-hf`` read it. Training checkpoints hold the same ``config.json`` beside their
distributed shards, and ``load_model`` reads the weights from the shards
(``meshlm/checkpoint/whole_tensors.py``), so every command that takes a model takes a training
checkpoint too.

``config.json`` is ``{"format": "meshlm", "version": 1, "model": {...ModelConfig fields...}}``;
other top-level keys (a training run's full config) are allowed and ignored here. Files are
written to a temporary name and renamed, so an interrupted save never leaves a half-written
model behind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from meshlm.checkpoint.files import (CONFIG_FILE, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, WEIGHTS_FILE,
                                     copy_tokenizer_files, write_json_atomic)
from meshlm.checkpoint.folders import is_distributed_checkpoint
from meshlm.checkpoint.whole_tensors import consolidated_model_state
from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel


def save_model(model: LanguageModel, directory: str | os.PathLike, extra_config: dict | None = None,
               tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write ``model`` into ``directory`` (created if needed) and return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("output.weight", None)
    temporary = directory / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(temporary), metadata={"format": FORMAT_NAME})
    os.replace(temporary, directory / WEIGHTS_FILE)
    config = dict(extra_config or {})
    config.update({"format": FORMAT_NAME, "version": FORMAT_VERSION, "model": model.config.to_dict()})
    write_json_atomic(directory / CONFIG_FILE, config)
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), directory)
    return directory


def read_model_config(directory: str | os.PathLike) -> ModelConfig:
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such model directory (expected a folder holding "
                              f"{CONFIG_FILE} and {WEIGHTS_FILE}).")
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing; is {directory} a meshlm model or checkpoint? "
                              "(Hugging Face folders are converted with `meshlm convert hf-to-meshlm`.)")
    try:
        payload = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path}: not valid JSON ({error}).") from error
    if payload.get("format") != FORMAT_NAME or "model" not in payload:
        hint = " It looks like a Hugging Face config; run `meshlm convert hf-to-meshlm` first." \
            if "architectures" in payload else ""
        raise CheckpointError(f"{config_path}: not a meshlm model config (no 'format': 'meshlm' with a "
                              f"'model' section).{hint}")
    try:
        return ModelConfig.from_dict(payload["model"])
    except (ConfigError, TypeError) as error:
        raise CheckpointError(f"{config_path}: invalid model config: {error}") from error


def read_model_state(directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The weights of a model folder: ``model.safetensors``, or a distributed training
    checkpoint's shards read whole (``meshlm/checkpoint/whole_tensors.py``)."""
    directory = Path(directory)
    if is_distributed_checkpoint(directory):
        return {name: tensor.to(map_location) for name, tensor in consolidated_model_state(directory).items()}
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise CheckpointError(f"{weights_path}: missing.")
    try:
        return load_file(str(weights_path), device=str(map_location))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{weights_path}: unreadable or truncated safetensors file ({error}).") from error


def load_model(directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> LanguageModel:
    """Build the model described by ``directory/config.json`` and load its weights."""
    directory = Path(directory)
    config = read_model_config(directory)
    state = read_model_state(directory, map_location)
    with torch.device("meta"):
        model = LanguageModel(config)
    model = model.to_empty(device=map_location)
    source = METADATA_FILE if is_distributed_checkpoint(directory) else WEIGHTS_FILE
    load_state_checked(model, state, str(directory / source))
    return model


def load_state_checked(model: LanguageModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``model``, naming every missing, unexpected or mis-shaped tensor."""
    expected = model.state_dict()
    if model.config.tie_embeddings:
        expected.pop("output.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong_shape = [f"{name}: file {tuple(state[name].shape)} vs model {tuple(expected[name].shape)}"
                   for name in sorted(set(state) & set(expected)) if state[name].shape != expected[name].shape]
    if missing or unexpected or wrong_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
        if wrong_shape:
            parts.append("shape mismatch: " + "; ".join(wrong_shape[:8]))
        raise CheckpointError(f"{source} does not match the model in its config: " + " | ".join(parts))
    model.load_state_dict(state, strict=False, assign=True)
