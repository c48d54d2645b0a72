"""The pipeline bubble, measured: idle time per rank from the executor's own timestamps.

    python -m bench.pipeline_bubble [--png bench/pipeline_timeline.png] [--forward-ms 40] [--steps 3]

A pipeline of p ranks with m micro-batches per step, each rank holding v model chunks, idles
while the pipeline fills and drains. Narayanan et al. 2021 (§2.2) give the *bubble fraction*
of 1F1B as (p - 1) / m of the ideal (busy) time, and (p - 1) / (v m) for the interleaved
schedule. This benchmark runs ``meshlm.parallel.pipeline.runtime.PipelineExecutor`` -- the same
executor, schedules and batched point-to-point transfers the trainer uses -- in p spawned gloo
processes, and reads off each rank's recorded compute intervals:

    measured bubble of rank r = (step time - busy time of r) / busy time of r
    idle fraction of rank r   = (step time - busy time of r) / step time      [= bubble / (1 + bubble)]

where the step runs from the barrier before the schedule to the moment the last rank finishes.
Both are printed beside the paper's numbers and beside ``schedules.simulate`` (the same action
lists replayed with exact durations and free transfers, which reproduces the formula).

The stage computation is a stand-in of fixed duration: ``time.sleep`` for ``--forward-ms`` per
micro-batch and stage (backward twice that), split evenly over a rank's v chunks, so that the
measurement shows the schedule and the transfers, not the contention of p processes for the
cores of a small machine (a real model on 2 cores would time-share the ranks). Activations of
64 x 64 fp32 values travel between stages through ``dist.batch_isend_irecv`` as in training.
What remains above the formula is the real overhead per action: the batched send/receive, the
sleeping process waking up, Python (``excess_per_action_ms`` spreads it over a rank's 2 v m
actions). With ``--png`` a timeline of one step (one row per rank, forward light, backward dark,
labelled with the micro-batch) is drawn with matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from meshlm.parallel.groups import group_of
from meshlm.parallel.pipeline.runtime import PipelineExecutor
from meshlm.parallel.pipeline.schedules import build_schedule, simulate
from tests.helpers.distributed import run_distributed

MESSAGE_SHAPE = (1, 64, 64)
LAYOUTS = {2: [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16)],
           4: [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16)],
           8: [(1, 8), (1, 16), (2, 8), (2, 16)]}
"""pp -> [(vp, micro-batches per step)]."""
TIMELINE_LAYOUT = (4, 2, 8)


class SleepStages:
    """A stage of fixed duration: forward and backward sleep, then hand on a fixed tensor."""

    def __init__(self, forward_s: float, backward_s: float):
        self.forward_s, self.backward_s = forward_s, backward_s
        self.message = torch.zeros(MESSAGE_SHAPE)

    def forward(self, action, incoming):
        time.sleep(self.forward_s)
        return self.message

    def backward(self, action, grad):
        time.sleep(self.backward_s)
        return self.message


def measure_rank(layouts: list[tuple[int, int]], forward_s: float, steps: int) -> list[dict]:
    """In each spawned rank: run every (vp, m) schedule for 1 warm-up step and ``steps`` timed ones."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    measured = []
    for vp, microbatches in layouts:
        executor = PipelineExecutor(build_schedule(pp, vp, microbatches), rank, tuple(range(pp)),
                                    group_of(dist.group.WORLD, "pp", torch.device("cpu")))
        stages = SleepStages(forward_s / vp, 2 * forward_s / vp)
        for step in range(1 + steps):
            dist.barrier()
            start = time.perf_counter()
            records = executor.run(stages, MESSAGE_SHAPE, torch.float32, torch.device("cpu"))
            if step:  # perf_counter is the system-wide monotonic clock: comparable across processes
                measured.append({"vp": vp, "microbatches": microbatches, "start": start, "end": time.perf_counter(),
                                 "records": [(str(r.action), r.action.kind, r.action.microbatch, r.action.chunk,
                                              r.start, r.end) for r in records]})
    return measured


def summarize(pp: int, vp: int, microbatches: int, by_rank: list[list[dict]], forward_s: float) -> dict:
    """Per-rank bubble and idle fraction (medians over the timed steps), beside the paper and the replay."""
    bubbles, idles, step_times = [[] for _ in range(pp)], [[] for _ in range(pp)], []
    for step in range(len(by_rank[0])):
        end = max(ranks[step]["end"] for ranks in by_rank)
        step_times.append(end - min(ranks[step]["start"] for ranks in by_rank))
        for rank, ranks in enumerate(by_rank):
            busy = sum(stop - begin for *_, begin, stop in ranks[step]["records"])
            window = end - ranks[step]["start"]
            bubbles[rank].append((window - busy) / busy)
            idles[rank].append((window - busy) / window)
    timelines = simulate(build_schedule(pp, vp, microbatches), 1.0, 2.0)
    replay = max(timeline[-1][2] for timeline in timelines) / (3.0 * microbatches) - 1
    paper = (pp - 1) / (vp * microbatches)
    formula_step = 3 * forward_s * microbatches * (1 + paper)  # busy (F + 2F per micro-batch) plus the bubble
    median = lambda values: round(statistics.median(values), 4)  # noqa: E731  (robust to a stalled step)
    return {"pp": pp, "vp": vp, "microbatches": microbatches, "paper_bubble": round(paper, 4),
            "replay_bubble": round(replay, 4), "measured_bubble_per_rank": [median(b) for b in bubbles],
            "paper_idle_fraction": round(paper / (1 + paper), 4),
            "measured_idle_fraction_per_rank": [median(i) for i in idles], "step_s": median(step_times),
            "formula_step_s": round(formula_step, 4),
            "excess_per_action_ms": round((statistics.median(step_times) - formula_step) / (2 * vp * microbatches)
                                          * 1e3, 3)}


def draw_timeline(path: str, pp: int, vp: int, microbatches: int, by_rank: list[list[dict]], summary: dict) -> None:
    """One timed step of (pp, vp, m): a row per rank, a box per action."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [ranks[0] for ranks in by_rank]
    origin = min(step["start"] for step in steps)
    colors = {("F", 0): "#9ecae1", ("F", 1): "#c6dbef", ("B", 0): "#3182bd", ("B", 1): "#08519c"}
    figure, axes = plt.subplots(figsize=(11, 0.55 * pp + 1.2))
    for rank, step in enumerate(steps):
        for _, kind, microbatch, chunk, begin, stop in step["records"]:
            left, width = (begin - origin) * 1e3, (stop - begin) * 1e3
            axes.barh(rank, width, left=left, height=0.8, color=colors[(kind, chunk % 2)], edgecolor="white",
                      linewidth=0.5)
            axes.text(left + width / 2, rank, str(microbatch), ha="center", va="center", fontsize=7,
                      color="black" if kind == "F" else "white")
    axes.set_yticks(range(pp), [f"rank {rank}" for rank in range(pp)])
    axes.invert_yaxis()
    axes.set_xlabel("ms since the step started (forward light, backward dark; shade = model chunk)")
    axes.set_title(f"interleaved 1F1B, p={pp}, v={vp}, m={microbatches}: measured bubble "
                   f"{max(summary['measured_bubble_per_rank']):.3f} (max over ranks), (p-1)/(v m) = "
                   f"{summary['paper_bubble']:.3f}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", default="bench/pipeline_timeline.png", help="timeline picture ('' for none)")
    parser.add_argument("--forward-ms", type=float, default=40.0, help="forward time per micro-batch and stage")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout (after one warm-up)")
    args = parser.parse_args()
    results, load_before = [], os.getloadavg()[0]
    for pp, layouts in LAYOUTS.items():
        by_rank = run_distributed(measure_rank, pp, layouts, args.forward_ms / 1e3, args.steps, timeout_s=600)
        for index, (vp, microbatches) in enumerate(layouts):
            steps = [ranks[index * args.steps:(index + 1) * args.steps] for ranks in by_rank]
            results.append(summarize(pp, vp, microbatches, steps, args.forward_ms / 1e3))
            if args.png and (pp, vp, microbatches) == TIMELINE_LAYOUT:
                draw_timeline(args.png, pp, vp, microbatches, steps, results[-1])
    print(json.dumps({
        "stage_compute": f"time.sleep: {args.forward_ms:g} ms forward and {2 * args.forward_ms:g} ms backward per "
                         "micro-batch and pipeline stage, split evenly over the rank's vp chunks",
        "message": f"{list(MESSAGE_SHAPE)} fp32 per activation / gradient, batched isend/irecv over gloo",
        "bubble": "(step time - busy time) / busy time per rank; paper: (p-1)/(v m); replay: schedules.simulate",
        "excess_per_action_ms": "(measured step - formula step) / actions per rank: transfers, wake-ups, Python",
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},  # others' work slows wake-ups
        "timeline_png": args.png or None, "results": results}, indent=1))


if __name__ == "__main__":
    main()
