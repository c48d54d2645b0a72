"""RUN_DIR/power_timeline.jsonl: when each step computed, waited, stepped the optimizer, saved, evaluated.

A GPU's power follows what it does, so the job's power trace (``meshlm power RUN_DIR``,
``meshlm/planning/power_trace.py``) is rebuilt from when each step did what. Global rank 0
appends one JSON line per event, each written whole by one ``write`` to a file opened for
appending (a crash loses at most the line being written; the reader skips a torn last line):

    {"event": "start", "time": T, "step": 0, "device": "cuda:0", "world_size": 64, "power_floor": 0.6, ...}
    {"step": 12, "start": T1, "end": T2, "phases": [["dp_cp", a, b], ["optimizer", c, d], ["filler", e, f, g, "wait", s]]}
    {"pause": "checkpoint", "step": 20, "start": T3, "end": T4, "phases": [...]}
    {"ramp": "start", "start": T5, "end": T6, "phases": [["filler", ...], ...]}

Times are Unix seconds (``time.time()`` at the start plus ``perf_counter`` offsets, so the lines
of a resumed run continue the same clock). A step's phases are its waits on communication --
named by their group: "dp", "tp", "dp_cp", "ep", "cp", ... ("pp": the pipeline waiting on a
neighbour, which holds the bubble) -- from ``meshlm/parallel/communication_waits.py``, the
optimizer step, and the power floor's filler bursts ("filler": start, end, start of its last
GEMM, why: "wait", "ramp" or "checkpoint", seconds of GEMMs in it; ``power_floor.py``). What is left of the step is
computation. Evaluations and checkpoint saves are pauses between steps; ramps are the power
floor's, before the first step and after the last. A line holds the phases that *ended* since the
line before (a wait between two steps, a burst that finished late): read them by their times,
not by the line they sit on. Waits of a fraction of a millisecond are merged into their neighbours (a power trace does
not resolve them), so a line stays short even under tensor parallelism.

It costs two clock reads and a lock per collective (a few microseconds) and a line per step
(``train.record_phases``, on by default).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from meshlm.parallel.communication_waits import CommunicationWaits, watch_groups
from meshlm.training.power_floor import PowerFloor

TIMELINE_FILE = "power_timeline.jsonl"
MERGE_GAP_S = 5e-4
"""Waits on the same group closer than this are recorded as one."""


def merged(windows: list[tuple[str, float, float]], gap: float = MERGE_GAP_S) -> list[tuple[str, float, float]]:
    """Same-group windows (in time order) less than ``gap`` apart, joined."""
    joined: list[tuple[str, float, float]] = []
    for name, start, end in sorted(windows, key=lambda window: window[1]):
        if joined and joined[-1][0] == name and start - joined[-1][2] < gap:
            joined[-1] = (name, joined[-1][1], max(end, joined[-1][2]))
        else:
            joined.append((name, start, end))
    return joined


class PhaseTimeline:
    """The trainer's recorder (see the module docstring). ``waits``: the run's
    ``CommunicationWaits`` (or None); ``power_floor``: the run's ``PowerFloor`` (or None).
    Writes only when ``enabled`` (train.record_phases on global rank 0)."""

    def __init__(self, run_dir, enabled: bool, waits=None, power_floor=None, device=None):
        self.device = device
        self.path = Path(run_dir) / TIMELINE_FILE
        self.enabled, self.waits, self.power_floor = enabled, waits, power_floor
        self.clock_offset = time.time() - time.perf_counter()
        self.file = None
        self.phases: list[list] = []

    def open(self, header: dict) -> None:
        if self.enabled and self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._write({"event": "start", "time": round(time.time(), 6), **header, **self._device_name()})

    def _device_name(self) -> dict:
        """The GPU's name (``meshlm power`` picks its power levels by it)."""
        if self.device is None or torch.device(self.device).type != "cuda":
            return {}
        return {"device_name": torch.cuda.get_device_name(self.device)}

    def start(self, header: dict) -> None:
        """At the start of ``run()``: the header line, then the power floor's filler (and its ramp up)."""
        self.open(header)
        if self.power_floor is not None:
            with self.interval(ramp="start"):
                self.power_floor.start()

    def finish(self) -> None:
        """After the last step: the power floor's ramp down."""
        if self.power_floor is not None:
            with self.interval(ramp="end"):
                self.power_floor.finish()

    @contextmanager
    def pause(self, why: str, step: int):
        """An evaluation or a checkpoint save between steps (a save is held at the power floor)."""
        held = self.power_floor.pause(why) if self.power_floor is not None and why == "checkpoint" else nullcontext()
        with self.interval(pause=why, step=step), held:
            yield

    def close(self) -> None:
        if self.power_floor is not None:
            self.power_floor.close()
        if self.file is not None:
            os.close(self.file)
            self.file = None

    def _write(self, record: dict) -> None:
        if self.file is not None:
            os.write(self.file, (json.dumps(record) + "\n").encode())

    def _time(self, perf: float) -> float:
        return round(self.clock_offset + perf, 6)

    def _collect(self) -> list[list]:
        """This interval's phases: the waits closed and the filler bursts since the last call, then the rest."""
        phases = self.phases
        self.phases = []
        waits = merged(self.waits.drain()) if self.waits is not None else []
        phases += [[name, self._time(start), self._time(end)] for name, start, end in waits]
        bursts = self.power_floor.drain_bursts() if self.power_floor is not None else []
        phases += [["filler", self._time(burst.start), self._time(burst.end), self._time(burst.last_gemm_start),
                    burst.why, round(burst.busy, 6)] for burst in bursts]
        return sorted(phases, key=lambda phase: phase[1])

    @contextmanager
    def interval(self, **fields):
        """Record the body as one line (``step=N``, ``pause=...`` or ``ramp=...``) with its phases."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            phases = self._collect()
            if self.enabled:
                self._write({**fields, "start": self._time(start), "end": self._time(end), "phases": phases})

    @contextmanager
    def phase(self, name: str):
        """Record the body as phase ``name`` (e.g. 'optimizer') of the current interval."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.file is not None:
                self.phases.append([name, self._time(start), self._time(time.perf_counter())])


def power_recording(train, context, device) -> tuple[object, PhaseTimeline]:
    """(``context`` with every group's waits watched, the run's ``PhaseTimeline``) for a run's
    ``train`` config: waits are watched when this rank records the timeline (train.record_phases,
    global rank 0) or runs a power floor (train.power_floor > 0, every rank)."""
    record = train.record_phases and context.is_logging_rank
    if not record and train.power_floor <= 0:
        return context, PhaseTimeline(train.run_dir, False)
    waits = CommunicationWaits(signal=train.power_floor > 0)
    floor = PowerFloor(train.power_floor, train.power_ramp_seconds, device, waits) if train.power_floor > 0 else None
    return watch_groups(context, waits), PhaseTimeline(train.run_dir, record, waits, floor, device)


__all__ = ["MERGE_GAP_S", "TIMELINE_FILE", "PhaseTimeline", "merged", "power_recording"]
