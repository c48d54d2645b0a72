"""Token dispatchers and the uneven all-to-all, in real gloo processes.

* ``all_to_all_uneven`` (blocking and started/waited) passes the dot-product adjoint test
  <F x, y> = <x, F* y> with random uneven counts, zero-row pieces included.
* Token conservation through dispatch and combine: every rank routes random tokens (some
  assignments dropped, id -1) and the "experts" multiply their rows by (global expert id + 1),
  split over ETP ranks as 1/etp each; with unit weights the combined output must be
  sum over kept assignments of (expert + 1) * token, computed by hand. The rows a rank receives
  must be exactly the kept assignments to its experts (counted over the whole EP group).
* An EP rank whose experts nobody picked receives zero rows, computes on an empty tensor and
  still returns the exact result (no hang): every token goes to experts 0 and 1.
Layouts: world 4 with ep 4; ep 2 x etp 2; ep 2 (two EP groups); both dispatchers.
"""

import torch
import torch.distributed as dist

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.parallel.collectives import all_to_all_uneven, start_all_to_all_uneven
from meshlm.parallel.expert.dispatchers import DISPATCHERS, build_dispatcher
from meshlm.parallel.groups import group_of
from meshlm.parallel.mesh import build_parallel_context
from tests.helpers.distributed import run_distributed

NUM_EXPERTS, TOP_K, TOKENS, WIDTH = 8, 2, 12, 6
LAYOUTS = {"ep4": dict(ep=4, etp=1), "ep2 etp2": dict(ep=2, etp=2), "ep2": dict(ep=2, etp=1)}


def seeded(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def uneven_counts(world: int, seed: int) -> torch.Tensor:
    """counts[i, j]: rows rank i sends to rank j (zeros included), the same table on every rank."""
    counts = torch.randint(0, 4, (world, world), generator=torch.Generator().manual_seed(seed))
    counts[0, :] = 0  # rank 0 sends nothing
    counts[:, world - 1] = 0  # the last rank receives nothing
    return counts


def adjoint_halves(started: bool) -> dict:
    """<F x, y> and <x, F* y> local halves (summed over ranks by the parent), and the forward error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = uneven_counts(world, seed=7 + int(started))
    input_splits, output_splits = counts[rank].tolist(), counts[:, rank].tolist()
    x = seeded(sum(input_splits), 3, seed=rank).requires_grad_()
    everyone = group_of(dist.group.WORLD, "ep", torch.device("cpu"))
    if started:
        output = start_all_to_all_uneven(x, output_splits, input_splits, everyone).wait()
    else:
        output = all_to_all_uneven(x, output_splits, input_splits, everyone)
    every_x = [seeded(int(counts[r].sum()), 3, seed=r) for r in range(world)]
    expected = torch.cat([every_x[r].split(counts[r].tolist())[rank] for r in range(world)])
    y = seeded(*output.shape, seed=100 + rank)
    (output * y).sum().backward()
    return {"forward error": float((output - expected).abs().max()) if output.numel() else 0.0,
            "<Fx,y>": float((output.detach() * y).sum()), "<x,F*y>": float((x.detach() * x.grad).sum())}


def run_adjoint_tests() -> dict:
    return {"blocking": adjoint_halves(False), "started": adjoint_halves(True)}


def test_uneven_all_to_all_forward_and_adjoint():
    every_rank = run_distributed(run_adjoint_tests, 4)
    for kind in ("blocking", "started"):
        assert all(results[kind]["forward error"] == 0.0 for results in every_rank)
        forward = sum(results[kind]["<Fx,y>"] for results in every_rank)
        adjoint = sum(results[kind]["<x,F*y>"] for results in every_rank)
        assert abs(forward - adjoint) <= 1e-10 * max(1.0, abs(forward)), (kind, forward, adjoint)


def routed_tokens(rank: int, all_to_first_two: bool):
    """This rank's tokens [n, w] and expert ids [n, k] (-1: dropped), reproducible from the rank."""
    tokens = seeded(TOKENS, WIDTH, seed=rank)
    generator = torch.Generator().manual_seed(50 + rank)
    if all_to_first_two:
        expert_ids = torch.tensor([[0, 1]]).expand(TOKENS, TOP_K).clone()
    else:
        expert_ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(TOKENS)])
        expert_ids[torch.rand(TOKENS, TOP_K, generator=generator) < 0.2] = -1
    return tokens, expert_ids


def scaling_experts(rows: torch.Tensor, tokens_per_expert: torch.Tensor, first_expert: int, etp: int):
    """Expert e multiplies its rows by (e + 1) / etp: the ETP ranks' partial outputs add up to (e + 1) rows."""
    factors = (torch.arange(tokens_per_expert.numel(), dtype=rows.dtype) + first_expert + 1) / etp
    return rows * factors.repeat_interleave(tokens_per_expert).unsqueeze(-1)


def conservation(layout: dict, dispatcher_name: str, all_to_first_two: bool) -> dict:
    context = build_parallel_context(ParallelConfig(ep=layout["ep"], etp=layout["etp"], moe_dispatcher=dispatcher_name),
                                     ModelConfig(pattern="E", moe_num_experts=NUM_EXPERTS, moe_ffn_hidden_size=8),
                                     torch.device("cpu"))
    dispatcher = build_dispatcher(dispatcher_name, context, NUM_EXPERTS)
    tokens, expert_ids = routed_tokens(dist.get_rank(), all_to_first_two)
    dispatched = dispatcher.dispatch(tokens, expert_ids)
    rows = dispatched.expert_rows()
    output = scaling_experts(rows, dispatched.tokens_per_local_expert, dispatcher.first_local_expert, context.etp_size)
    combined = dispatcher.combine(output, dispatched, torch.ones(TOKENS, TOP_K, dtype=tokens.dtype))
    factors = torch.where(expert_ids >= 0, expert_ids + 1, 0).to(tokens.dtype).sum(1, keepdim=True)
    # the kept assignments routed to this rank's experts, from every rank of its (ep x etp) group
    sources = context.expert_mesh["ep", "etp"].mesh.flatten().tolist()
    mine = range(dispatcher.first_local_expert, dispatcher.first_local_expert + dispatcher.num_local_experts)
    expected_rows = sum(int(sum((routed_tokens(source, all_to_first_two)[1] == e).sum() for e in mine))
                        for source in sources)
    return {"error": float((combined - tokens * factors).abs().max()), "rows": rows.shape[0],
            "expected rows": expected_rows, "ep rank": context.ep_rank}


def run_conservation() -> dict:
    results = {}
    for label, layout in LAYOUTS.items():
        for name in DISPATCHERS:
            for first_two in (False, True):
                results[(label, name, first_two)] = conservation(layout, name, first_two)
    dist.barrier()
    return results


def test_tokens_are_conserved_and_empty_ranks_work():
    every_rank = run_distributed(run_conservation, 4)
    for rank, results in enumerate(every_rank):
        for (label, name, first_two), result in results.items():
            where = (rank, label, name, first_two)
            assert result["error"] <= 1e-12, (where, result)
            assert result["rows"] == result["expected rows"], (where, result)  # exactly the assignments to my experts
            if first_two and result["ep rank"] > 0:
                assert result["rows"] == 0, where  # nobody routes to this rank's experts
    assert len(every_rank[0]) == len(LAYOUTS) * len(DISPATCHERS) * 2
