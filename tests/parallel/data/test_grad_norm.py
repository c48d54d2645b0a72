"""Global gradient norm and clipping across TP, DP and CP (meshlm/parallel/data/grad_norm.py).

A synthetic model of four gradients -- two TP-sharded ("shard.*", in a fake set of tensor-parallel
names) and two replicated over TP -- is spread over a world of 4 as tp=2 x dp=2, tp=2 x cp=2 or
dp=2 x cp=2 (the real device mesh): without the distributed optimizer each DP/CP rank holds the
same TP-local gradients; with it, each rank of the dp_cp group holds a different part of them.
Either way every rank must compute the norm of the full gradient (each element counted once)
and clip its pieces exactly as torch clips the full tensors; a non-finite element on one rank
makes every rank report a non-finite norm.
"""

import math

import pytest
import torch

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.parallel.data.grad_norm import clip_grad_norm_across, clip_grads_, global_grad_norm
from meshlm.parallel.mesh import ParallelContext, build_parallel_context
from tests.helpers.distributed import run_distributed

SHAPES = {"shard.weight": (8, 6), "shard.bias": (8,), "norm.weight": (8,), "router.weight": (4, 6)}
TENSOR_PARALLEL_NAMES = {"shard.weight", "shard.bias"}


def full_gradients(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def local_piece(name: str, full: torch.Tensor, context, sharded_by_dp: bool) -> torch.Tensor:
    """This rank's part: a row block of TP shards (whole replicated tensors), then with
    ``sharded_by_dp`` this dp_cp rank's contiguous share of that."""
    if name in TENSOR_PARALLEL_NAMES:
        rows = full.shape[0] // context.tp_size
        full = full[context.tp_rank * rows:(context.tp_rank + 1) * rows]
    flat = full.reshape(-1)
    if sharded_by_dp:
        length = flat.numel() // context.dp_cp_size
        flat = flat[context.dp_cp_rank * length:(context.dp_cp_rank + 1) * length]
    return flat.clone()


LAYOUTS = {"tp2 dp2": dict(tp=2), "tp2 cp2": dict(tp=2, cp=2), "dp2 cp2": dict(cp=2)}


def norms_and_clipping(sharded_by_dp: bool, layout: dict) -> dict:
    context = build_parallel_context(ParallelConfig(**layout), ModelConfig(), torch.device("cpu"))
    full = full_gradients()
    expected_norm = torch.nn.utils.get_total_norm(list(full.values()))
    named = [(name, local_piece(name, tensor, context, sharded_by_dp)) for name, tensor in full.items()]
    norm = clip_grads_(named, float(expected_norm) / 2, context, sharded_by_dp, TENSOR_PARALLEL_NAMES)
    reference = [torch.nn.Parameter(t.clone()) for t in full.values()]
    for parameter in reference:
        parameter.grad = parameter.detach().clone()
    torch.nn.utils.clip_grad_norm_(reference, float(expected_norm) / 2)
    clipped = dict(zip(full, (parameter.grad for parameter in reference)))
    piece_errors = [float((piece - local_piece(name, clipped[name], context, sharded_by_dp)).abs().max())
                    for name, piece in named]

    poisoned = [(name, local_piece(name, tensor, context, sharded_by_dp)) for name, tensor in full.items()]
    # An inf in a TP shard of one rank (of every dp_cp replica, unless dp_cp shards the gradient).
    if context.tp_rank == context.tp_size - 1 and (context.dp_cp_rank == 1 or not sharded_by_dp):
        poisoned[0][1][0] = float("inf")
    before = [piece.clone() for _, piece in poisoned]
    nonfinite = clip_grads_(poisoned, 1.0, context, sharded_by_dp, TENSOR_PARALLEL_NAMES)
    untouched = all(torch.equal(a, b) for a, b in zip(before, [piece for _, piece in poisoned]))
    return {"norm": float(norm), "expected": float(expected_norm), "piece_errors": piece_errors,
            "nonfinite": float(nonfinite), "untouched": untouched}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("sharded_by_dp", [False, True])
def test_every_element_counts_once_across_tp_dp_and_cp(sharded_by_dp, layout):
    results = run_distributed(norms_and_clipping, 4, sharded_by_dp, LAYOUTS[layout])
    for rank, result in enumerate(results):
        assert math.isclose(result["norm"], result["expected"], rel_tol=1e-6), rank
        assert max(result["piece_errors"]) <= 1e-6 * result["expected"], rank
        assert not math.isfinite(result["nonfinite"]) and result["untouched"], rank


# --- one process ---------------------------------------------------------------------------------------

def parameters_with_gradients() -> list[tuple[str, torch.nn.Parameter]]:
    named = []
    for name, grad in full_gradients(seed=1).items():
        parameter = torch.nn.Parameter(torch.zeros_like(grad))
        parameter.grad = grad
        named.append((name, parameter))
    return named


def test_one_process_matches_torch_clip_grad_norm():
    ours, theirs = parameters_with_gradients(), parameters_with_gradients()
    expected = torch.nn.utils.clip_grad_norm_([p for _, p in theirs], 1.0)
    norm = clip_grad_norm_across(ours, 1.0, ParallelContext(), sharded_by_dp=False)
    torch.testing.assert_close(norm, expected)
    assert float(norm) > 1.0  # so the clipping did something
    for (name, mine), (_, reference) in zip(ours, theirs):
        torch.testing.assert_close(mine.grad, reference.grad, msg=name)


def test_zero_max_norm_only_measures():
    named = parameters_with_gradients()
    before = [p.grad.clone() for _, p in named]
    norm = clip_grad_norm_across(named, 0.0, ParallelContext(), sharded_by_dp=False)
    assert float(norm) > 0
    assert all(torch.equal(p.grad, b) for (_, p), b in zip(named, before))


def test_tensor_parallel_names_are_required_with_tp():
    named = [(name, p.grad) for name, p in parameters_with_gradients()]
    with pytest.raises(ValueError, match="tensor_parallel_names"):
        global_grad_norm(named, ParallelContext(tp_size=2), sharded_by_dp=False)
