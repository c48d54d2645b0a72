"""One rank of the fault tests (tests/training/test_chaos.py): ``meshlm train`` plus instruments.

    python tests/training/chaos_worker.py SECTION.KEY=VALUE ...      (as torchrun's script, or alone
                                                                      with RANK/WORLD_SIZE/MASTER_* set)

* writes ``$MESHLM_CHAOS_DIR/pids/RESTART-RANK.pid`` (RESTART is torchrun's restart count), so the
  test knows which process plays which rank in which attempt, kills the one it picks, and cleans up;
* ``MESHLM_CHAOS_STEP_DELAY_S``: sleep before every step, so a run lasts long enough to be hit;
* ``MESHLM_CHAOS_SAVE_DELAY_S``: sleep before every rename into the checkpoints folder, so a save
  stays in progress (written but not yet committed) long enough for a kill to land inside it.

Nothing here changes what is computed: a run with the delays trains exactly like one without.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def record_pid() -> None:
    folder = Path(os.environ["MESHLM_CHAOS_DIR"]) / "pids"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-{os.environ.get('RANK', '0')}.pid"
    temporary = folder / f".{name}.tmp"
    temporary.write_text(str(os.getpid()))
    os.replace(temporary, folder / name)  # the test never reads a half-written file


def delay_steps(seconds: float) -> None:
    from meshlm.training.trainer import Trainer

    train_step = Trainer.train_step

    def slow_train_step(self):
        time.sleep(seconds)
        return train_step(self)

    Trainer.train_step = slow_train_step


def delay_checkpoint_renames(seconds: float) -> None:
    """Every save commits by renames (files into place, the folder into its final name)."""
    for name in ("rename", "replace"):
        original = getattr(os, name)

        def slow(source, destination, *args, _original=original, **kwargs):
            if "checkpoints" in str(destination):
                time.sleep(seconds)
            return _original(source, destination, *args, **kwargs)

        setattr(os, name, slow)


def main() -> int:
    record_pid()
    if float(os.environ.get("MESHLM_CHAOS_STEP_DELAY_S", "0")) > 0:
        delay_steps(float(os.environ["MESHLM_CHAOS_STEP_DELAY_S"]))
    if float(os.environ.get("MESHLM_CHAOS_SAVE_DELAY_S", "0")) > 0:
        delay_checkpoint_renames(float(os.environ["MESHLM_CHAOS_SAVE_DELAY_S"]))
    from meshlm.cli import main as meshlm_main

    return meshlm_main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
