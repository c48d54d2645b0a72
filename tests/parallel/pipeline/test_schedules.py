"""The 1F1B and interleaved 1F1B action lists, checked without any process.

For many (pp, vp, m): every (micro-batch, chunk) runs F and B exactly once on each rank, every
B after its F, the warm-up counts are those of Narayanan et al. 2021 / Megatron-LM, the replay
finds no deadlock, and its ideal bubble is (p - 1) / (v m). Bad micro-batch counts are refused.
"""

from __future__ import annotations

from collections import Counter

import pytest

from meshlm.errors import ConfigError
from meshlm.parallel.pipeline.schedules import (Action, BACKWARD, FORWARD, build_schedule, forward_order, simulate,
                                                warmup_forwards)

LAYOUTS = [(pp, vp, m) for pp in (1, 2, 3, 4, 8) for vp in (1, 2, 3) for m in (pp, 2 * pp, 3 * pp)
           if not (pp == 1 and vp > 1)] + [(4, 1, 1), (4, 1, 3), (2, 1, 5), (8, 1, 2)]


@pytest.mark.parametrize("pp, vp, m", LAYOUTS)
def test_every_microbatch_and_chunk_runs_forward_then_backward_once(pp, vp, m):
    schedule = build_schedule(pp, vp, m)
    expected = Counter((kind, mb, chunk) for kind in (FORWARD, BACKWARD) for mb in range(m) for chunk in range(vp))
    for rank, actions in enumerate(schedule.actions):
        assert Counter((a.kind, a.microbatch, a.chunk) for a in actions) == expected, rank
        position = {(a.kind, a.microbatch, a.chunk): index for index, a in enumerate(actions)}
        for mb in range(m):
            for chunk in range(vp):
                assert position[(FORWARD, mb, chunk)] < position[(BACKWARD, mb, chunk)], (rank, mb, chunk)


@pytest.mark.parametrize("pp, vp, m", LAYOUTS)
def test_warmup_counts_are_the_papers(pp, vp, m):
    schedule = build_schedule(pp, vp, m)
    for rank, actions in enumerate(schedule.actions):
        paper = pp - rank - 1 if vp == 1 else 2 * (pp - rank - 1) + (vp - 1) * pp
        warmup, total = warmup_forwards(pp, vp, rank, m), m * vp
        assert warmup == min(paper, total)
        # warm-up forwards, then one forward and one backward at a time, then the cool-down backwards
        assert "".join(action.kind for action in actions) == "F" * warmup + "FB" * (total - warmup) + "B" * warmup


@pytest.mark.parametrize("pp, vp, m", LAYOUTS)
def test_replay_has_no_deadlock_and_the_papers_bubble(pp, vp, m):
    forward_time, backward_time = 1.0, 2.0
    timelines = simulate(build_schedule(pp, vp, m), forward_time, backward_time)
    step = max(timeline[-1][2] for timeline in timelines)
    ideal = m * (forward_time + backward_time)
    assert step / ideal - 1 == pytest.approx((pp - 1) / (vp * m), abs=1e-12)


def test_dependencies_are_respected_in_the_replay():
    schedule = build_schedule(4, 2, 8)
    finished = {}
    for rank, timeline in enumerate(simulate(schedule)):
        for action, _, end in timeline:
            finished[(action.kind, action.microbatch, schedule.virtual_stage(rank, action.chunk))] = end
    for rank, timeline in enumerate(simulate(schedule)):
        for action, start, _ in timeline:
            stage = schedule.virtual_stage(rank, action.chunk)
            if action.kind == FORWARD and stage > 0:
                assert start >= finished[(FORWARD, action.microbatch, stage - 1)]
            if action.kind == BACKWARD and stage < schedule.num_virtual_stages - 1:
                assert start >= finished[(BACKWARD, action.microbatch, stage + 1)]


def test_interleaved_order_goes_round_the_chunks_in_groups_of_pp():
    assert forward_order(2, 2, 4) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    rank0 = " ".join(map(str, build_schedule(2, 2, 4).actions[0]))
    assert rank0 == "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    assert " ".join(map(str, build_schedule(4, 1, 6).actions[1])) == "F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 F4.0 B2.0 " \
        "F5.0 B3.0 B4.0 B5.0"


def test_a_schedule_that_cannot_run_is_caught_by_the_replay():
    broken = build_schedule(2, 1, 2)
    swapped = (broken.actions[0], (Action(BACKWARD, 0, 0), Action(FORWARD, 0, 0), *broken.actions[1][2:]))
    with pytest.raises(RuntimeError, match="before its forward"):
        simulate(type(broken)(2, 1, 2, swapped))
    stuck = (tuple(a for a in broken.actions[0] if a.kind == BACKWARD) + tuple(a for a in broken.actions[0]
                                                                             if a.kind == FORWARD),)
    with pytest.raises(RuntimeError, match="before its forward|deadlocks"):
        simulate(type(broken)(2, 1, 2, stuck + (broken.actions[1],)))


@pytest.mark.parametrize("pp, vp, m", [(2, 2, 4), (4, 2, 1), (3, 3, 5)])
def test_forward_only_schedule_runs_each_chunk_in_turn_for_any_count(pp, vp, m):
    schedule = build_schedule(pp, vp, m, forward_only=True)
    for actions in schedule.actions:
        assert [(a.microbatch, a.chunk) for a in actions] == [(mb, c) for c in range(vp) for mb in range(m)]
        assert {a.kind for a in actions} == {FORWARD}
    simulate(schedule)


@pytest.mark.parametrize("pp, vp, m, message", [
    (4, 2, 6, "groups of parallel.pp=4"),
    (2, 3, 3, "multiple of 2"),
    (2, 1, 0, "at least one micro-batch"),
])
def test_bad_microbatch_counts_are_refused(pp, vp, m, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(pp, vp, m)
