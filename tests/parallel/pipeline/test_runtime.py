"""The executor and its point-to-point layer on spawned gloo ranks, without a model.

* Tags: two same-shape messages between the same pair, received in the opposite order to the
  one they were sent in, each reach the right buffer (one batch of isend/irecv on gloo).
* Routing: counting stages (each forward adds 1, each backward adds 1000) through 1F1B and
  interleaved schedules: the last virtual stage sees micro-batch b's value after exactly
  pp * vp forwards, the first stage gets back pp * vp - 1 backward increments, and every rank
  records its actions in the schedule's order with increasing timestamps.
* Early receives (gloo): the receive of each action's input was posted before the previous
  action's compute started, so the message could arrive during it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshlm.parallel.groups import group_of
from meshlm.parallel.pipeline.p2p import ACTIVATION, GRADIENT, Message, PointToPoint
from meshlm.parallel.pipeline.runtime import PipelineExecutor
from meshlm.parallel.pipeline.schedules import build_schedule
from tests.helpers.distributed import run_distributed

SHAPE = (2, 3)


def world_group():
    """The whole world as the pipeline's group (the executor sends to global ranks)."""
    return group_of(dist.group.WORLD, "pp", torch.device("cpu"))


def tagged_exchange() -> list[float]:
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    p2p = PointToPoint(world_group(), SHAPE, torch.float32, torch.device("cpu"), num_virtual_stages=2)
    if rank == 0:
        sends = [(Message(ACTIVATION, microbatch, 1, peer), torch.full(SHAPE, float(microbatch + 1)))
                 for microbatch in range(2)]
        p2p.exchange(sends, None)
        p2p.wait_sends()
        return []
    second = p2p.exchange([], Message(ACTIVATION, 1, 1, peer))  # posted first, sent second
    first = p2p.exchange([], Message(ACTIVATION, 0, 1, peer))
    try:
        p2p.exchange([(Message(GRADIENT, 0, 0, peer), torch.zeros(3))], None)
    except RuntimeError as error:
        assert "expects (2, 3)" in str(error)
    else:
        raise AssertionError("a message of the wrong shape was sent")
    return [first[0, 0].item(), second[0, 0].item()]


class CountingStages:
    """Forward adds 1 to what it receives; backward adds 1000 to the gradient it receives."""

    def __init__(self, schedule, rank):
        self.schedule, self.rank = schedule, rank
        self.seen_by_last: dict[int, float] = {}
        self.returned_to_first: dict[int, float] = {}

    def forward(self, action, incoming):
        stage = self.schedule.virtual_stage(self.rank, action.chunk)
        value = torch.full(SHAPE, 100.0 * action.microbatch) if stage == 0 else incoming
        if stage == self.schedule.num_virtual_stages - 1:
            self.seen_by_last[action.microbatch] = value[0, 0].item() + 1
        return value + 1

    def backward(self, action, grad):
        stage = self.schedule.virtual_stage(self.rank, action.chunk)
        value = torch.zeros(SHAPE) if stage == self.schedule.num_virtual_stages - 1 else grad
        if stage == 0:
            self.returned_to_first[action.microbatch] = value[0, 0].item()
        return value + 1000


def count_through(pp: int, vp: int, microbatches: int) -> dict:
    rank = dist.get_rank()
    schedule = build_schedule(pp, vp, microbatches)
    stages = CountingStages(schedule, rank)
    executor = PipelineExecutor(schedule, rank, tuple(range(pp)), world_group())
    records = executor.run(stages, SHAPE, torch.float32, torch.device("cpu"))
    received = [(previous, record) for previous, record in zip(records, records[1:]) if record.input_posted is not None]
    return {"seen_by_last": stages.seen_by_last, "returned_to_first": stages.returned_to_first,
            "actions": [str(record.action) for record in records],
            "ordered": all(a.end <= b.start for a, b in zip(records, records[1:])),
            "inputs": len(received) + int(bool(records) and records[0].input_posted is not None),
            "posted_before_previous_compute": all(record.input_posted <= previous.start
                                                  for previous, record in received)}


def test_tags_match_messages_received_out_of_order():
    _, received = run_distributed(tagged_exchange, 2)
    assert received == [1.0, 2.0]


@pytest.mark.parametrize("pp, vp, microbatches", [(2, 1, 3), (2, 2, 4), (4, 2, 4), (4, 1, 6)])
def test_activations_and_gradients_reach_the_right_stage(pp, vp, microbatches):
    results = run_distributed(count_through, pp, pp, vp, microbatches)
    stages = pp * vp
    schedule = build_schedule(pp, vp, microbatches)
    for rank, result in enumerate(results):
        assert result["actions"] == [str(action) for action in schedule.actions[rank]]
        assert result["ordered"]
        assert result["posted_before_previous_compute"], rank
        executor = PipelineExecutor(schedule, rank, tuple(range(pp)), None)
        assert result["inputs"] == sum(executor.incoming(action) is not None for action in schedule.actions[rank])
    assert results[pp - 1]["seen_by_last"] == {b: 100.0 * b + stages for b in range(microbatches)}
    assert results[0]["returned_to_first"] == {b: 1000.0 * (stages - 1) for b in range(microbatches)}
