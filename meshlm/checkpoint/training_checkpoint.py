"""Training checkpoints: everything needed to continue a run exactly where it stopped.

    RUN_DIR/checkpoints/step_N/
        config.json, model.safetensors   the model, in the same form as ``model_files.save_model``
                                         (so ``meshlm generate`` / ``meshlm convert`` take it)
        tokenizer.json (+ its configs)   when the run's data names a tokenizer
        optimizer.pt                     the optimizer's state (AdamW moments, step counts)
        precision.pt                     the loss scaler and, for fp16, the fp32 master weights
        rng.pt                           torch CPU (and CUDA) / numpy / python RNG states
        run.yaml                         the run's full config
        trainer_state.json               step, samples consumed, LR, skipped steps, losses

*Exact resume.* The data pipeline serves sample i of a fixed global order, so "samples consumed"
says exactly where the next batch starts; the weights, optimizer moments, loss scaler and RNG
states are restored bit for bit; on CPU in fp32 a resumed run therefore computes the same
losses, to the last bit, as one that never stopped.

*Crash safety.* A checkpoint is written into ``step_N.tmp-XXXX/`` and renamed to ``step_N/``
only when every file is on disk; a rename within one file system is atomic, so the newest
``step_N`` folder is always complete, and a ``.tmp-`` folder left by a crash is ignored (and
removed by the next successful save). Only then are checkpoints beyond the last K deleted.

*Clear failures.* Reading a checkpoint checks every file before anything is used: a missing or
truncated file, or a model config that differs from the run's, raises ``CheckpointError``
naming the file and the difference. Nothing on disk is changed by a failed resume.

*Parallel runs.* Checkpoints keep the single-process format at every layout. Saving is a
collective: the TP groups all-gather their parameter shards (and the AdamW moments and fp32
masters of those shards, the same way), the distributed optimizer all-gathers its DP shards of
the moments, and global rank 0 alone writes the folder while the others wait at a barrier.
Loading is the inverse: every rank reads the full files and keeps its own slices. So a
checkpoint saved at tp2 x dp2 resumes at tp1 x dp1, at tp4, or loads into ``meshlm generate``.
The RNG states saved are rank 0's; every rank seeds its streams identically.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import secrets
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from meshlm.checkpoint.model_files import (CONFIG_FILE, WEIGHTS_FILE, CheckpointError, load_state_checked,
                                           save_model, write_json_atomic)

CHECKPOINTS_DIR = "checkpoints"
OPTIMIZER_FILE = "optimizer.pt"
PRECISION_FILE = "precision.pt"
RNG_FILE = "rng.pt"
RUN_CONFIG_FILE = "run.yaml"
STATE_FILE = "trainer_state.json"
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
    """The ``step_N`` folders of a run, oldest first (``.tmp-`` folders of interrupted saves excluded)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in root.iterdir()
             if path.is_dir() and (match := STEP_DIR.fullmatch(path.name))]
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest ``step_N`` folder of a run, or None when it has none."""
    found = checkpoint_dirs(run_dir)
    return found[-1][1] if found else None


# --- saving --------------------------------------------------------------------------------------------------
def save_checkpoint(run_dir: str | os.PathLike, state: TrainerState, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, precision, run_config, keep: int,
                    tokenizer_file: Path | None = None, context=None) -> Path:
    """Write ``checkpoints/step_{state.step}`` atomically, then keep only the newest ``keep``.

    With a distributed ``context`` every rank must call it (the full states are gathered
    collectively); only global rank 0 writes, and every rank returns after the files are on disk.
    """
    from meshlm.config import save_run_config

    final = Path(run_dir) / CHECKPOINTS_DIR / f"step_{state.step}"
    distributed = context is not None and context.distributed
    if distributed:
        model_state, optimizer_state, precision_state = gather_training_state(model, optimizer, precision, context)
    else:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
        precision_state = precision.state_dict()
    if not distributed or context.is_logging_rank:
        try:
            root = final.parent
            root.mkdir(parents=True, exist_ok=True)
            temporary = root / f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            temporary.mkdir()  # unlike tempfile.mkdtemp, keeps the umask's permissions for the final folder
            try:
                save_model(_FullModel(model.config, model_state), temporary,
                           extra_config={"run": run_config.to_dict()})
                if tokenizer_file is not None:
                    copy_tokenizer(Path(tokenizer_file), temporary)
                torch.save(optimizer_state, temporary / OPTIMIZER_FILE)
                torch.save(precision_state, temporary / PRECISION_FILE)
                torch.save(capture_rng_state(), temporary / RNG_FILE)
                save_run_config(run_config, temporary / RUN_CONFIG_FILE)
                write_json_atomic(temporary / STATE_FILE, asdict(state))  # last: marks the folder complete
                _replace_directory(temporary, final)
            except BaseException:
                shutil.rmtree(temporary, ignore_errors=True)
                raise
            prune_checkpoints(run_dir, keep)
        finally:
            if distributed:
                torch.distributed.barrier()  # the others wait until the folder is complete (or failed)
    elif distributed:
        torch.distributed.barrier()
    return final


class _FullModel:
    """What ``save_model`` reads from a model (its config and state dict), for a gathered state."""

    def __init__(self, config, state: dict[str, torch.Tensor]):
        self.config, self.state = config, state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


# --- parallel runs: full states gathered for saving, sliced after loading ---------------------------
def _map_optimizer_moments(optimizer_state: dict, transform) -> dict:
    """A copy of an AdamW state dict whose ``exp_avg``/``exp_avg_sq`` went through ``transform(name, t)``."""
    state = {key: dict(entry) for key, entry in optimizer_state["state"].items()}
    for group in optimizer_state["param_groups"]:
        for name, packed in zip(group["param_names"], group["params"]):
            entry = state.get(packed)
            for key in ("exp_avg", "exp_avg_sq"):
                if entry and key in entry:
                    entry[key] = transform(name, entry[key])
    return {"state": state, "param_groups": optimizer_state["param_groups"]}


def _map_masters(precision_state: dict, transform) -> dict:
    masters = precision_state.get("master_weights")
    if masters is None:
        return precision_state
    return dict(precision_state, master_weights={name: transform(name, value) for name, value in masters.items()})


def gather_training_state(model, optimizer, precision, context) -> tuple[dict, dict, dict]:
    """(model, optimizer, precision) states in the single-process format. Collective: every rank
    calls it. TP shards (values, Adam moments, fp32 masters) are all-gathered over TP by the
    parameter's name; the distributed optimizer's ``state_dict`` gathers its DP shards."""
    from meshlm.parallel.tensor_parallel import gather_full_state_dict, gather_full_tensor

    params = dict(model.named_parameters())

    def full(name, tensor):
        return gather_full_tensor(params[name], tensor, context)

    model_state = gather_full_state_dict(model, context)
    optimizer_state = _map_optimizer_moments(optimizer.state_dict(), full)
    return model_state, optimizer_state, _map_masters(precision.state_dict(), full)


def slice_training_state(checkpoint: TrainingCheckpoint, model, context) -> None:
    """Turn a checkpoint's full optimizer and precision states into this rank's TP slices, in place
    (the model's weights are sliced by ``parallelize_model`` after loading them in full)."""
    from meshlm.parallel.tensor_parallel import local_shard_of

    if context is None or context.tp_size == 1:
        return
    params = dict(model.named_parameters())

    def local(name, tensor):
        if name not in params:
            raise CheckpointError(f"{checkpoint.directory / OPTIMIZER_FILE} holds state for {name}, which this "
                                  "model does not have; it was saved for a different model.")
        return local_shard_of(params[name], tensor, context).clone()

    checkpoint.optimizer_state = _map_optimizer_moments(checkpoint.optimizer_state, local)
    checkpoint.precision_state = _map_masters(checkpoint.precision_state, local)


def _replace_directory(source: Path, destination: Path) -> None:
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
    """Delete all but the newest ``keep`` checkpoints, and leftovers of interrupted saves."""
    removed = [path for _, path in checkpoint_dirs(run_dir)[:-keep]] if keep > 0 else []
    root = Path(run_dir) / CHECKPOINTS_DIR
    removed += [path for path in root.iterdir()
                if path.is_dir() and re.fullmatch(r"step_\d+\.(tmp|old)-.+", path.name)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


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
                   for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]
    if differences:
        raise CheckpointError(f"{config_path} was written for a different model ({'; '.join(differences)}); "
                              "resume with the run's original model settings or choose a new train.run_dir.")


def load_model_state(checkpoint: TrainingCheckpoint, model: torch.nn.Module) -> None:
    """Copy the checkpoint's weights into ``model`` (in the model's own dtypes)."""
    expected = model.state_dict()
    state = {name: tensor.to(expected[name].dtype) if name in expected else tensor
             for name, tensor in checkpoint.model_state.items()}
    load_state_checked(model, state, str(checkpoint.directory / WEIGHTS_FILE))


def load_training_state(checkpoint: TrainingCheckpoint, optimizer: torch.optim.Optimizer, precision) -> TrainerState:
    """Restore optimizer, precision (loss scaler, master weights) and RNG states; return the trainer state."""
    for name, target, state in ((PRECISION_FILE, precision, checkpoint.precision_state),
                                (OPTIMIZER_FILE, optimizer, checkpoint.optimizer_state)):
        try:
            target.load_state_dict(state)
        except (KeyError, ValueError, RuntimeError, TypeError) as error:
            raise CheckpointError(f"{checkpoint.directory / name} does not match this run's "
                                  f"{type(target).__name__} ({error}).") from error
    restore_rng_state(checkpoint.rng_state)
    return checkpoint.trainer_state


__all__ = ["CHECKPOINTS_DIR", "REQUIRED_FILES", "TrainerState", "TrainingCheckpoint", "capture_rng_state",
           "check_model_config", "checkpoint_dirs", "latest_checkpoint", "load_model_state",
           "gather_training_state", "load_training_state", "prune_checkpoints", "read_checkpoint", "restore_rng_state",
           "save_checkpoint", "slice_training_state"]
