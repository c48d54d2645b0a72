"""A run's checkpoint folders: naming, finding the newest complete one, pruning, trainer state, RNG.

    RUN_DIR/checkpoints/step_N/          one checkpoint (see meshlm/checkpoint/distributed.py)
    RUN_DIR/checkpoints/step_N.tmp-XXXX  a save in progress, or one a crash interrupted

*Which checkpoint is current.* A save writes into ``step_N.tmp-XXXX/``; when every rank has
finished, global rank 0 writes ``complete.json`` (the completion marker, with the size and
CRC-32 of every file) last and renames the folder to ``step_N``. A rename within one file
system is atomic, so a ``step_N`` folder is always complete; ``latest_checkpoint`` returns the
newest one and an interrupted save is ignored (and removed by the next successful save, after
which only the newest K checkpoints are kept). A ``step_N`` without its marker can only come
from outside (a partial copy): loading it is refused, naming the folder.

*Exact resume.* The data pipeline serves sample i of a fixed global order, so "samples consumed"
(``TrainerState``) says exactly where the next batch starts whatever the data-parallel size;
weights, optimizer moments, loss scaler and RNG states are restored bit for bit.

*Older checkpoints.* Before distributed checkpoints, a step folder held the single-process
format (``model.safetensors``, ``optimizer.pt``, ``precision.pt``, ``rng.pt``);
``read_checkpoint`` still reads it, and ``meshlm.checkpoint.distributed.load_checkpoint``
slices it into any layout.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from meshlm.checkpoint.model_files import CONFIG_FILE, WEIGHTS_FILE, CheckpointError
from meshlm.models.config import TRAINING_ONLY_FIELDS

CHECKPOINTS_DIR = "checkpoints"
OPTIMIZER_FILE = "optimizer.pt"
PRECISION_FILE = "precision.pt"
RNG_FILE = "rng.pt"
RUN_CONFIG_FILE = "run.yaml"
STATE_FILE = "trainer_state.json"
COMPLETE_FILE = "complete.json"
"""The completion marker: written last, by global rank 0, once every rank has written its shards."""
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, PRECISION_FILE, RNG_FILE, RUN_CONFIG_FILE, STATE_FILE)
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
STEP_DIR = re.compile(r"step_(\d+)")
MOVE_AWAY_HINT = "move {directory} out of the checkpoints folder to resume from the one before it."


@dataclass
class TrainerState:
    """Where a run stands; saved as trainer_state.json."""

    step: int = 0
    """Optimizer steps completed (skipped steps included): also the LR schedule's position."""
    consumed_samples: int = 0
    """Training sequences read so far; the next batch starts at this sample of the global order."""
    skipped_steps: int = 0
    """Steps whose update was skipped because of non-finite gradients (fp16 overflow)."""
    lr: float = 0.0
    """Learning rate of the last step."""
    last_loss: float | None = None
    """Training loss of the last step."""
    last_val_loss: float | None = None
    """Validation loss of the last evaluation."""
    best_val_loss: float | None = None
    """Lowest validation loss seen so far."""

    @classmethod
    def from_dict(cls, values: dict) -> "TrainerState":
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in known})


@dataclass
class TrainingCheckpoint:
    """The contents of one step_N folder, read and checked, not yet applied to anything."""

    directory: Path
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    precision_state: dict
    rng_state: dict
    trainer_state: TrainerState


# --- finding checkpoints -------------------------------------------------------------------------------
def checkpoint_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The ``step_N`` folders of a run, oldest first (saves in progress or interrupted,
    ``step_N.tmp-*``, excluded). Our saves rename a folder to ``step_N`` only after its
    completion marker is on disk, so a ``step_N`` without one was damaged by hand: loading it
    fails with a clear message rather than silently resuming from an older step."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in root.iterdir()
             if path.is_dir() and (match := STEP_DIR.fullmatch(path.name))]
    return sorted(found)


def is_complete(directory: Path) -> bool:
    """A distributed checkpoint with its completion marker, or an older single-process one
    (whose save wrote trainer_state.json last, then renamed the folder)."""
    return (directory / COMPLETE_FILE).is_file() or all((directory / name).is_file()
                                                        for name in (WEIGHTS_FILE, STATE_FILE))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest ``step_N`` folder of a run, or None when it has none."""
    found = checkpoint_dirs(run_dir)
    return found[-1][1] if found else None


def replace_directory(source: Path, destination: Path) -> None:
    """Rename ``source`` to ``destination``; an existing destination is swapped out, then removed."""
    if not destination.exists():
        os.rename(source, destination)
        return
    old = destination.with_name(f"{destination.name}.old-{os.getpid()}")
    os.rename(destination, old)
    os.rename(source, destination)
    shutil.rmtree(old)


def copy_tokenizer(tokenizer_file: Path, destination: Path) -> None:
    """Copy the run's tokenizer as ``tokenizer.json`` (plus its special-token configs, if any)."""
    if not tokenizer_file.is_file():
        raise CheckpointError(f"{tokenizer_file}: the run's tokenizer file is missing; cannot copy it into "
                              "the checkpoint (set data.tokenizer to an existing tokenizer.json).")
    shutil.copyfile(tokenizer_file, destination / "tokenizer.json")
    for name in TOKENIZER_SIDE_FILES:
        if (tokenizer_file.parent / name).is_file():
            shutil.copyfile(tokenizer_file.parent / name, destination / name)


def prune_checkpoints(run_dir: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints, and leftovers of interrupted saves.
    Call only when no save is in progress in this run directory."""
    removed = [path for _, path in checkpoint_dirs(run_dir)[:-keep]] if keep > 0 else []
    root = Path(run_dir) / CHECKPOINTS_DIR
    removed += [path for path in root.iterdir()
                if path.is_dir() and re.fullmatch(r"step_\d+\.(tmp|old)-.+", path.name)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def save_checkpoint(run_dir: str | os.PathLike, state: TrainerState, model: torch.nn.Module, optimizer, precision,
                    run_config, keep: int, tokenizer_file: Path | None = None, context=None) -> Path:
    """Write ``checkpoints/step_{state.step}`` (collective when ``context`` is distributed) and keep
    the newest ``keep``. A convenience over ``meshlm.checkpoint.distributed.Checkpointer``."""
    from meshlm.checkpoint.distributed import Checkpointer
    from meshlm.checkpoint.global_state import TrainingParts

    distributed = context is not None and context.distributed
    checkpointer = Checkpointer(run_dir, run_config, context, tokenizer_file=tokenizer_file, keep=keep,
                                group=torch.distributed.group.WORLD if distributed else None)
    return checkpointer.save(state, TrainingParts(model, optimizer, precision, context))


# --- RNG state -----------------------------------------------------------------------------------------------
def capture_rng_state() -> dict:
    """Every RNG a run draws from, as tensors and plain numbers (loadable with weights_only)."""
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
        "numpy_position": int(numpy_state[2]), "numpy_has_gauss": int(numpy_state[3]),
        "numpy_cached_gauss": float(numpy_state[4]),
        "python_version": python_state[0], "python_internal": torch.tensor(python_state[1], dtype=torch.int64),
        "python_gauss_next": python_state[2],
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch_cpu"])
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_position"],
                         state["numpy_has_gauss"], state["numpy_cached_gauss"]))
    random.setstate((state["python_version"], tuple(state["python_internal"].tolist()), state["python_gauss_next"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])


# --- reading and applying ------------------------------------------------------------------------------------
def read_checkpoint(directory: str | os.PathLike, model_config) -> TrainingCheckpoint:
    """Read and check every file of a checkpoint for a run whose model is ``model_config``."""
    directory = Path(directory)
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"{directory} is incomplete: missing {', '.join(missing)}; "
                              f"{MOVE_AWAY_HINT.format(directory=directory)}")
    check_model_config(directory / CONFIG_FILE, model_config)
    try:
        model_state = load_file(str(directory / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(f"{directory / WEIGHTS_FILE}: unreadable or truncated safetensors file "
                              f"({error}); {MOVE_AWAY_HINT.format(directory=directory)}") from error
    try:
        trainer_state = TrainerState.from_dict(json.loads((directory / STATE_FILE).read_text()))
    except (json.JSONDecodeError, TypeError) as error:
        raise CheckpointError(f"{directory / STATE_FILE}: not a valid trainer state ({error}).") from error
    return TrainingCheckpoint(directory, model_state, _torch_load(directory / OPTIMIZER_FILE),
                              _torch_load(directory / PRECISION_FILE), _torch_load(directory / RNG_FILE),
                              trainer_state)


def _torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{path}: unreadable or truncated ({str(error).splitlines()[0]}); "
                              f"{MOVE_AWAY_HINT.format(directory=path.parent)}") from error


def check_model_config(config_path: Path, model_config) -> None:
    """Raise CheckpointError when the checkpoint's model differs from the run's ``model_config``."""
    try:
        saved = json.loads(config_path.read_text())["model"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise CheckpointError(f"{config_path}: not a meshlm model config ({error}).") from error
    current = json.loads(json.dumps(model_config.to_dict()))
    differences = [f"model.{key}: checkpoint {saved.get(key)!r} vs config {current.get(key)!r}"
                   for key in sorted(set(saved) | set(current))
                   if saved.get(key) != current.get(key) and key not in TRAINING_ONLY_FIELDS]  # dropout may change
    if differences:
        raise CheckpointError(f"{config_path} was written for a different model ({'; '.join(differences)}); "
                              "resume with the run's original model settings or choose a new train.run_dir.")


__all__ = ["CHECKPOINTS_DIR", "COMPLETE_FILE", "MOVE_AWAY_HINT", "REQUIRED_FILES", "TrainerState", "TrainingCheckpoint",
           "capture_rng_state", "check_model_config", "checkpoint_dirs", "copy_tokenizer", "is_complete",
           "latest_checkpoint", "prune_checkpoints", "read_checkpoint", "replace_directory", "restore_rng_state",
           "save_checkpoint"]
