"""Keeping the best checkpoint and stopping early, both following the validation loss.

Fine-tuning on a small set overfits: the validation loss falls, then rises while the training
loss keeps falling. Two settings act on that (the trainer calls these after each evaluation;
the counts live in the checkpointed ``TrainerState``, so they survive a resume):

- ``train.keep_best``: an evaluation that lowers the best validation loss saves a checkpoint at
  its step (unless one is saved there anyway); pruning (``train.keep_checkpoints``) never
  deletes it while it is the best, and ``RUN_DIR/best_checkpoint.json`` names it, so that
  ``RUN_DIR/best`` reads as that checkpoint wherever a model path is taken (``meshlm generate
  runs/x/best``, ``meshlm eval``, ``convert``, ``train.init_from``). The
  validation of step 0 counts as the first best but saves nothing (no step has trained yet).
- ``train.early_stop_evals = K``: after K evaluations in a row that did not lower the best, the
  run saves, logs a ``stopped`` event with reason ``early stop`` and exits 0 (HF Trainer's
  ``early_stopping_patience``, counted in evaluations). Rerunning the same command says so and
  trains nothing; raising K (or setting it to 0) trains on from the saved step.

Every rank takes the same decisions: the validation loss they compare is the same number on each
(the evaluation sums over the ranks that split it).
"""

from __future__ import annotations

from pathlib import Path

from meshlm.checkpoint.files import BEST_POINTER_FILE, write_json_atomic

EARLY_STOP = "early stop"
"""The ``reason`` of the stopped event an early stop writes."""


def stopped_early(state, train) -> bool:
    """Whether ``train.early_stop_evals`` evaluations in a row have not improved on the best."""
    return bool(train.early_stop_evals) and state.evaluations_since_best >= train.early_stop_evals


def early_stop_message(state, train, run_dir: Path, again: bool = False) -> str:
    """The line an early stop prints (``again``: a rerun of a run that had stopped early)."""
    best = (f"its best validation loss is {state.best_val_loss:.4f}, at step {state.best_val_step}"
            if state.best_val_loss is not None else "no validation loss improved")
    pointer = Path(run_dir) / BEST_POINTER_FILE
    kept = f" (its checkpoint: {pointer})" if train.keep_best and pointer.is_file() else ""
    what = "the run stopped early" if again else "meshlm train: stopped early"
    return (f"{what} at step {state.step}/{train.steps}: {state.evaluations_since_best} evaluations in a row did not "
            f"lower the validation loss (train.early_stop_evals={train.early_stop_evals}); {best}{kept}. Raise "
            "train.early_stop_evals (or set it to 0) to train on from here.")


def write_best_pointer(run_dir: Path, step: int, val_loss: float, checkpoint: Path) -> Path:
    """RUN_DIR/best_checkpoint.json: the best step's checkpoint (written whole, then renamed)."""
    path = Path(run_dir) / BEST_POINTER_FILE
    write_json_atomic(path, {"step": step, "val_loss": val_loss, "checkpoint": str(checkpoint)})
    return path


__all__ = ["EARLY_STOP", "early_stop_message", "stopped_early", "write_best_pointer"]
