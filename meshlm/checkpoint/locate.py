"""Where a command finds a model: one resolver for "a model folder, a checkpoint or a run directory".

Every command that reads a model (``generate``, ``checkpoint inspect|consolidate``, ``convert
meshlm-to-hf``, ``upcycle``, ``eval``) and ``train.init_from`` take any of the three and resolve
it here, so a run directory works everywhere the README says it does. ``RUN_DIR/best`` is the
checkpoint of the run's best validation loss, when it kept one (``train.keep_best``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from meshlm.checkpoint.files import BEST_ALIAS, BEST_POINTER_FILE, CONFIG_FILE
from meshlm.errors import CheckpointError

STEP_FOLDER = re.compile(r"step_(\d+)")


def resolve_model_dir(path: str | Path) -> Path:
    """``path`` if it holds a model, else its newest ``step_N`` (or ``checkpoints/step_N``) folder.

    Step folders without a ``config.json`` (a save that was interrupted) are passed over.
    """
    path = Path(path)
    if path.name == BEST_ALIAS and not path.exists():
        return best_checkpoint(path.parent)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such model, checkpoint or run directory.")
    if (path / CONFIG_FILE).is_file():
        return path
    steps = [(int(match.group(1)), folder)
             for parent in (path, path / "checkpoints") if parent.is_dir()
             for folder in parent.iterdir()
             if folder.is_dir() and (match := STEP_FOLDER.fullmatch(folder.name))]
    complete = [(step, folder) for step, folder in steps if (folder / CONFIG_FILE).is_file()]
    if complete:
        return max(complete, key=lambda item: item[0])[1]
    if steps:
        return max(steps, key=lambda item: item[0])[1]  # load_model names what is missing
    raise CheckpointError(f"{path}: neither a model directory (no {CONFIG_FILE}) nor a run holding "
                          "step_N or checkpoints/step_N folders.")


def best_checkpoint(run_dir: Path) -> Path:
    """The checkpoint RUN_DIR/best_checkpoint.json names (``RUN_DIR/best``), checked to exist."""
    pointer = run_dir / BEST_POINTER_FILE
    try:
        folder = Path(json.loads(pointer.read_text())["checkpoint"])
    except FileNotFoundError:
        raise CheckpointError(f"{run_dir / BEST_ALIAS}: {run_dir} has no {BEST_POINTER_FILE}; a run keeps its best "
                              "checkpoint with train.keep_best=true (and train.eval_every).") from None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{pointer}: not a best-checkpoint record ({error}); it is rewritten at the next "
                              "new best, or name the step_N folder instead.") from error
    if not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(f"{pointer} names {folder}, which holds no complete checkpoint (deleted or moved?); "
                              "name a step_N folder instead.")
    return folder


__all__ = ["STEP_FOLDER", "best_checkpoint", "resolve_model_dir"]
