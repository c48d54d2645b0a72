"""Experiment tracking with Weights & Biases (``train.wandb=true``), beside metrics.jsonl and TensorBoard.

What a W&B run receives, all from global rank 0 (the rank that writes metrics.jsonl):

- the resolved run config (``RunConfig.to_dict()``: precision.dtype=auto already resolved),
- every number of every metrics.jsonl record, under the names TensorBoard uses
  (``train/loss``, ``valid/loss``, ``loss/lm``, ...), with the record's ``step``,
- RUN_DIR/loss.png as an image at the end, once ``plots.py`` has drawn it.

W&B's own step counter only moves forward, so a run resumed from an older checkpoint could not
log its steps again. The charts are therefore drawn against a metric of our own, ``step``
(``define_metric("*", step_metric="step")``): the steps a crashed process logged past its last
checkpoint stay in the history, and the resumed process logs them again.

Resuming: the first process of a run stores the W&B run id in RUN_DIR/wandb_id (written
atomically); a process that resumes from a checkpoint reads it and continues that W&B run. A
fresh start (no checkpoint) begins a new W&B run, as it begins a new metrics.jsonl.
``WANDB_MODE=offline`` writes the run under RUN_DIR/wandb, to upload later with ``wandb sync``.

wandb is optional (``pip install meshlm[tracking]``) and imported only when tracking is on.
W&B is set up to stay quiet: no console capture (``console="off"``), no system-metrics sampling
(``x_disable_stats``), no git, code or machine inspection.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from meshlm.errors import ConfigError

RUN_ID_FILE = "wandb_id"


def check_wandb_installed(enabled: bool) -> None:
    """Refuse ``train.wandb=true`` at start-up when wandb cannot be imported."""
    if not enabled:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("train.wandb=true needs the wandb package: pip install meshlm[tracking] "
                          "(or pip install wandb), or set train.wandb=false.") from None


def tensorboard_tag(key: str) -> str:
    """The chart name of a metrics.jsonl key: ``loss`` -> train/loss, ``val_loss`` -> valid/loss,
    ``loss_lm`` -> loss/lm (the same in TensorBoard and W&B)."""
    if key.startswith("val_"):
        return f"valid/{key[4:]}"
    if key.startswith("loss_"):
        return f"loss/{key[5:]}"
    return f"train/{key}"


def scalar_items(record: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl step record, by chart name (``step`` itself excluded)."""
    return {tensorboard_tag(key): value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def read_run_id(run_dir: Path) -> str | None:
    """The W&B run id stored in RUN_DIR/wandb_id, or None."""
    path = Path(run_dir) / RUN_ID_FILE
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def write_run_id(run_dir: Path, run_id: str) -> None:
    """RUN_DIR/wandb_id, written to a temporary file and renamed: never half written."""
    path = Path(run_dir) / RUN_ID_FILE
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(run_id + "\n")
    os.replace(temporary, path)


class WandbTracker:
    """One W&B run mirroring a MetricsLog; ``resume=True`` continues the run named in RUN_DIR/wandb_id."""

    def __init__(self, run_dir: Path, config: dict, project: str, run_name: str | None, resume: bool):
        import wandb

        self.wandb = wandb
        run_dir = Path(run_dir)
        run_id = read_run_id(run_dir) if resume else None
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                                  x_disable_machine_info=True, disable_git=True, disable_code=True, save_code=False)
        try:
            self.run = wandb.init(project=project, name=run_name or run_dir.resolve().name, dir=str(run_dir),
                                  config=config, id=run_id, resume="allow", settings=settings)
        except wandb.errors.UsageError as error:  # e.g. no API key
            raise ConfigError(f"train.wandb=true but W&B could not start: {str(error).rstrip('.')} (or set "
                              "WANDB_MODE=offline to write the run under RUN_DIR/wandb, or train.wandb=false).") from None
        write_run_id(run_dir, self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def description(self) -> str:
        """One line saying where the run can be seen: its URL, or its offline folder."""
        where = (f"offline in {Path(self.run.dir).parent} (upload it with `wandb sync`)" if self.run.offline
                 else self.run.url)
        return f"meshlm train: W&B run {self.run.project}/{self.run.name} (id {self.run.id}), {where}"

    def log(self, record: dict) -> None:
        """Mirror one metrics.jsonl step record (header and event records carry no metrics)."""
        if "step" in record and record.get("event") is None:
            self.run.log({"step": record["step"], **scalar_items(record)})

    def log_image(self, name: str, path: Path, step: int) -> None:
        self.run.log({"step": step, name: self.wandb.Image(str(path))})

    def close(self) -> None:
        """Finish the W&B run; called from the trainer's ``finally``, where an exception on its way up
        (a crash) marks the run failed (exit code 1) instead of finished."""
        self.run.finish(exit_code=1 if sys.exc_info()[0] is not None else 0)


__all__ = ["RUN_ID_FILE", "WandbTracker", "check_wandb_installed", "read_run_id", "scalar_items", "tensorboard_tag",
           "write_run_id"]
