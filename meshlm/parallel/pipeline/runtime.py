"""Executing one rank's pipeline schedule: receive, compute, send -- and when each action ran.

``PipelineExecutor.run(stages)`` walks the rank's action list (``schedules.build_schedule``):

    for each action (F or B of one micro-batch through one model chunk):
        wait for its input, if it comes from another stage (an activation for F on a virtual
            stage > 0, an activation gradient for B on a virtual stage < last)
        gloo: post the receive of what the NEXT action needs, so it arrives during this compute
        compute it: stages.forward(action, input) / stages.backward(action, grad)
        send what it produced to the neighbouring virtual stage (NCCL: in one batched call with
            the receive of what the next action needs; ``p2p.py`` says why)

The executor knows nothing about language models: ``stages`` is any object with
``forward(action, incoming) -> outgoing`` and ``backward(action, incoming_grad) -> outgoing_grad``
(``pipelined_model.LanguageModelStages`` for training, a fixed-duration stand-in in
``bench/pipeline_bubble.py``). It records, per action, when its computation started and ended
(``time.perf_counter``) and when the receive of its input was posted; the gaps are the rank's
idle time: the pipeline bubble plus transfers.

Why our own executor rather than ``torch.distributed.pipelining``: that package wants one
``nn.Module`` per stage whose ``forward`` maps the received tensors to the sent ones, with the
loss a function of the last stage's output. Our ranks hold several chunks of ONE module that
keeps single-process parameter names (checkpoints, optimizer groups and the gradient reducer
work by name), non-last stages have a loss of their own (the MoE auxiliary terms must reach the
gradient), the tied embedding lives on two stages, and the benchmark needs per-action times.
Wrapping all of that cost more code than these ~100 lines, and the schedule stays a list anyone
can print (``print(schedule)``) and test without processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from meshlm.parallel.pipeline.p2p import ACTIVATION, GRADIENT, Message, PointToPoint
from meshlm.parallel.pipeline.schedules import FORWARD, Action, PipelineSchedule


@dataclass(frozen=True)
class ActionRecord:
    action: Action
    start: float
    """``time.perf_counter()`` when the computation started (its input had arrived)."""
    end: float
    input_posted: float | None = None
    """When the receive of its input from another stage was posted (None: no such input)."""


class PipelineExecutor:
    """Runs pipeline rank ``pp_rank``'s actions of ``schedule``; ``pp_ranks`` are the global ranks
    of the pipeline in stage order, ``group`` its process group."""

    def __init__(self, schedule: PipelineSchedule, pp_rank: int, pp_ranks: tuple[int, ...], group):
        self.schedule, self.pp_rank, self.pp_ranks, self.group = schedule, pp_rank, tuple(pp_ranks), group

    def incoming(self, action: Action) -> Message | None:
        """The message ``action`` needs from another stage, if any."""
        stage = self.schedule.virtual_stage(self.pp_rank, action.chunk)
        if action.kind == FORWARD:
            return Message(ACTIVATION, action.microbatch, stage, self._rank_of(stage - 1)) if stage > 0 else None
        last = self.schedule.num_virtual_stages - 1
        return Message(GRADIENT, action.microbatch, stage, self._rank_of(stage + 1)) if stage < last else None

    def outgoing(self, action: Action) -> Message | None:
        """Where the result of ``action`` goes, if anywhere."""
        stage = self.schedule.virtual_stage(self.pp_rank, action.chunk)
        if action.kind == FORWARD:
            last = self.schedule.num_virtual_stages - 1
            return Message(ACTIVATION, action.microbatch, stage + 1, self._rank_of(stage + 1)) if stage < last else None
        return Message(GRADIENT, action.microbatch, stage - 1, self._rank_of(stage - 1)) if stage > 0 else None

    def _rank_of(self, virtual_stage: int) -> int:
        return self.pp_ranks[self.schedule.place(virtual_stage)[0]]

    def run(self, stages, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[ActionRecord]:
        """Execute every action of this rank; returns when its last send has completed."""
        actions = self.schedule.actions[self.pp_rank]
        p2p = PointToPoint(self.group, shape, dtype, device, self.schedule.num_virtual_stages)
        records = []
        receive = p2p.start([], self.incoming(actions[0])) if actions else None
        for index, action in enumerate(actions):
            received, posted = receive.wait(), receive.posted_at
            following = self.incoming(actions[index + 1]) if index + 1 < len(actions) else None
            if p2p.receives_early:  # posted before this action's compute, which it may arrive during
                receive = p2p.start([], following)
            start = time.perf_counter()
            if action.kind == FORWARD:
                produced = stages.forward(action, received)
            else:
                produced = stages.backward(action, received)
            records.append(ActionRecord(action, start, time.perf_counter(), posted if received is not None else None))
            destination = self.outgoing(action)
            sends = [(destination, produced)] if destination is not None else []
            if p2p.receives_early:
                p2p.start(sends, None)
            else:
                receive = p2p.start(sends, following)
        p2p.wait_sends()
        return records


def idle_fraction(records: list[ActionRecord], step_start: float, step_end: float) -> float:
    """Share of [step_start, step_end] a rank spent not computing (bubble and transfers)."""
    busy = sum(record.end - record.start for record in records)
    return 1.0 - busy / (step_end - step_start)


__all__ = ["ActionRecord", "PipelineExecutor", "idle_fraction"]
