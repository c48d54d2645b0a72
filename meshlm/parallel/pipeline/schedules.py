"""Pipeline schedules as plain per-rank lists of actions: 1F1B and interleaved 1F1B.

A pipeline of p ranks cuts the model into stages; a step's m micro-batches flow through them
(Narayanan et al. 2021, "Efficient large-scale language model training on GPU clusters using
Megatron-LM", §2.2). A schedule says, for each rank, in which order it runs the forward (F) and
backward (B) passes of its micro-batches. Here it is data: ``build_schedule(p, v, m)`` returns
``actions[rank] = [F0.0, F1.0, B0.0, ...]`` (``F{microbatch}.{chunk}``) that a test can read,
check and simulate without any process, and that ``runtime.PipelineExecutor`` executes.

**1F1B (PipeDream-flush, §2.2.1).** Rank r first runs p - r - 1 warm-up forwards (so that the
last stage has work as soon as possible), then alternates one forward and one backward, and
finishes with the remaining backwards (cool-down). Each rank holds at most p - r micro-batches'
activations (GPipe's all-forward-then-all-backward holds all m), and the pipeline is idle for
(p - 1) forward+backward slots per step: a *bubble* of (p - 1) / m of the ideal time.

**Interleaved 1F1B (§2.2.2).** Each rank holds v model chunks instead of one contiguous stage:
chunk c of rank r is *virtual stage* c*p + r, so a micro-batch goes round the ranks v times. A
rank runs micro-batches through its chunks in groups of p (p micro-batches through chunk 0, the
same p through chunk 1, ..., then the next p), backwards with the chunks reversed. The slots
are v times shorter, so the bubble shrinks to (p - 1) / (v m), for v times more point-to-point
messages. Groups of p need m divisible by p. The warm-up of rank r is (p - r - 1) * 2 + (v - 1) * p
forwards (Megatron-LM's schedule: the chunks' forwards must run ahead far enough that the
first backward of chunk v - 1 finds its inputs), capped at v * m.

``simulate`` replays the lists with fixed F/B durations, each action starting when its rank is
free and its input exists (F after the previous virtual stage's F of the same micro-batch; B
after the next one's B). It finds deadlocks and gives the ideal timeline: with equal stages the
bubble it measures is exactly (p - 1) / (v m). ``bench/pipeline_bubble.py`` compares it with
what the executor records.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.errors import ConfigError

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    kind: str
    """FORWARD or BACKWARD."""
    microbatch: int
    """Index of the micro-batch within this rank's share of the step."""
    chunk: int
    """Which of this rank's model chunks (0 .. vp - 1): virtual stage chunk * pp + rank."""

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}.{self.chunk}"


@dataclass(frozen=True)
class PipelineSchedule:
    pp_size: int
    vp_size: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    """``actions[rank]``: what pipeline rank ``rank`` runs, in order."""

    @property
    def num_virtual_stages(self) -> int:
        return self.pp_size * self.vp_size

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp_size + rank

    def place(self, virtual_stage: int) -> tuple[int, int]:
        """(rank, chunk) holding a virtual stage."""
        return virtual_stage % self.pp_size, virtual_stage // self.pp_size

    def __str__(self) -> str:
        return "\n".join(f"rank {rank}: " + " ".join(map(str, actions)) for rank, actions in enumerate(self.actions))


def check_microbatches(pp_size: int, vp_size: int, num_microbatches: int) -> None:
    """Refuse a micro-batch count the schedule cannot run (ConfigError naming the fix)."""
    if num_microbatches < 1:
        raise ConfigError(f"the pipeline needs at least one micro-batch per data-parallel rank, got "
                          f"{num_microbatches}; raise train.global_batch_size.")
    if vp_size > 1 and num_microbatches % pp_size:
        raise ConfigError(f"the interleaved schedule (parallel.vp={vp_size}) runs micro-batches in groups of "
                          f"parallel.pp={pp_size}, but each data-parallel rank has {num_microbatches} per step; make "
                          f"train.global_batch_size / (train.micro_batch_size * dp) a multiple of {pp_size}.")


def forward_order(pp_size: int, vp_size: int, num_microbatches: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order every rank runs its forwards: groups of pp micro-batches
    through chunk 0, then chunk 1, ...; with vp = 1 simply micro-batch 0, 1, 2, ..."""
    order = []
    for index in range(num_microbatches * vp_size):
        group, within = divmod(index, pp_size * vp_size)
        chunk, offset = divmod(within, pp_size)
        order.append((group * pp_size + offset, chunk) if vp_size > 1 else (index, 0))
    return order


def warmup_forwards(pp_size: int, vp_size: int, rank: int, num_microbatches: int) -> int:
    """Forwards rank ``rank`` runs before its first backward."""
    total = num_microbatches * vp_size
    if vp_size == 1:
        return min(pp_size - rank - 1, total)
    return min((pp_size - rank - 1) * 2 + (vp_size - 1) * pp_size, total)


def rank_actions(pp_size: int, vp_size: int, rank: int, num_microbatches: int) -> list[Action]:
    """Warm-up forwards, then one forward and one backward at a time, then the remaining backwards."""
    forwards = [Action(FORWARD, microbatch, chunk) for microbatch, chunk in
                forward_order(pp_size, vp_size, num_microbatches)]
    backwards = [Action(BACKWARD, microbatch, vp_size - 1 - chunk) for microbatch, chunk in
                 forward_order(pp_size, vp_size, num_microbatches)]
    warmup = warmup_forwards(pp_size, vp_size, rank, num_microbatches)
    actions = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        actions += [forward, backward]
    return actions + backwards[len(forwards) - warmup:]


def build_schedule(pp_size: int, vp_size: int, num_microbatches: int, forward_only: bool = False) -> PipelineSchedule:
    """1F1B (vp = 1) or interleaved 1F1B (vp > 1) for every rank; ``forward_only`` (evaluation):
    forwards alone, every micro-batch through chunk 0, then chunk 1, ... (no activations are kept
    for a backward, so nothing is gained by interleaving, and any micro-batch count works)."""
    check_microbatches(pp_size, 1 if forward_only else vp_size, num_microbatches)
    if forward_only:
        order = [Action(FORWARD, mb, chunk) for chunk in range(vp_size) for mb in range(num_microbatches)]
        actions = tuple(tuple(order) for _ in range(pp_size))
    else:
        actions = tuple(tuple(rank_actions(pp_size, vp_size, rank, num_microbatches)) for rank in range(pp_size))
    return PipelineSchedule(pp_size, vp_size, num_microbatches, actions)


# --- replaying a schedule ------------------------------------------------------------------------

def input_dependency(schedule: PipelineSchedule, rank: int, action: Action) -> tuple[str, int, int] | None:
    """(kind, microbatch, virtual stage) whose result ``action`` receives from another stage, if any."""
    stage = schedule.virtual_stage(rank, action.chunk)
    if action.kind == FORWARD:
        return (FORWARD, action.microbatch, stage - 1) if stage > 0 else None
    last = schedule.num_virtual_stages - 1
    return (BACKWARD, action.microbatch, stage + 1) if stage < last else None


def simulate(schedule: PipelineSchedule, forward_time: float = 1.0,
             backward_time: float = 2.0) -> list[list[tuple[Action, float, float]]]:
    """The timeline ``[rank] -> [(action, start, end)]`` of an ideal run (no transfer time; per
    chunk, F takes forward_time / vp and B backward_time / vp). Raises RuntimeError on a deadlock
    (every rank waiting for an input nobody will produce) or when a backward precedes its forward."""
    vp = schedule.vp_size
    done: dict[tuple[str, int, int], float] = {}
    timelines: list[list[tuple[Action, float, float]]] = [[] for _ in range(schedule.pp_size)]
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while len(timelines[rank]) < len(actions):
                action = actions[len(timelines[rank])]
                stage = schedule.virtual_stage(rank, action.chunk)
                needed = [input_dependency(schedule, rank, action)]
                if action.kind == BACKWARD:
                    if (FORWARD, action.microbatch, stage) not in done:
                        raise RuntimeError(f"rank {rank}: {action} comes before its forward")
                    needed.append((FORWARD, action.microbatch, stage))
                if any(need is not None and need not in done for need in needed):
                    break
                ready = max([done[need] for need in needed if need is not None], default=0.0)
                free = timelines[rank][-1][2] if timelines[rank] else 0.0
                duration = (forward_time if action.kind == FORWARD else backward_time) / vp
                start = max(ready, free)
                timelines[rank].append((action, start, start + duration))
                done[(action.kind, action.microbatch, stage)] = start + duration
                progressed = True
    stuck = {rank: str(actions[len(timelines[rank])]) for rank, actions in enumerate(schedule.actions)
             if len(timelines[rank]) < len(actions)}
    if stuck:
        raise RuntimeError(f"the schedule deadlocks: ranks wait at {stuck}")
    return timelines


def idle_fraction(timeline: list[tuple[Action, float, float]], step_end: float) -> float:
    """Share of [0, step_end] one rank spends without computing."""
    busy = sum(end - start for _, start, end in timeline)
    return 1.0 - busy / step_end


__all__ = ["Action", "BACKWARD", "FORWARD", "PipelineSchedule", "build_schedule", "check_microbatches",
           "forward_order", "idle_fraction", "input_dependency", "rank_actions", "simulate", "warmup_forwards"]
