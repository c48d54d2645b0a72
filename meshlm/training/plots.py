"""RUN_DIR/loss.png: the training and validation loss curves of a run, drawn from metrics.jsonl.

The plot is read back from metrics.jsonl rather than from the trainer's memory, so it shows the
whole history of a resumed run (every earlier process's steps too) and can be redrawn later
with ``plot_losses(run_dir)``. matplotlib is an optional dependency: without it the trainer
prints a one-line note and carries on.
"""

from __future__ import annotations

import os
from pathlib import Path

from meshlm.training.metrics import METRICS_FILE, read_metrics

PLOT_FILE = "loss.png"


def loss_curves(records: list[dict]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, train loss) and (step, validation loss) points, in step order."""
    train = sorted((r["step"], r["loss"]) for r in records if "loss" in r and r.get("event") is None)
    valid = sorted((r["step"], r["val_loss"]) for r in records if "val_loss" in r)
    return train, valid


def plot_losses(run_dir: str | os.PathLike, output: str | os.PathLike | None = None) -> Path | None:
    """Draw RUN_DIR/loss.png; return its path, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    run_dir = Path(run_dir)
    output = Path(output) if output is not None else run_dir / PLOT_FILE
    train, valid = loss_curves(read_metrics(run_dir / METRICS_FILE))
    figure, axes = plt.subplots(figsize=(7, 4))
    if train:
        axes.plot(*zip(*train), label="train", linewidth=1.2)
    if valid:
        axes.plot(*zip(*valid), label="validation", marker="o", linewidth=1.2)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(run_dir.name)
    axes.grid(alpha=0.3)
    if train or valid:
        axes.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output


__all__ = ["PLOT_FILE", "loss_curves", "plot_losses"]
