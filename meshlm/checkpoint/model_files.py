"""A model on disk: ``config.json`` + ``model.safetensors`` (+ tokenizer files), one directory.

This is the single-file, layout-free form of a meshlm model. ``meshlm convert hf-to-meshlm``,
``meshlm upcycle`` and ``meshlm checkpoint consolidate`` write it, ``meshlm generate`` and
``meshlm convert meshlm-to-hf`` read it. Training checkpoints hold the same ``config.json``
beside their distributed shards, and every reader here takes them too (``weights_source``).

Nothing here holds a model twice. ``write_model_folder`` writes the weights one tensor at a
time from a plan ({name: PlannedTensor or tensor}, ``meshlm/checkpoint/safetensors_stream.py``),
so a conversion holds one output tensor at a time; ``load_model`` builds the model on ``meta``
and fills it tensor by tensor from the file or the shards (``meshlm/checkpoint/materialize.py``),
so loading peaks at the model plus one tensor, not twice the model.

``config.json`` is ``{"format": "meshlm", "version": 1, "model": {...ModelConfig fields...}}``;
other top-level keys (a training run's full config) are allowed and ignored here. Files are
written to a temporary name and renamed, so an interrupted save never leaves a half-written
model behind.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Mapping

import torch

from meshlm.checkpoint.files import (CONFIG_FILE, FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, WEIGHTS_FILE,
                                     copy_tokenizer_files, write_json_atomic)
from meshlm.checkpoint.folders import is_distributed_checkpoint
from meshlm.checkpoint.materialize import CheckpointShards, SafetensorsFile, WholeTensors, materialize, read_tensor
from meshlm.checkpoint.safetensors_stream import write_safetensors
from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.lora import merged_weights

MAX_LISTED = 8


def write_model_folder(directory: str | os.PathLike, config: ModelConfig, tensors: Mapping,
                       extra_config: dict | None = None, tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write a model folder: ``tensors`` ({name: PlannedTensor or tensor}) one at a time into
    ``model.safetensors``, then ``config.json`` (with ``extra_config``'s keys) and the tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / WEIGHTS_FILE, tensors, metadata={"format": FORMAT_NAME})
    payload = dict(extra_config or {})
    payload.update({"format": FORMAT_NAME, "version": FORMAT_VERSION, "model": config.to_dict()})
    write_json_atomic(directory / CONFIG_FILE, payload)
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), directory)
    return directory


def save_model(model: LanguageModel, directory: str | os.PathLike, extra_config: dict | None = None,
               tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write ``model`` into ``directory`` (created if needed) and return its path."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("output.weight", None)
    return write_model_folder(directory, model.config, state, extra_config, tokenizer_dir)


DEFAULT_SEQ_LEN = 1024
"""``trained_seq_len``'s answer for a model folder that records no sequence length."""


def trained_seq_len(directory: str | os.PathLike) -> int:
    """The sequence length a model folder's model was trained with: the run's ``train.seq_len``
    recorded in its config.json, else a converted Hugging Face model's ``max_position_embeddings``,
    else ``DEFAULT_SEQ_LEN`` (the default window of ``meshlm eval`` and of ``meshlm prune``'s calibration)."""
    try:
        payload = json.loads((Path(directory) / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return DEFAULT_SEQ_LEN
    seq_len = (payload.get("run") or {}).get("train", {}).get("seq_len")
    seq_len = seq_len or (payload.get("hf") or {}).get("max_position_embeddings")
    return int(seq_len) if seq_len else DEFAULT_SEQ_LEN


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


def weights_source(directory: str | os.PathLike, prefer_masters: bool = False):
    """Where a model folder's weights are: its ``model.safetensors`` (read by slice) or, for a
    training checkpoint, its distributed shards (read by chunk; with ``prefer_masters`` the fp32
    master weights where the run kept them). Nothing is read yet."""
    directory = Path(directory)
    if is_distributed_checkpoint(directory):
        return CheckpointShards(directory, prefer_masters=prefer_masters)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing; a model folder holds {CONFIG_FILE} and {WEIGHTS_FILE}.")
    return SafetensorsFile(weights)


def source_file(directory: Path) -> Path:
    """The file a model folder's tensor names come from (for error messages)."""
    return directory / (METADATA_FILE if is_distributed_checkpoint(directory) else WEIGHTS_FILE)


def expected_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """Name -> shape of every tensor a model with ``config`` saves (built on 'meta', free), in order."""
    with torch.device("meta"):
        model = LanguageModel(config)
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    if config.tie_embeddings:
        shapes.pop("output.weight", None)
    return shapes


def check_stored_tensors(config: ModelConfig, stored: dict[str, tuple], source: str) -> list[str]:
    """The names of the model ``config`` describes, in order, after checking that ``stored``
    ({name: (shape, ...)}) holds each with its shape and nothing else (a tied model's
    ``output.weight`` copy is tolerated); else CheckpointError naming every difference."""
    expected = expected_shapes(config)
    extra = set(stored) - set(expected) - ({"output.weight"} if config.tie_embeddings else set())
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(extra)
    wrong_shape = [f"{name}: file {tuple(stored[name][0])} vs model {tuple(expected[name])}"
                   for name in expected if name in stored and tuple(stored[name][0]) != tuple(expected[name])]
    if missing or unexpected or wrong_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)}: {_listed(unexpected)}")
        if wrong_shape:
            parts.append("shape mismatch: " + "; ".join(wrong_shape[:MAX_LISTED]))
        raise CheckpointError(f"{source} does not match the model in its config: " + " | ".join(parts)
                              + "; the weights and config.json come from different models (restore the folder's "
                              "own config.json).")
    return list(expected)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:MAX_LISTED]) + (" ..." if len(names) > MAX_LISTED else "")


def load_model(directory: str | os.PathLike, map_location: str | torch.device = "cpu",
               merge_lora: bool = False) -> LanguageModel:
    """Build the model described by ``directory/config.json`` on ``meta``, then give it the
    folder's weights one tensor at a time, each in the dtype it was saved in. ``merge_lora``: a
    LoRA model comes with its adapters folded into its weights (``meshlm/models/lora.py``): the
    same function without the adapters' extra GEMMs, what generation wants."""
    directory = Path(directory)
    config = read_model_config(directory)
    source = weights_source(directory)
    check_stored_tensors(config, source.layout, str(source_file(directory)))
    if merge_lora and config.lora_rank:
        config, stored, read = merged_weights(config, source.layout, partial(read_tensor, source))
        source = WholeTensors(stored, read, source_file(directory))
    with torch.device("meta"):
        model = LanguageModel(config)
    dtypes = {name: dtype for name, (_, dtype) in source.layout.items()}
    return materialize(model, None, source, map_location, dtype=dtypes)


def load_state_checked(model: LanguageModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` (a whole state dict in memory) into ``model``, naming every missing,
    unexpected or mis-shaped tensor."""
    check_stored_tensors(model.config, {name: (tensor.shape,) for name, tensor in state.items()}, source)
    model.load_state_dict(state, strict=False, assign=True)


__all__ = ["DEFAULT_SEQ_LEN", "check_stored_tensors", "expected_shapes", "load_model", "load_state_checked",
           "read_model_config", "save_model", "source_file", "trained_seq_len", "weights_source", "write_model_folder"]
