"""The multi-process harness: results by rank, loud failures, timeouts that never hang."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import DistributedRunError, DistributedTimeout, run_distributed


def describe_rank(scale, offset=0.0):
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(),
            "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
            "threads": torch.get_num_threads(), "value": torch.full((2,), scale * dist.get_rank() + offset),
            "sum_of_ranks": total.item()}


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(3600)  # stands for a rank stuck waiting for rank 1: the harness must kill it


def sleep_forever():
    time.sleep(3600)


def die_without_exception():
    if dist.get_rank() == 0:
        os._exit(3)
    return "fine"


def test_results_come_back_by_rank_with_torchrun_environment():
    results = run_distributed(describe_rank, 3, 2.0, offset=1.0, timeout_s=60)
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, 3)
        assert result["env"] == (str(rank), "3", str(rank))
        assert result["threads"] == 1
        assert torch.equal(result["value"], torch.full((2,), 2.0 * rank + 1.0))
        assert result["sum_of_ranks"] == 0 + 1 + 2
    again = run_distributed(describe_rank, 2, 1.0, timeout_s=60)
    assert [result["pid"] for result in again] == [result["pid"] for result in results[:2]], "workers are reused"
    fresh = run_distributed(describe_rank, 2, 1.0, timeout_s=60, fresh_processes=True)
    assert not {result["pid"] for result in fresh} & {result["pid"] for result in again}


def test_an_exception_on_one_rank_fails_the_call_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(DistributedRunError) as failure:
        run_distributed(fail_on_rank_one, 2, timeout_s=60)
    message = str(failure.value)
    assert "rank 1 raised" in message and "ValueError: rank one is unhappy" in message
    assert "fail_on_rank_one" in message, "the child's traceback is in the message"
    assert "ranks [0] were still running and were killed" in message
    assert time.monotonic() - started < 30, "the waiting rank was killed, not waited for"
    assert [result["rank"] for result in run_distributed(describe_rank, 2, 1.0)] == [0, 1], "next call works"


def test_a_hang_is_killed_at_the_timeout():
    started = time.monotonic()
    with pytest.raises(DistributedTimeout, match=r"ranks \[0, 1\] of 2 were still running"):
        run_distributed(sleep_forever, 2, timeout_s=3)
    assert time.monotonic() - started < 20


def test_a_rank_that_dies_is_reported_by_exit_code():
    with pytest.raises(DistributedRunError, match="rank 0 died with exit code 3"):
        run_distributed(die_without_exception, 2, timeout_s=60)


def test_local_functions_are_refused():
    def local():
        return 1

    with pytest.raises(ValueError, match="top-level function"):
        run_distributed(local, 2)
