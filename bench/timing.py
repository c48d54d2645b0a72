"""Timing on a noisy machine and on a GPU: runs interleaved with a warm-up and their medians
compared (``interleaved_medians``), calls timed between device synchronizations (``time_kernel``,
``synchronize``), and training steps timed the same way (``timed_steps``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch



def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU), so a timer around it measures the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Each named run (returning the seconds it took) once as a warm-up, then ``repeats`` rounds of
    all of them in turn, so machine noise hits every run alike; the median seconds of each."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    return {name: statistics.median(values) for name, values in times.items()}


def time_kernel(run, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def timed_steps(trainer, steps: int) -> float:
    """Seconds per step over ``steps`` of ``trainer.train_step()`` (a meshlm ``Trainer``; the device
    synchronized at both ends)."""
    synchronize(trainer.device)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    synchronize(trainer.device)
    return (time.perf_counter() - started) / steps
