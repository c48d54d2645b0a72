"""Timing runs that compete for a noisy machine: interleaved, with a warm-up, medians compared."""

from __future__ import annotations

import statistics
from collections.abc import Callable


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
