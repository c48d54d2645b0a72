"""``train.power_floor``: fill the step's communication gaps with GEMMs so a GPU's power stays above a floor.

A synchronous training job swings its power at the step frequency: every GPU draws near its
limit while it computes and much less while it waits on a collective or on the pipeline, all
GPUs together (the power-stabilization paper, 2025: the swings of large jobs sit at 0.2-3 Hz,
inside the 0.1-20 Hz band utilities constrain). The software mitigation it describes is this
file: while the host waits on communication, a *filler* runs matrix multiplications on tensors of
its own, so the GPU keeps drawing power. Nothing the model computes is touched (the filler's
tensors are its own, filled with constants: no random generator is drawn from), so the losses
are those of a run without it; what it costs is energy, and a little contention with the
collective it overlaps.

**When.** The filler thread starts work only inside a *wait window*
(``meshlm/parallel/communication_waits.py``: the host is stuck in a collective or a pipeline
receive, over any group), checking under the windows' lock before each GEMM that the window is
still open; a GEMM started inside a window finishes at most one GEMM after it closes. Each burst
(a run of GEMMs in one window) is recorded -- start, end, start of its last GEMM -- so that the
claim can be checked from timestamps (``tests/training/test_power_floor.py``).

**How much.** A GPU waiting draws about ``w`` of its compute power (``PHASE_POWER_FRACTION``:
``communication`` while in a collective, ``bubble`` while a pipeline stage waits for its
neighbour, ``checkpoint`` during a save); running GEMMs a fraction ``d`` of the time brings it to
about ``w + d (1 - w)``. So the filler runs GEMMs a share ``d = (F - w) / (1 - w)`` of each
burst for the floor ``F`` (none when ``w >= F``), resting whenever its GEMM time gets ahead of
that share (a closed loop: time lost to the scheduler counts as rest).

**Ramps** (``train.power_ramp_seconds = R``). A floor does not help where the job starts, stops
or pauses: there power jumps between zero and its peak at once. So with ``R > 0`` the filler also
runs outside the waits: before the first step it ramps the floor from 0 to ``F`` over ``R``
seconds (the trainer waits), after the last step from ``F`` to 0; during a checkpoint save it
holds ``F`` and fades to 0 over ``R`` seconds, and when the save is over it climbs back to ``F``
(in the time the fade took) before training resumes. Without ramps a save is held at ``F``.

The fractions below are this module's assumptions, shared with ``meshlm power``
(``meshlm/planning/power_levels.py``): dense GEMMs run a GPU at about its power limit (1.0); NCCL
collectives keep copy engines, NVLink and a few SMs busy (0.45); a pipeline stage that waits is
nearly idle, clocks up (0.25); the optimizer is memory-bound (0.6); evaluation is forward-only
work (0.85); a checkpoint save leaves the GPU idle but for device-to-host copies (0.2); an idle
GPU draws 0.1-0.15 of its limit (0.15). On CUDA the filler's GEMMs go to a secondary stream
(bf16, 4096^2: a fraction of a millisecond on an H100); on the CPU to a thread (fp32, 128^2) --
the same mechanism, so the CPU tests can watch it.

Limitation on CUDA: the windows are the *host's* waits. With NCCL a collective returns when it
is enqueued and ``wait()`` makes the compute stream wait, not the host, so the windows hold only
the waits that block the host (object collectives, barriers, synchronizing ``wait()`` s, gloo
groups); filling the device-side waits would need the filler to poll each NCCL work's completion
event instead. With gloo (the CPU) every wait blocks the host and is filled.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PHASE_POWER_FRACTION = {"compute": 1.0, "communication": 0.45, "bubble": 0.25, "optimizer": 0.6,
                        "evaluation": 0.85, "checkpoint": 0.2, "idle": 0.15}
"""A GPU's power in each phase of a step, as a fraction of its power while computing (the
assumptions of the module docstring; ``meshlm power --levels`` overrides the watts)."""

MIN_REST_S = 5e-4
"""The filler sleeps only when it owes at least this much rest (a shorter sleep costs more than it rests)."""
PIPELINE_GROUPS = ("pp", "embedding")
"""Groups whose waits are the pipeline's (a stage waiting on its neighbour): the bubble."""


def phase_of_group(group_name: str) -> str:
    """The step phase a wait on ``group_name`` is: 'bubble' for the pipeline's groups, else 'communication'."""
    return "bubble" if group_name in PIPELINE_GROUPS else "communication"


def filler_duty(floor: float, waiting_fraction: float) -> float:
    """The share of time the filler must run GEMMs so that ``w + d (1 - w) >= floor``: 0 when the
    waiting GPU already draws enough, at most 1."""
    if floor <= waiting_fraction:
        return 0.0
    return min(1.0, (floor - waiting_fraction) / (1.0 - waiting_fraction))


@dataclass
class Burst:
    """A run of filler GEMMs in one window (``perf_counter`` seconds)."""

    why: str
    """'wait' (inside a wait window), 'ramp' (start or end of the run) or 'checkpoint'."""
    start: float
    end: float
    last_gemm_start: float
    gemms: int
    busy: float = 0.0
    """Seconds spent in GEMMs (the rest of the burst the filler rested: its duty is busy / length)."""


class PowerFloor:
    """The filler of one rank: a thread started by ``start()`` and stopped by ``close()``."""

    def __init__(self, floor: float, ramp_seconds: float, device: torch.device, waits):
        self.floor, self.ramp_seconds, self.device, self.waits = floor, ramp_seconds, torch.device(device), waits
        self.bursts: list[Burst] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._held: tuple | None = None  # (why, level function of perf_counter time): running outside the waits
        self._thread: threading.Thread | None = None
        self._left, self._right, self._out, self._stream = None, None, None, None

    # --- the main thread's side ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the filler thread, then (with ramps) ramp the floor from 0 to F before returning."""
        if self.floor <= 0 or self._thread is not None:
            return
        self._allocate()
        self._thread = threading.Thread(target=self._run, name="meshlm-power-floor", daemon=True)
        self._thread.start()
        self._ramp("ramp", 0.0, self.floor, self.ramp_seconds)

    def finish(self) -> None:
        """After the last step: ramp the floor from F down to 0 (with ramps), then stop."""
        if self._thread is not None:
            self._ramp("ramp", self.floor, 0.0, self.ramp_seconds)
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @contextmanager
    def pause(self, why: str = "checkpoint"):
        """A checkpoint save: held at F (fading to 0 over the ramp time), back to F before returning."""
        if self._thread is None:
            yield
            return
        began, fade = time.perf_counter(), self.ramp_seconds
        level = (lambda now: self.floor * max(0.0, 1.0 - (now - began) / fade)) if fade > 0 else (lambda now: self.floor)
        self._hold(why, level)
        try:
            yield
        finally:
            reached = level(time.perf_counter())
            self._hold(None, None)
            if reached < self.floor:  # climb back in the time the fade took
                self._ramp(why, reached, self.floor, (self.floor - reached) / self.floor * fade)

    def drain_bursts(self) -> list[Burst]:
        with self._lock:
            bursts, self.bursts = self.bursts, []
        return bursts

    def _ramp(self, why: str, start_level: float, end_level: float, seconds: float) -> None:
        """Run the filler outside the waits, its floor moving linearly over ``seconds``; blocks that long."""
        if seconds <= 0:
            return
        began = time.perf_counter()
        self._hold(why, lambda now: start_level + (end_level - start_level) * min(1.0, (now - began) / seconds))
        try:
            time.sleep(seconds)
        finally:
            self._hold(None, None)

    def _hold(self, why, level) -> None:
        with self._lock:
            self._held = (why, level) if why is not None else None

    # --- the filler thread -----------------------------------------------------------------------------
    def _allocate(self) -> None:
        cuda = self.device.type == "cuda"
        size, dtype = (4096, torch.bfloat16) if cuda else (128, torch.float32)
        # constants, not random draws: the run's generators are not advanced
        self._left = torch.full((size, size), 1.0 / size, dtype=dtype, device=self.device)
        self._right = torch.full((size, size), 1.0, dtype=dtype, device=self.device)
        self._out = torch.empty((size, size), dtype=dtype, device=self.device)
        self._stream = torch.cuda.Stream(self.device) if cuda else None

    def _gemm(self) -> None:
        if self._stream is None:
            torch.mm(self._left, self._right, out=self._out)
            return
        with torch.cuda.stream(self._stream):
            torch.mm(self._left, self._right, out=self._out)
        self._stream.synchronize()  # only this thread waits: the timestamps are the GEMM's own

    def _run(self) -> None:
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # this thread's current device: the rank's GPU
        while not self._stop.is_set():
            with self._lock:
                held = self._held
            if held is not None:
                self._fill_held(*held)
            elif self.waits is not None and self.waits.pending.wait(timeout=0.02):
                self._fill_window(self.waits.windows_opened)

    @staticmethod
    def _rest(burst: Burst, duty: float, until) -> None:
        """Rest until the burst's GEMM time is ``duty`` of its length (or ``until``, an Event, is set).
        Closed loop: the time the thread lost to the scheduler counts as rest, and rests shorter
        than ``MIN_REST_S`` are owed (run back to back) rather than slept, a sleep's own cost."""
        owed = burst.busy / duty - (time.perf_counter() - burst.start) if duty > 0 else 0.0
        if owed >= MIN_REST_S:
            until.wait(owed)

    def _fill_window(self, window: int) -> None:
        """GEMMs while wait window number ``window`` stays open, each started inside it."""
        burst = None
        while not self._stop.is_set():
            now = self.waits.open_since(window)  # None once the window has closed
            duty = filler_duty(self.floor, PHASE_POWER_FRACTION[phase_of_group(self.waits.waiting_on)])
            if now is None or duty <= 0 or self._held is not None:
                break
            self._gemm()
            done = time.perf_counter()
            burst = burst or Burst("wait", now, done, now, 0)
            burst.end, burst.last_gemm_start, burst.gemms, burst.busy = done, now, burst.gemms + 1, burst.busy + done - now
            self._rest(burst, duty, self.waits.settled)
        if burst is None and self.waits.open_since(window) is not None:
            self.waits.settled.wait(0.02)  # nothing to fill (duty 0): let the window pass
        self._record(burst)

    def _fill_held(self, why: str, level) -> None:
        """GEMMs at the held level (a ramp, a checkpoint) while it stays held."""
        burst = None
        while not self._stop.is_set():
            with self._lock:
                if self._held is None or self._held[0] != why:
                    break
                now = time.perf_counter()
                duty = filler_duty(level(now), PHASE_POWER_FRACTION["checkpoint" if why == "checkpoint" else "idle"])
            if duty <= 0:
                self._stop.wait(0.005)
                continue
            self._gemm()
            done = time.perf_counter()
            burst = burst or Burst(why, now, done, now, 0)
            burst.end, burst.last_gemm_start, burst.gemms, burst.busy = done, now, burst.gemms + 1, burst.busy + done - now
            self._rest(burst, duty, self._stop)
        self._record(burst)

    def _record(self, burst: Burst | None) -> None:
        if burst is not None:
            with self._lock:
                self.bursts.append(burst)


__all__ = ["MIN_REST_S", "PHASE_POWER_FRACTION", "PIPELINE_GROUPS", "Burst", "PowerFloor", "filler_duty", "phase_of_group"]
