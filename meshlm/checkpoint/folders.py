"""A run's checkpoint folders: which are complete, the newest one, pruning, and checking one intact.

    RUN_DIR/checkpoints/step_N/          one checkpoint (see meshlm/checkpoint/distributed.py)
    RUN_DIR/checkpoints/step_N.tmp-XXXX  a save in progress, or one a crash interrupted

*Which checkpoint is current.* A save writes into ``step_N.tmp-XXXX/``; when every rank has
finished, global rank 0 writes ``complete.json`` (the completion marker, with the size and
CRC-32 of every file) last and renames the folder to ``step_N``. A rename within one file
system is atomic, so a ``step_N`` folder is always complete; ``latest_checkpoint`` returns the
newest one and an interrupted save is ignored (and removed by the next successful save, after
which only the newest K checkpoints are kept). A ``step_N`` without its marker can only come
from outside (a partial copy): loading it is refused, naming the folder (``check_folder``).
Before any tensor is read, ``verify_files`` checks each file a reader needs against the sizes
and CRC-32s the marker recorded.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from meshlm.checkpoint.files import (CHECKPOINTS_DIR, COMPLETE_FILE, METADATA_FILE, MOVE_AWAY_HINT, STATE_FILE,
                                     WEIGHTS_FILE, file_checksum)
from meshlm.checkpoint.locate import STEP_FOLDER as STEP_DIR
from meshlm.errors import CheckpointError


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


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of the run's complete checkpoints, oldest first (``checkpoint_dirs``, ``is_complete``)."""
    return [(step, path) for step, path in checkpoint_dirs(run_dir) if is_complete(path)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest ``step_N`` folder of a run, or None when it has none."""
    found = checkpoint_dirs(run_dir)
    return found[-1][1] if found else None


def prune_checkpoints(run_dir: str | os.PathLike, keep: int, protected: frozenset[int] = frozenset()) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (0: none) and those of the ``protected`` steps
    (train.keep_best's), and leftovers of interrupted saves. Call only when no save is in progress
    in this run directory."""
    removed = [path for step, path in checkpoint_dirs(run_dir)[:-keep] if step not in protected] if keep > 0 else []
    root = Path(run_dir) / CHECKPOINTS_DIR
    removed += [path for path in root.iterdir()
                if path.is_dir() and re.fullmatch(r"step_\d+\.(tmp|old)-.+", path.name)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def check_folder(directory: Path) -> None:
    """The folder exists and is a complete distributed checkpoint (or an older single-process one)."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory.")
    if is_single_process_format(directory):
        return
    if not (directory / COMPLETE_FILE).is_file():
        raise CheckpointError(f"{directory} is incomplete: no {COMPLETE_FILE} (its save was interrupted, or it is "
                              f"not a meshlm checkpoint); {MOVE_AWAY_HINT.format(directory=directory)}")


def is_distributed_checkpoint(directory: Path) -> bool:
    """A folder of DCP shards (with its ``.metadata`` index), as training saves them."""
    return (Path(directory) / METADATA_FILE).is_file()


def is_single_process_format(directory: Path) -> bool:
    return (directory / WEIGHTS_FILE).is_file() and not is_distributed_checkpoint(directory)


def verify_files(directory: Path, names, marker: dict) -> None:
    """Each named file has the size and CRC-32 that ``complete.json`` recorded when it was saved."""
    recorded = marker.get("files", {})
    for name in sorted(names):
        path = directory / name
        if name not in recorded:
            raise CheckpointError(f"{path} is not listed in {directory / COMPLETE_FILE}; the checkpoint was "
                                  "altered after it was saved.")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the checkpoint lists it); "
                                  f"{MOVE_AWAY_HINT.format(directory=directory)}")
        expected, size = recorded[name], path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, but {expected['bytes']} were written (truncated or "
                                  f"overwritten); {MOVE_AWAY_HINT.format(directory=directory)}")
        if file_checksum(path)["crc32"] != expected["crc32"]:
            raise CheckpointError(f"{path}: corrupted (its CRC-32 differs from the one recorded when it was "
                                  f"written); {MOVE_AWAY_HINT.format(directory=directory)}")


def read_metadata(directory: Path, marker: dict):
    """DCP's ``.metadata``, after checking it against the completion marker."""
    verify_files(directory, [METADATA_FILE], marker)
    try:
        return FileSystemReader(directory).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as error:
        raise CheckpointError(f"{directory / METADATA_FILE}: unreadable ({error}).") from error


__all__ = ["STEP_DIR", "check_folder", "checkpoint_dirs", "complete_checkpoints", "is_complete",
           "is_distributed_checkpoint", "is_single_process_format", "latest_checkpoint", "prune_checkpoints",
           "read_metadata", "verify_files"]
