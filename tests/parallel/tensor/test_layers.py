"""Column- and row-parallel linear layers against the full ``nn.Linear``, in real gloo processes.

One spawned world of 4 ranks runs every case: tp 2 (two TP groups side by side, so a layer must
use its rank in the group) and tp 4, sequence parallelism off and on, one partition or several
(Mamba-style [z, x, B, C]), with biases. Every rank builds the same full layer and input from a
seed, computes the single-process reference itself, and compares the parallel layer's output,
input gradient, and weight/bias gradients (shards gathered back to full, partial gradients
summed over the group) to it. The parent asserts the relative errors are <= 1e-5.
"""

import torch
import torch.distributed as dist
from torch import nn

from meshlm.config import ParallelConfig
from meshlm.models.config import ModelConfig
from meshlm.parallel.mesh import build_parallel_context
from meshlm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from meshlm.parallel.tensor.sharding import (gather_full_tensor, partial_grad_names, reduce_partial_tp_grads,
                                             shard_tensor)
from tests.helpers.distributed import run_distributed
from tests.helpers.parallel_checks import seeded

TOLERANCE = 1e-5
BATCH, SEQ, IN, OUT = 2, 8, 24, 32
PARTITIONS = {"one partition": None, "partitions": [8, 16, 8]}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.detach() - expected).abs().max() / expected.abs().max())


def local_shard(full, dim, partitions, context):
    return shard_tensor(full, dim, partitions or [full.shape[dim]], context.tp_rank, context.tp_size)


def sequence_slice(full, context):
    if not context.sequence_parallel:
        return full
    return local_shard(full, 1, None, context)


def reference(full: nn.Linear, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_()
    out = full(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, full.weight.grad, full.bias.grad


def check_column(context, partitions, seed: int) -> dict:
    full = nn.Linear(IN, OUT)
    with torch.no_grad():
        full.weight.copy_(seeded(OUT, IN, seed=seed)), full.bias.copy_(seeded(OUT, seed=seed + 1))
    x, upstream = seeded(BATCH, SEQ, IN, seed=seed + 2), seeded(BATCH, SEQ, OUT, seed=seed + 3)
    layer = ColumnParallelLinear.from_full(full, context, partitions)
    ref_out, ref_x_grad, ref_weight_grad, ref_bias_grad = reference(full, x, upstream)

    local_x = sequence_slice(x, context).clone().requires_grad_()
    out = layer(local_x)  # full sequence, local output features
    (out * local_shard(upstream, 2, partitions, context)).sum().backward()
    assert layer.weight.tensor_parallel and layer.bias.tensor_parallel
    return {
        "output": relative_error(out, local_shard(ref_out, 2, partitions, context)),
        "input grad": relative_error(local_x.grad, sequence_slice(ref_x_grad, context)),
        "weight grad": relative_error(gather_full_tensor(layer.weight, layer.weight.grad, context), ref_weight_grad),
        "bias grad": relative_error(gather_full_tensor(layer.bias, layer.bias.grad, context), ref_bias_grad),
    }


def check_row(context, partitions, seed: int) -> dict:
    full = nn.Linear(OUT, IN)
    with torch.no_grad():
        full.weight.copy_(seeded(IN, OUT, seed=seed)), full.bias.copy_(seeded(IN, seed=seed + 1))
    x, upstream = seeded(BATCH, SEQ, OUT, seed=seed + 2), seeded(BATCH, SEQ, IN, seed=seed + 3)
    layer = RowParallelLinear.from_full(full, context, partitions)
    ref_out, ref_x_grad, ref_weight_grad, ref_bias_grad = reference(full, x, upstream)

    local_x = local_shard(x, 2, partitions, context).clone().requires_grad_()
    out = layer(local_x)  # summed; this rank's sequence slice under SP
    (out * sequence_slice(upstream, context)).sum().backward()
    assert getattr(layer.bias, "tp_partial_grad", False) == context.sequence_parallel
    if partitions is None:
        reduce_partial_tp_grads(layer, context)
    else:  # the by-name form, as used on fp32 master gradients
        named_grads = {name: param.grad for name, param in layer.named_parameters()}
        reduce_partial_tp_grads(named_grads, context, names=partial_grad_names(layer))
    return {
        "output": relative_error(out, sequence_slice(ref_out, context)),
        "input grad": relative_error(local_x.grad, local_shard(ref_x_grad, 2, partitions, context)),
        "weight grad": relative_error(gather_full_tensor(layer.weight, layer.weight.grad, context), ref_weight_grad),
        "bias grad": relative_error(layer.bias.grad, ref_bias_grad),
    }


def run_all_cases() -> dict:
    errors = {}
    for tp in (2, 4):
        for sp in (False, True):
            context = build_parallel_context(ParallelConfig(tp=tp, sp=sp), ModelConfig(), torch.device("cpu"))
            for label, partitions in PARTITIONS.items():
                for kind, check in (("column", check_column), ("row", check_row)):
                    case = f"{kind} tp={tp} sp={sp} {label}"
                    for quantity, error in check(context, partitions, seed=len(errors)).items():
                        errors[f"{case}: {quantity}"] = error
    dist.barrier()
    return errors


def test_column_and_row_parallel_linear_match_full_layer():
    every_rank = run_distributed(run_all_cases, 4)
    for rank, errors in enumerate(every_rank):
        assert len(errors) == 2 * 2 * 2 * 2 * 4
        bad = {case: error for case, error in errors.items() if not error <= TOLERANCE}
        assert not bad, f"rank {rank}: {bad}"


def test_partition_not_divisible_is_refused():
    import pytest

    from meshlm.errors import ConfigError
    from meshlm.parallel.mesh import ParallelContext

    context = ParallelContext(tp_size=4, tp_rank=1)
    with pytest.raises(ConfigError, match="partition of 6 features is not divisible by parallel.tp=4"):
        ColumnParallelLinear.from_full(nn.Linear(8, 14), context, partition_sizes=[8, 6])


def test_shard_and_unshard_are_inverse():
    from meshlm.parallel.tensor.sharding import unshard_tensor

    full = torch.arange(2 * 24).view(2, 24)
    partitions = [8, 12, 4]
    shards = [shard_tensor(full, 1, partitions, rank, 4) for rank in range(4)]
    assert shards[1].tolist()[0] == [2, 3, 11, 12, 13, 21]
    assert torch.equal(unshard_tensor(shards, 1, partitions), full)
