"""How much memory this process uses: what the progress line, metrics.jsonl and the plan check
(plan_check.py) read, on a GPU and on a CPU alike.

- **CUDA**: the caching allocator's peak of *allocated* tensor bytes
  (``torch.cuda.max_memory_allocated``) -- what the model, its gradients, the optimizer state and
  the activations in flight hold at their busiest -- and, beside it, the peak it *reserved* from
  the driver (``max_memory_reserved``: allocated plus cached blocks and fragmentation), which is
  what ``nvidia-smi`` shows and what runs out first.
- **CPU**: the process's peak resident set (``VmHWM`` in ``/proc/self/status``, Linux), which
  also holds the Python heap, the data pipeline's buffers and the allocator's free lists. Off
  Linux it is not known (None).

The peaks are the process's since it started (or since a plan check reset them), never reset
between logged steps: a line says the most this run has needed so far, the number to compare
with the device's memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

PROC_STATUS = Path("/proc/self/status")


def resident_bytes(field: str) -> int | None:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process from /proc/self/status; None off Linux."""
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_resident() -> None:
    """Start VmHWM afresh at the current resident size (Linux >= 4.0: ``echo 5 > clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def format_bytes(num_bytes: float) -> str:
    """``1.5 GiB``, ``320 MiB``: three significant digits in the largest unit that keeps the number >= 1."""
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{int(num_bytes)} bytes"


def peak_memory(device: torch.device) -> dict[str, int]:
    """The step record's memory fields for ``device``: ``memory_peak_bytes`` (allocated tensors on
    CUDA, resident memory on a CPU) and on CUDA ``memory_reserved_peak_bytes``; empty when unknown."""
    if device.type == "cuda":
        return {"memory_peak_bytes": torch.cuda.max_memory_allocated(device),
                "memory_reserved_peak_bytes": torch.cuda.max_memory_reserved(device)}
    if device.type == "cpu" and (peak := resident_bytes("VmHWM")) is not None:
        return {"memory_peak_bytes": peak}
    return {}


__all__ = ["format_bytes", "peak_memory", "reset_peak_resident", "resident_bytes"]
