"""``train.memory_snapshot=true``: the CUDA caching allocator's history, for finding what filled
the GPU when a step runs out of memory.

With it, each rank records every allocation and free of its GPU, with the Python stack that
made it (``torch.cuda.memory._record_memory_history``, the last ``MAX_ENTRIES`` events), and
writes the history as a pickle:

- ``RUN_DIR/memory_snapshot/rank{R}_step1.pickle`` after the first step, which holds a full step's
  peak: the weights, the activations of a forward and backward, the gradients, and the optimizer
  state created at the first update -- a healthy step to compare with;
- ``RUN_DIR/memory_snapshot/rank{R}_oom.pickle`` when a step runs out of memory, the moment the
  allocator gave up (its path is then named in the out-of-memory message, out_of_memory.py).

Drag a file onto https://pytorch.org/memory_viz to see memory over time, block by block, each
with the stack that allocated it ("Active Memory Timeline"), or the allocator's segments at the
end. Recording costs a Python stack walk per allocation, so it is off by default. The allocator
exists on CUDA only: a run on another device refuses the setting.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from meshlm.errors import ConfigError

SNAPSHOT_DIR = "memory_snapshot"
MAX_ENTRIES = 100_000
"""Allocator events kept (the newest): enough for several steps of a large model."""


class MemorySnapshots:
    """Records the allocator's history from ``start`` and writes it after step 1 and on out-of-memory."""

    def __init__(self, enabled: bool, device: torch.device, run_dir: Path, rank: int):
        if enabled and device.type != "cuda":
            raise ConfigError(f"train.memory_snapshot=true records the CUDA caching allocator, but this run is on "
                              f"{device.type}; set train.memory_snapshot=false (or train.device=cuda).")
        self.enabled, self.directory, self.rank = enabled, Path(run_dir) / SNAPSHOT_DIR, rank
        self.recording = False

    def start(self) -> None:
        if self.enabled and not self.recording:
            # Python stacks only: C++ frames would be symbolized when the file is written, which can
            # take minutes for a long history
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
            self.recording = True

    def after_step(self, step: int) -> Path | None:
        """Write the history after the run's first step (step 1); nothing at other steps."""
        return self.write(f"step{step}") if self.recording and step == 1 else None

    def on_out_of_memory(self) -> Path | None:
        """Write the history as it stands when the allocator gave up."""
        return self.write("oom") if self.recording else None

    def write(self, label: str) -> Path:
        """The pickle for https://pytorch.org/memory_viz, written under a temporary name, then renamed."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank{self.rank}_{label}.pickle"
        temporary = path.with_name(path.name + ".tmp")
        torch.cuda.memory._dump_snapshot(str(temporary))
        os.replace(temporary, path)
        return path

    def stop(self) -> None:
        if self.recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False


__all__ = ["MAX_ENTRIES", "SNAPSHOT_DIR", "MemorySnapshots"]
