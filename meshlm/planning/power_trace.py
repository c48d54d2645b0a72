"""A job's power trace: its phase timeline painted with per-GPU power levels, times its GPU count.

The timeline is a list of ``Interval(phase, start, end)`` in seconds -- measured
(``RUN_DIR/power_timeline.jsonl``, ``intervals_from_timeline``) or predicted (the planner's step
time split into its parts, ``intervals_from_plan``). Intervals nest: a step is computation, the
waits inside it are communication or bubble, a filler burst raises whatever it overlaps. They
are painted in order of ``PAINT_ORDER`` (later wins) on a fine grid, and each output sample is
the grid's mean over it; a grid cell an interval covers in part takes its level in proportion, so the
energy of a phase shorter than a sample is kept, spread over it -- what a power meter averaging
over its sampling period would show.

An interval may hold its phase only a share ``d`` of its time (``Interval.duty``): a filler burst
(``train.power_floor``) ran GEMMs for its recorded busy seconds and rested between them, so it
lifts the level under it to ``under + d (compute - under)``; the planner's TP communication is
such a share of each micro-batch's computation.

Synchronous training keeps every GPU in the same phase at the same time (a step cannot end on
one rank before the others' collectives), so the job's trace is the per-GPU trace times the
number of GPUs. That overstates the swing where ranks are not aligned -- pipeline stages are
offset by a micro-batch, and the planner's bubble is each stage's average -- and is the usual
worst case utilities plan for. The trace has ``OFF_PADDING_S`` of zero power on both sides, so
the job's start and stop are in it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from meshlm.training.power_floor import phase_of_group

PAINT_ORDER = ("idle", "compute", "evaluation", "checkpoint", "optimizer", "communication", "bubble", "filler")
"""Phases by precedence: a later one overrides an earlier one where they overlap."""
OFF_PADDING_S = 2.0
FINE_SAMPLES_PER_SAMPLE = 20
MAX_FINE_SAMPLES = 40_000_000


@dataclass(frozen=True)
class Interval:
    phase: str
    """One of ``PAINT_ORDER``."""
    start: float
    end: float
    duty: float = 1.0
    """The share of the interval spent in this phase, spread evenly over it (the rest keeps the
    level under it): a filler burst's GEMM time, the TP communication mixed into the planner's
    computation. 1: the whole interval."""


@dataclass
class PowerTrace:
    watts_per_gpu: np.ndarray
    """One GPU's mean power over each sample."""
    rate_hz: float
    gpus: int
    run_start: int
    """Index of the first sample of the job (before it: OFF_PADDING_S of zero)."""
    run_end: int
    """Index one past its last sample."""
    pauses: list
    """(phase, start s, end s) of the checkpoint saves, relative to the trace's start (the mitigations' ramps)."""

    @property
    def job_megawatts(self) -> np.ndarray:
        return self.watts_per_gpu * self.gpus / 1e6

    @property
    def seconds(self) -> np.ndarray:
        return np.arange(len(self.watts_per_gpu)) / self.rate_hz

    def run_part(self, values: np.ndarray | None = None) -> np.ndarray:
        values = self.job_megawatts if values is None else values
        return values[self.run_start:self.run_end]


def paint(intervals: list[Interval], levels, rate_hz: float, gpus: int, padding_s: float = OFF_PADDING_S) -> PowerTrace:
    """The trace of ``intervals`` (see the module docstring); the job spans their earliest start to latest end."""
    begin = min(interval.start for interval in intervals)
    end = max(interval.end for interval in intervals)
    samples = int(math.ceil((end - begin + 2 * padding_s) * rate_hz))
    factor = max(1, min(FINE_SAMPLES_PER_SAMPLE, MAX_FINE_SAMPLES // max(samples, 1)))
    fine_rate = rate_hz * factor
    origin = begin - padding_s
    fine = np.zeros(samples * factor)
    first, last = int(round(padding_s * fine_rate)), int(round((end - origin) * fine_rate))
    fine[first:last] = levels["idle"]
    rank = {phase: order for order, phase in enumerate(PAINT_ORDER)}
    for interval in sorted(intervals, key=lambda interval: rank[interval.phase]):
        low, high = (interval.start - origin) * fine_rate, (interval.end - origin) * fine_rate
        cells, cover = covered_cells(low, high, len(fine))
        level = levels["compute" if interval.phase == "filler" else interval.phase]
        fine[cells] += cover * interval.duty * (level - fine[cells])
    watts = fine.reshape(samples, factor).mean(axis=1)
    pauses = [(interval.phase, interval.start - origin, interval.end - origin) for interval in intervals
              if interval.phase == "checkpoint"]
    return PowerTrace(watts, rate_hz, gpus, int(round(padding_s * rate_hz)), int(round((end - origin) * rate_hz)),
                      pauses)


def covered_cells(low: float, high: float, size: int) -> tuple[slice, np.ndarray]:
    """The fine cells [low, high) touches (in cell units) and the share of each it covers: the edges
    partly, so an interval keeps its exact energy however short."""
    first, last = max(0, int(math.floor(low))), min(size, int(math.ceil(high)))
    if last <= first:
        return slice(first, first), np.zeros(0)
    edges = np.arange(first, last + 1, dtype=np.float64)
    cover = np.minimum(edges[1:], high) - np.maximum(edges[:-1], low)
    return slice(first, last), np.clip(cover, 0.0, 1.0)


# --- a run's measured timeline ---------------------------------------------------------------------------

def intervals_from_timeline(records: list[dict]) -> list[Interval]:
    """The intervals of a power_timeline.jsonl's records (``meshlm/training/phase_timeline.py``)."""
    intervals = []
    for record in records:
        if "start" not in record or "end" not in record:
            continue
        if "pause" in record:
            intervals.append(Interval(record["pause"], record["start"], record["end"]))
        elif "ramp" in record:
            intervals.append(Interval("idle", record["start"], record["end"]))
        elif "step" in record:
            intervals.append(Interval("compute", record["start"], record["end"]))
        for phase in record.get("phases", []):
            name, start, end = phase[0], phase[1], phase[2]
            if name == "filler":
                busy = phase[5] if len(phase) > 5 else end - start
                intervals.append(Interval("filler", start, end, min(1.0, busy / max(end - start, 1e-9))))
            elif name == "optimizer":
                intervals.append(Interval("optimizer", start, end))
            else:
                intervals.append(Interval(phase_of_group(name), start, end))
    return intervals


# --- the planner's predicted step --------------------------------------------------------------------------

def plan_step(times: dict, micro_batches: int) -> list[tuple[str, float, float]]:
    """One predicted step as (phase, seconds, TP share) in order: half the bubble (the pipeline
    filling); each micro-batch's computation, with its TP communication mixed in (TP's
    all-reduces come per block, thousands of times a second: the share of the time they take,
    not a phase of their own), then its pipeline messages; the other half of the bubble
    (draining); the exposed DP reduction, the TP-partial gradients' all-reduce and the step's
    scalar all-reduces; the optimizer.
    ``times``: ``step_time``'s items
    (``meshlm/planning/step_time.py``)."""
    bubble = times.get("bubble_s", 0.0)
    tp, p2p = times.get("tp_comm_s", 0.0), times.get("pp_p2p_s", 0.0)
    compute = max(0.0, times["pipeline_s"] - bubble - tp - p2p)
    tp_share = tp / (compute + tp) if compute + tp > 0 else 0.0
    parts = [("bubble", bubble / 2, 0.0)]
    for _ in range(micro_batches):
        parts += [("compute", (compute + tp) / micro_batches, tp_share), ("bubble", p2p / micro_batches, 0.0)]
    exposed = times.get("dp_exposed_s", 0.0) + times.get("tp_partial_s", 0.0) + times.get("step_scalars_s", 0.0)
    parts += [("bubble", bubble / 2, 0.0), ("communication", exposed, 0.0),
              ("optimizer", times.get("optimizer_s", 0.0), 0.0)]
    return [part for part in parts if part[1] > 0]


def intervals_from_plan(step: list[tuple[str, float, float]], steps: int, save_every: int, checkpoint_s: float,
                        eval_every: int, evaluation_s: float) -> list[Interval]:
    """``steps`` predicted steps back to back, an evaluation after every ``eval_every``-th and a
    checkpoint save after every ``save_every``-th (and both after the last, as the trainer does)."""
    intervals, now = [], 0.0
    for number in range(1, steps + 1):
        for phase, seconds, tp_share in step:
            intervals.append(Interval(phase, now, now + seconds))
            if tp_share > 0:
                intervals.append(Interval("communication", now, now + seconds, tp_share))
            now += seconds
        last = number == steps
        if eval_every and evaluation_s > 0 and (number % eval_every == 0 or last):
            intervals.append(Interval("evaluation", now, now + evaluation_s))
            now += evaluation_s
        if checkpoint_s > 0 and ((save_every and number % save_every == 0) or last):
            intervals.append(Interval("checkpoint", now, now + checkpoint_s))
            now += checkpoint_s
    return intervals


__all__ = ["FINE_SAMPLES_PER_SAMPLE", "OFF_PADDING_S", "PAINT_ORDER", "Interval", "PowerTrace",
           "intervals_from_plan", "intervals_from_timeline", "paint", "plan_step"]
