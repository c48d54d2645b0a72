"""Measured beside predicted: a run checks the plan it was started with (``meshlm train --plan``).

The planner (``meshlm/planning/``) sits above the trainer in the package's layers
(``tests/test_layout.py``), so the trainer never calls it. The command line computes the
prediction for the configured layout and hands it in as plain data::

    train(config, predicted={"memory_bytes_per_gpu": 1.2e9, "step_time_s": 0.35,
                             "layout": "tp=2,sp=true,...", "gpu": "h100"})    # layout and gpu: optional

Global rank 0 then measures the same two quantities and reports them once, at the first logged
step after step ``WARMUP_STEPS`` (the first steps pay for compilation, the allocator's first
requests and lazy initialization, none of which the planner models):

- **step time**: the median wall time of the steps this process ran, the first ``WARMUP_STEPS``
  left out (all of them when the run is shorter: ``warmup_included`` says so);
- **peak memory**: on CUDA ``torch.cuda.max_memory_allocated`` (tensors only: the planner's
  fragmentation margin and the communicators' workspace lie outside it); on the CPU the growth
  of the process's peak resident memory (``VmHWM``, reset when the trainer starts where Linux
  allows it) over its resident memory then -- which also holds the data pipeline's buffers and
  the allocator's caching.

Rank 0's measurement stands for the run; the planner predicts the busiest pipeline rank (the first
or the last), so under pipeline parallelism the last stage may be the one the prediction describes.
One line goes to the progress output and one record ``{"event": "plan_check", ...}`` to
metrics.jsonl, with each ratio measured / predicted.
"""

from __future__ import annotations

import statistics

import torch

from meshlm.training.memory_usage import reset_peak_resident, resident_bytes

WARMUP_STEPS = 2
PREDICTED_KEYS = ("memory_bytes_per_gpu", "step_time_s")


class PlanCheck:
    """Collects the step times of rank 0 and builds the one measured-vs-predicted record."""

    def __init__(self, predicted: dict, device: torch.device):
        missing = [key for key in PREDICTED_KEYS if key not in predicted]
        if missing:
            raise ValueError(f"the prediction handed to the trainer lacks {', '.join(missing)}; it needs "
                             f"{', '.join(PREDICTED_KEYS)} (see meshlm/training/plan_check.py).")
        self.predicted, self.device = dict(predicted), device
        self.step_seconds: list[float] = []
        self.reported = False
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = 0
        else:
            reset_peak_resident()
            self.baseline = resident_bytes("VmRSS")

    def add(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    def measured_memory(self) -> tuple[int | None, str]:
        """(peak bytes, what was measured)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), "torch.cuda.max_memory_allocated"
        peak = resident_bytes("VmHWM")
        if peak is None or self.baseline is None:
            return None, "not measured (no /proc/self/status)"
        return peak - self.baseline, "peak resident memory growth since the trainer started"

    def record(self, step: int, final: bool) -> dict | None:
        """The measured-vs-predicted record, once: at the first call past the warm-up, or at the
        run's last step if it never got past it. None otherwise."""
        if self.reported or not self.step_seconds or (len(self.step_seconds) <= WARMUP_STEPS and not final):
            return None
        self.reported = True
        timed = self.step_seconds[WARMUP_STEPS:] or self.step_seconds
        step_time = statistics.median(timed)
        memory, source = self.measured_memory()
        predicted_memory, predicted_time = self.predicted["memory_bytes_per_gpu"], self.predicted["step_time_s"]
        return {"event": "plan_check", "step": step, "layout": self.predicted.get("layout"),
                "gpu": self.predicted.get("gpu"), "timed_steps": len(timed),
                "warmup_included": len(self.step_seconds) <= WARMUP_STEPS,
                "measured_step_time_s": step_time, "predicted_step_time_s": predicted_time,
                "step_time_ratio": ratio(step_time, predicted_time),
                "measured_memory_bytes": memory, "predicted_memory_bytes": predicted_memory,
                "memory_ratio": ratio(memory, predicted_memory), "memory_measured_as": source}


def ratio(measured: float | None, predicted: float) -> float | None:
    return None if measured is None or not predicted else measured / predicted


def describe(record: dict) -> str:
    """``plan check at step 3: step time 0.21 s measured, 0.18 s predicted (x1.17); peak memory ...``"""
    def times(value):
        return "" if value is None else f" (x{value:.2f})"

    memory = record["measured_memory_bytes"]
    measured = "not measured" if memory is None else f"{memory / 2 ** 20:.1f} MiB measured"
    warmup = ", warm-up included" if record["warmup_included"] else ""
    return (f"plan check at step {record['step']}: step time {record['measured_step_time_s']:.4g} s measured "
            f"(median of {record['timed_steps']}{warmup}), {record['predicted_step_time_s']:.4g} s predicted"
            f"{times(record['step_time_ratio'])}; peak memory {measured}, "
            f"{record['predicted_memory_bytes'] / 2 ** 20:.1f} MiB predicted{times(record['memory_ratio'])} "
            f"[{record['memory_measured_as']}]")


__all__ = ["PREDICTED_KEYS", "PlanCheck", "WARMUP_STEPS", "describe", "ratio", "reset_peak_resident",
           "resident_bytes"]
