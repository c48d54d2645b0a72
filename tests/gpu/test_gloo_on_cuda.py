"""meshlm's collectives over a gloo group move CUDA tensors correctly: each one on its own.

The GPU tier runs its multi-process layouts with every rank on the one GPU and gloo as the
backend (tests/gpu/test_layouts.py: NCCL refuses two ranks on one device). gloo handles CUDA
tensors for some operations only, staging them through the host; an operation it does not stage
would hand a device pointer to its TCP transport. So before the layouts, each collective of
``meshlm/parallel/plain_collectives.py`` -- the one module that calls torch.distributed -- runs
alone in two spawned ranks on ``cuda:0`` tensors, and its result must equal the hand-computed
one, on the GPU: all-reduce, all-gather, reduce-scatter, even and uneven all-to-all, a pair of
point-to-point messages each way (the pipeline's), a barrier and an object broadcast. One call
per operation, so a failure names the operation rather than a whole training run. (A CPU dry run
checks the same on gloo's CPU path.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshlm.parallel.groups import group_of
from meshlm.parallel.plain_collectives import (all_gather_into_, all_reduce_, all_to_all_, barrier, broadcast_objects,
                                               reduce_scatter_into_, send_and_receive)
from tests.helpers.distributed import run_distributed


def run_operation(operation: str, device_name: str) -> dict:
    """In each of 2 spawned ranks: ``operation`` over the world group on ``device_name`` tensors."""
    device, rank = torch.device(device_name), dist.get_rank()
    group = group_of(dist.group.WORLD, "world", device)
    values = lambda *numbers: torch.tensor(numbers, dtype=torch.float32, device=device)  # noqa: E731
    if operation == "all_reduce":
        result = values(1, 2, 3) * (rank + 1)
        all_reduce_(result, group)
    elif operation == "all_gather":
        result = torch.empty(4, device=device)
        all_gather_into_(result, values(10 * rank, 10 * rank + 1), group)
    elif operation == "reduce_scatter":
        result = torch.empty(2, device=device)
        reduce_scatter_into_(result, values(1, 2, 3, 4) * (rank + 1), group)
    elif operation == "all_to_all":
        result = torch.empty(4, device=device)
        all_to_all_(result, values(0, 1, 2, 3) + 10 * rank, group)
    elif operation == "all_to_all_uneven":  # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 and 1
        sizes = [[1, 2], [3, 1]]
        source = (torch.arange(sum(sizes[rank]), dtype=torch.float32, device=device) + 10 * rank)[:, None]
        output_splits = [sizes[peer][rank] for peer in range(2)]
        result = torch.empty(sum(output_splits), 1, device=device)
        all_to_all_(result, source, group, output_splits=output_splits, input_splits=sizes[rank])
        result = result[:, 0]
    elif operation == "send_and_receive":  # two messages each way, told apart by tag
        other = 1 - rank
        first, second = torch.empty(3, device=device), torch.empty(2, device=device)
        works = send_and_receive([(values(1, 2, 3) + 10 * rank, other, 0), (values(7, 8) + 10 * rank, other, 1)],
                                 [(first, other, 0), (second, other, 1)], group)
        for work in works:
            work.wait()
        result = torch.cat([first, second])
    elif operation == "barrier":
        barrier(group)
        result = values(rank)
    elif operation == "broadcast_objects":
        objects = broadcast_objects([{"rank": rank}, "from rank %d" % rank], group, source=1)
        result = values(objects[0]["rank"], len(objects[1]))
    else:
        raise ValueError(f"unknown operation {operation!r}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"device": str(result.device), "values": result.cpu().tolist()}


EXPECTED = {  # operation -> the result of [rank 0, rank 1]
    "all_reduce": [[3.0, 6.0, 9.0]] * 2,
    "all_gather": [[0.0, 1.0, 10.0, 11.0]] * 2,
    "reduce_scatter": [[3.0, 6.0], [9.0, 12.0]],
    "all_to_all": [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]],
    "all_to_all_uneven": [[0.0, 10.0, 11.0, 12.0], [1.0, 2.0, 13.0]],
    "send_and_receive": [[11.0, 12.0, 13.0, 17.0, 18.0], [1.0, 2.0, 3.0, 7.0, 8.0]],
    "barrier": [[0.0], [1.0]],
    "broadcast_objects": [[1.0, 11.0]] * 2,
}


@pytest.mark.parametrize("operation", list(EXPECTED))
def test_collective_over_gloo_on_the_device(operation, gpu_device):
    cuda_device = gpu_device.index if gpu_device.type == "cuda" else None
    results = run_distributed(run_operation, 2, operation, str(gpu_device), cuda_device=cuda_device, timeout_s=60)
    assert [result["values"] for result in results] == EXPECTED[operation], (operation, results)
    assert {result["device"] for result in results} == {str(gpu_device)}, results
