"""A training step that runs out of memory: one sentence saying what ran out, the numbers, and
which settings lower the peak, instead of the allocator's traceback.

On a GPU the caching allocator raises ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried to
allocate 2.00 GiB. GPU 0 has a total capacity of ..."), usually at a step's largest activation
or at the optimizer's first step, when its state is created. On the CPU a request the host cannot
back raises a ``RuntimeError`` from ``DefaultCPUAllocator`` ("can't allocate memory: you tried to
allocate N bytes"); a run that outgrows memory one small allocation at a time is killed by the
kernel's OOM killer instead (status 137), which no process can report -- the trainer's memory
estimate warns of that before the first step (memory_estimate.py).

The trainer turns either error into ``OutOfMemoryStop``, whose message holds:

- where: the device, the step being taken (or the validation or checkpoint after it), the size
  of the failed request and, on CUDA, the peak this process had allocated;
- the trainer's estimate of its peak (weights, gradients, optimizer state, activations), so a
  user sees which part to shrink;
- the settings that shrink each part (``memory_remedies``, shared with the estimate's warning) and
  ``meshlm plan``, which predicts every layout's memory before renting GPUs;
- the newest complete checkpoint, which nothing touched: rerunning the command with the changed
  settings resumes from it (a micro-batch size or layout change reshards on load).

``meshlm train`` prints it and exits with status ``EXIT_OUT_OF_MEMORY`` (1). Under torchrun the
other ranks then fail their next collective and exit with status 3 (fault_tolerance.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from meshlm.checkpoint.folders import latest_checkpoint
from meshlm.training.memory_estimate import MemoryEstimate, memory_remedies
from meshlm.training.memory_usage import format_bytes

EXIT_OUT_OF_MEMORY = 1
"""The exit status of ``meshlm train`` after a step ran out of memory."""

CPU_ALLOCATION_FAILURE = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
CUDA_REQUEST = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")


class OutOfMemoryStop(Exception):
    """A training step ran out of memory; the message says what to change (module docstring)."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's failure: CUDA's ``OutOfMemoryError``, or the CPU
    allocator's ``RuntimeError`` for a request the host cannot back."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and CPU_ALLOCATION_FAILURE.search(str(error)) is not None)


def failed_request(error: BaseException) -> str | None:
    """The size of the allocation that failed, as the allocator reported it (None if it did not)."""
    text = str(error)
    if (cpu := CPU_ALLOCATION_FAILURE.search(text)) is not None:
        return format_bytes(int(cpu.group(1)))
    if (cuda := CUDA_REQUEST.search(text)) is not None:
        return cuda.group(1)
    return None


def out_of_memory_message(error: BaseException, doing: str, device: torch.device, estimate: MemoryEstimate,
                          config, run_dir, snapshot: Path | None = None) -> str:
    """The ``OutOfMemoryStop`` sentence for ``error``, raised ``doing`` ("in step 3", "after step 2,
    in its validation, ..."); ``snapshot``: the allocator's history, under train.memory_snapshot
    (memory_snapshot.py)."""
    request = failed_request(error)
    where = f"out of memory on {device} {doing}"
    if request is not None:
        where += f" (a request for {request} failed"
        if device.type == "cuda":
            where += f"; this process had allocated at most {format_bytes(torch.cuda.max_memory_allocated(device))}"
        where += ")"
    checkpoint = latest_checkpoint(run_dir)
    resume = (f"{checkpoint} is intact, and rerunning with the changes resumes from it" if checkpoint is not None
              else f"no checkpoint had been saved in {run_dir} yet")
    if snapshot is not None:
        history = f" The allocator's history is in {snapshot}: open it at https://pytorch.org/memory_viz."
    elif device.type == "cuda":
        history = " train.memory_snapshot=true records what filled the GPU."
    else:
        history = ""
    return (f"{where}. The estimated peak of this process is {estimate.describe()}; {memory_remedies(config)}. "
            f"`meshlm plan CONFIG.yaml --gpus N` predicts each layout's memory. {resume}.{history}")


__all__ = ["EXIT_OUT_OF_MEMORY", "OutOfMemoryStop", "failed_request", "is_out_of_memory", "out_of_memory_message"]
