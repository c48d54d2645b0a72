"""Where a run stands (``TrainerState``), its RNG states, and the older single-process checkpoint.

*Exact resume.* The data pipeline serves sample i of a fixed global order, so "samples consumed"
(``TrainerState``) says exactly where the next batch starts whatever the data-parallel size;
weights, optimizer moments, loss scaler and RNG states are restored bit for bit
(``capture_rng_state`` / ``restore_rng_state``).

*Older checkpoints.* Before distributed checkpoints, a step folder held the single-process
format (``model.safetensors``, ``optimizer.pt``, ``precision.pt``, ``rng.pt``);
``read_checkpoint`` still reads it, and ``meshlm.checkpoint.loading.load_checkpoint`` slices it
into any layout. The folders of a run (naming, the newest complete one, pruning) are
``folders.py``; how a distributed checkpoint is written, ``distributed.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import random
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from meshlm.checkpoint.files import (CONFIG_FILE, MOVE_AWAY_HINT, OPTIMIZER_FILE, PRECISION_FILE, RNG_FILE,
                                     RUN_CONFIG_FILE, STATE_FILE, WEIGHTS_FILE)
from meshlm.errors import CheckpointError
from meshlm.models.config import TRAINING_ONLY_FIELDS

REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, PRECISION_FILE, RNG_FILE, RUN_CONFIG_FILE, STATE_FILE)


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
    best_val_step: int | None = None
    """The step of that lowest validation loss (train.keep_best keeps its checkpoint)."""
    evaluations_since_best: int = 0
    """Evaluations since the best one that did not improve on it (train.early_stop_evals counts them)."""

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


__all__ = ["REQUIRED_FILES", "TrainerState", "TrainingCheckpoint", "capture_rng_state", "check_model_config",
           "read_checkpoint", "restore_rng_state"]
