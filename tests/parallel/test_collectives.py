"""The collectives against hand computations, and each backward against its adjoint.

One spawned run per layout computes, on every rank, each collective's forward error against
the result built by hand from every rank's (seeded, hence reproducible) input, and the two
local halves of the dot-product test (DistDL): for random x and y, <F x, y> = <x, F* y>, with
F* y taken by autograd. The parent adds the halves up over the ranks of each group -- or takes
them once for a replicated tensor, which is one vector stored on every rank -- and compares
them in float64 to 1e-10. Layouts: the whole world of 2 and of 4 ranks, and a world of 4 split
into two groups of 2 (so a collective must use its rank *in the group*, not the global rank).
"""

import pytest
import torch
import torch.distributed as dist

from meshlm.parallel.collectives import (all_gather_along, all_reduce_coalesced_, all_to_all_along, copy_to_group,
                                         gather_along, reduce_from_group, reduce_scatter_along, scatter_along)
from meshlm.parallel.groups import group_of
from tests.helpers.distributed import run_distributed

REPLICATED, PER_RANK = "replicated", "per-rank"


def case_list(n: int) -> list[tuple]:
    """(name, function of (x, group), input shape, input space, output space, hand computation of
    the output from the list of every group member's input and the rank in the group)."""
    cat = torch.cat
    return [
        ("copy", copy_to_group, (3, 5), REPLICATED, PER_RANK, lambda xs, r: xs[r]),
        ("reduce", reduce_from_group, (3, 5), PER_RANK, REPLICATED, lambda xs, r: sum(xs)),
        ("all_gather dim 0", lambda x, g: all_gather_along(x, 0, g), (3, 5), PER_RANK, PER_RANK,
         lambda xs, r: cat(xs, 0)),
        ("all_gather dim 1", lambda x, g: all_gather_along(x, 1, g), (2, 3, 5), PER_RANK, PER_RANK,
         lambda xs, r: cat(xs, 1)),
        ("all_gather dim -1", lambda x, g: all_gather_along(x, -1, g), (2, 3, 5), PER_RANK, PER_RANK,
         lambda xs, r: cat(xs, 2)),
        ("reduce_scatter dim 0", lambda x, g: reduce_scatter_along(x, 0, g), (2 * n, 3), PER_RANK, PER_RANK,
         lambda xs, r: sum(xs).chunk(n, 0)[r]),
        ("reduce_scatter dim 1", lambda x, g: reduce_scatter_along(x, 1, g), (2, 3 * n, 5), PER_RANK, PER_RANK,
         lambda xs, r: sum(xs).chunk(n, 1)[r]),
        ("reduce_scatter dim -1", lambda x, g: reduce_scatter_along(x, -1, g), (3, 2, n), PER_RANK, PER_RANK,
         lambda xs, r: sum(xs).chunk(n, 2)[r]),
        ("scatter dim 1", lambda x, g: scatter_along(x, 1, g), (3, 2 * n, 5), REPLICATED, PER_RANK,
         lambda xs, r: xs[r].chunk(n, 1)[r]),
        ("scatter dim 0", lambda x, g: scatter_along(x, 0, g), (n, 7), REPLICATED, PER_RANK,
         lambda xs, r: xs[r].chunk(n, 0)[r]),
        ("gather dim 1", lambda x, g: gather_along(x, 1, g), (2, 3, 5), PER_RANK, REPLICATED,
         lambda xs, r: cat(xs, 1)),
        ("gather dim 0", lambda x, g: gather_along(x, 0, g), (3, 5), PER_RANK, REPLICATED,
         lambda xs, r: cat(xs, 0)),
        ("all_to_all 1->2", lambda x, g: all_to_all_along(x, 1, 2, g), (2, 2 * n, 3), PER_RANK, PER_RANK,
         lambda xs, r: cat([x.chunk(n, 1)[r] for x in xs], 2)),
        ("all_to_all 2->0", lambda x, g: all_to_all_along(x, 2, 0, g), (3, 2, n), PER_RANK, PER_RANK,
         lambda xs, r: cat([x.chunk(n, 2)[r] for x in xs], 0)),
        ("all_to_all 1->1", lambda x, g: all_to_all_along(x, 1, 1, g), (2, 3 * n, 5), PER_RANK, PER_RANK,
         lambda xs, r: cat([x.chunk(n, 1)[r] for x in xs], 1)),
    ]


def seeded(shape, space: str, rank: int, salt: int) -> torch.Tensor:
    """The same values on every rank for a replicated tensor, a different draw per rank otherwise."""
    generator = torch.Generator().manual_seed(1000 * salt + (0 if space == REPLICATED else rank + 1))
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def measure_cases(group_size: int) -> dict:
    """On each rank: per case, the forward error against the hand computation and the local
    halves of the dot-product test. The world is split into groups of `group_size` adjacent ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(list(range(start, start + group_size))) for start in range(0, world, group_size)]
    group = group_of(groups[rank // group_size], "test", torch.device("cpu"))
    members = list(group.ranks)
    group_rank = group.rank
    results = {"members": tuple(members)}
    for salt, (name, collective, shape, in_space, out_space, by_hand) in enumerate(case_list(group_size)):
        x = seeded(shape, in_space, rank, salt).requires_grad_()
        output = collective(x, group)
        every_input = [seeded(shape, in_space, member, salt) for member in members]
        expected = by_hand(every_input, group_rank)
        y = seeded(output.shape, out_space, rank, salt + 500)
        (adjoint_of_y,) = torch.autograd.grad(output, x, y)
        results[name] = {
            "shape": tuple(output.shape), "expected_shape": tuple(expected.shape),
            "forward_error": (output.detach() - expected).abs().max().item() if output.shape == expected.shape
            else float("inf"),
            "output_side": torch.dot(output.detach().flatten(), y.flatten()).item(),
            "input_side": torch.dot(x.detach().flatten(), adjoint_of_y.flatten()).item(),
        }
    return results


@pytest.fixture(scope="module", params=[(2, 2), (4, 4), (4, 2)], ids=["world2", "world4", "world4-pairs"])
def measured(request):
    world_size, group_size = request.param
    return group_size, run_distributed(measure_cases, world_size, group_size, timeout_s=90)


def combine(values: list[float], space: str) -> float:
    """The inner product over the ranks of one group: summed for per-rank tensors, taken once
    (after checking every rank agrees) for a replicated one."""
    if space == PER_RANK:
        return sum(values)
    assert max(values) - min(values) <= 1e-12 * max(1.0, abs(values[0])), f"replicated values differ: {values}"
    return values[0]


@pytest.mark.parametrize("case", [case[0] for case in case_list(2)])
def test_forward_and_adjoint(measured, case):
    group_size, per_rank = measured
    _, _, _, in_space, out_space, _ = next(c for c in case_list(group_size) if c[0] == case)
    for members in sorted({result["members"] for result in per_rank}):
        results = [per_rank[rank][case] for rank in members]
        for rank, result in zip(members, results):
            assert result["shape"] == result["expected_shape"], f"{case} rank {rank}: {result}"
            assert result["forward_error"] <= 1e-12, f"{case} rank {rank}: {result}"
        output_side = combine([result["output_side"] for result in results], out_space)
        input_side = combine([result["input_side"] for result in results], in_space)
        assert abs(output_side - input_side) <= 1e-10 * abs(output_side), (case, output_side, input_side)


def check_coalesced_and_errors() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = group_of(dist.new_group(list(range(world))), "test", torch.device("cpu"))
    shapes_and_dtypes = [((3, 4), torch.float64), ((5,), torch.float32), ((2, 2, 2), torch.float64),
                         ((1,), torch.int64), ((), torch.float32)]

    def values(of_rank):
        return [(torch.arange(max(1, torch.Size(shape).numel())).reshape(shape) * (of_rank + 1) + of_rank)
                .to(dtype) for shape, dtype in shapes_and_dtypes]

    tensors = values(rank)
    storages = [tensor.data_ptr() for tensor in tensors]
    returned = all_reduce_coalesced_(tensors, group)
    expected = [sum(parts) for parts in zip(*[values(other) for other in range(world)])]
    singletons = [dist.new_group([member]) for member in range(world)]
    x = torch.randn(4, 6, requires_grad=True)
    alone = group_of(singletons[rank], "alone", torch.device("cpu"))
    identical = [f(x, alone) is x for f in (
        copy_to_group, reduce_from_group, lambda t, g: all_gather_along(t, 1, g),
        lambda t, g: reduce_scatter_along(t, 1, g), lambda t, g: scatter_along(t, 1, g),
        lambda t, g: gather_along(t, 1, g), lambda t, g: all_to_all_along(t, 0, 1, g))]
    errors = []
    for bad in (lambda: reduce_scatter_along(torch.ones(2, world + 1), 1, group),
                lambda: scatter_along(torch.ones(world * 2 + 1), 0, group),
                lambda: all_to_all_along(torch.ones(3, world + 1), 1, 0, group)):
        try:
            bad()
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
    return {"equal": [torch.equal(a, b) for a, b in zip(tensors, expected)],
            "dtypes_kept": [a.dtype == b.dtype for a, b in zip(tensors, expected)],
            "in_place": returned is tensors and storages == [t.data_ptr() for t in tensors],
            "identical": identical, "errors": errors}


@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_all_reduce_single_rank_groups_and_errors(world_size):
    for rank, result in enumerate(run_distributed(check_coalesced_and_errors, world_size, timeout_s=90)):
        assert all(result["equal"]) and all(result["dtypes_kept"]), (rank, result)
        assert result["in_place"], rank
        assert all(result["identical"]), f"a group of one rank must return the input itself: {result['identical']}"
        for message in result["errors"]:
            assert "not divisible by the group size" in message, message


def test_no_group_is_identity_without_a_process_group():
    x = torch.randn(3, 4, requires_grad=True)
    for output in (copy_to_group(x, None), reduce_from_group(x, None), all_gather_along(x, 1, None),
                   reduce_scatter_along(x, 1, None), scatter_along(x, 0, None), gather_along(x, 0, None),
                   all_to_all_along(x, 0, 1, None)):
        assert output is x
    tensors = [torch.ones(2)]
    assert all_reduce_coalesced_(tensors, None) is tensors and torch.equal(tensors[0], torch.ones(2))
