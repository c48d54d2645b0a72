"""Data parallelism with the bucketed gradient reducer (meshlm/parallel/data/grad_reducer.py).

Spawned gloo ranks train a dense and an MoE model for 5 steps with gradient accumulation and
global-norm clipping; the losses, gradient norms and final parameters must equal the plain
single-process run on the same micro-batches (relative error <= 1e-5), with several buckets,
with overlap on and off. Counting the torch.distributed calls shows that nothing is sent during
the non-final micro-batches, that with overlap every bucket is launched before backward ends,
and that without it all are launched by finish().
"""

import contextlib

import pytest
import torch

from meshlm.parallel.data.grad_reducer import GradientReducer, plan_buckets
from meshlm.parallel.mesh import ParallelContext
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_training import (TrainSpec, build_run, context_from_world, relative_error, result_of,
                                         single_process_result, train_and_count, train_steps)

DENSE = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, ffn_hidden_size=64)
MOE = dict(vocab_size=64, hidden_size=32, pattern="*E*E", num_attention_heads=4, moe_num_experts=4, moe_top_k=2,
           moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
SMALL_BUCKETS_MB = 0.01  # 2621 fp32 elements: 5-8 buckets for these models
TOLERANCE = 1e-5


def train_specs(specs: list[TrainSpec]) -> list[dict]:
    """In each spawned rank: train every spec, recording the collectives of each phase."""
    results = []
    for spec in specs:
        run, phases = train_and_count(spec, context_from_world())
        results.append(dict(result_of(run), phases=phases, buckets=len(run.reducer.layout.buckets)))
    return results


def check_against_single_process(results_by_rank: list[list[dict]], specs: list[TrainSpec]) -> None:
    for number, spec in enumerate(specs):
        expected = single_process_result(spec)
        for rank, results in enumerate(results_by_rank):
            result, where = results[number], f"spec {number} rank {rank}"
            assert relative_error(result["losses"], expected["losses"]) <= TOLERANCE, where
            assert relative_error(result["grad_norms"], expected["grad_norms"]) <= TOLERANCE, where
            for name, value in expected["params"].items():
                assert relative_error(result["params"][name], value) <= TOLERANCE, (where, name)
                assert torch.equal(result["params"][name], results_by_rank[0][number]["params"][name]), \
                    f"DP replicas differ: {where} {name}"


def check_communication(results_by_rank: list[list[dict]], specs: list[TrainSpec], micro_per_rank: int) -> None:
    """Nothing during non-final micro-batches; one all-reduce per bucket per step, launched during
    the last backward with overlap and by finish() without; clipping and the step are local."""
    for number, spec in enumerate(specs):
        for results in results_by_rank:
            buckets = {"all_reduce": results[number]["buckets"]}
            expected = {("backward", True): buckets if spec.overlap else {},
                        ("reduced", True): {} if spec.overlap else buckets,
                        ("backward", False): {}, ("stepped", True): {}}
            for event, step, micro, counts in results[number]["phases"]:
                assert counts == expected[event, micro == micro_per_rank - 1], (number, event, step, micro, counts)


def specs_for(micro_batches: int) -> list[TrainSpec]:
    return [TrainSpec(DENSE, micro_batches=micro_batches, bucket_size_mb=SMALL_BUCKETS_MB, overlap=True),
            TrainSpec(DENSE, micro_batches=micro_batches, bucket_size_mb=SMALL_BUCKETS_MB, overlap=False),
            TrainSpec(MOE, micro_batches=micro_batches, bucket_size_mb=SMALL_BUCKETS_MB, overlap=True),
            TrainSpec(MOE, micro_batches=micro_batches, overlap=False)]  # one 25 MB bucket


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_training_equals_single_process(dp):
    micro_per_rank = 2
    specs = specs_for(micro_batches=dp * micro_per_rank)
    results = run_distributed(train_specs, dp, specs)
    assert results[0][0]["buckets"] >= 3 and results[0][3]["buckets"] == 1
    check_against_single_process(results, specs)
    check_communication(results, specs, micro_per_rank)


# --- single-process pieces ---------------------------------------------------------------------------

def test_buckets_hold_parameters_in_reverse_order_and_close_at_boundaries():
    shapes = [torch.Size([10]), torch.Size([4, 5]), torch.Size([3]), torch.Size([7, 2])]
    layout = plan_buckets(shapes, bucket_elements=15, pad_multiple=4)
    # 14 elements < 15: the bucket goes on to the next parameter, closes at 17, pads to 20
    assert [bucket.params for bucket in layout.buckets] == [(3, 2), (1,), (0,)]
    assert [(bucket.start, bucket.end) for bucket in layout.buckets] == [(0, 20), (20, 40), (40, 52)]
    assert layout.offsets == (40, 20, 14, 0) and layout.total == 52
    assert layout.buckets[1].shard(1, 4) == (25, 30)


def test_gradients_are_views_into_the_buffer_and_accumulate_there():
    spec = TrainSpec(DENSE, bucket_size_mb=SMALL_BUCKETS_MB)
    run = build_run(spec, ParallelContext())
    reducer = run.reducer
    train_steps(run, spec, ParallelContext(), steps=1)  # the optimizer's zero_grad(set_to_none) ran
    input_ids = torch.randint(0, 64, (2, 16))

    def accumulated(backward_passes: int) -> list[torch.Tensor]:
        reducer.zero_grad()
        for number in range(backward_passes):
            with reducer.no_sync() if number < backward_passes - 1 else contextlib.nullcontext():
                run.model(input_ids, input_ids).loss.backward()
        reducer.finish()
        for (name, param), view in zip(run.model.named_parameters(), reducer.grad_views):
            assert param.grad.data_ptr() == view.data_ptr(), name
        return [param.grad.clone() for param in run.model.parameters()]

    once, twice = accumulated(1), accumulated(2)
    for one, two in zip(once, twice):
        torch.testing.assert_close(two, 2 * one)
    assert any(grad.abs().max() > 0 for grad in once)


def test_backward_after_finish_without_zero_grad_is_refused():
    spec = TrainSpec(DENSE)
    run = build_run(spec, ParallelContext())
    input_ids = torch.randint(0, 64, (2, 16))
    run.model(input_ids, input_ids).loss.backward()
    run.reducer.finish()
    with pytest.raises(RuntimeError, match="zero_grad"):
        run.model(input_ids, input_ids).loss.backward()


def test_a_second_synchronizing_backward_is_refused():
    """Without no_sync() the first backward launches every bucket; accumulating into them again
    would race with (or come after) their reduction."""
    run = build_run(TrainSpec(DENSE, overlap=True), ParallelContext())
    input_ids = torch.randint(0, 64, (2, 16))
    run.model(input_ids, input_ids).loss.backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        run.model(input_ids, input_ids).loss.backward()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_gradients_reach_the_fp32_buffer_through_mixed_precision(dtype):
    spec = TrainSpec(DENSE, dtype=dtype, bucket_size_mb=SMALL_BUCKETS_MB)
    expected = single_process_result(spec)
    run = train_steps(build_run(spec, ParallelContext()), spec, ParallelContext())
    assert run.reducer.buffer.dtype == torch.float32
    assert run.precision.loss_scale == (65536.0 if dtype == "fp16" else 1.0)  # fp16 grads were scaled, then unscaled
    assert relative_error(run.losses, expected["losses"]) <= TOLERANCE
    assert relative_error(run.grad_norms, expected["grad_norms"]) <= TOLERANCE
    for name, value in result_of(run)["params"].items():
        assert relative_error(value, expected["params"][name]) <= 1e-2, name  # one bf16 ulp is 4e-3


def test_reducer_built_before_the_gradient_mover_is_refused():
    model = torch.nn.Linear(4, 4)
    masters = [(name, torch.nn.Parameter(param.detach().clone())) for name, param in model.named_parameters()]
    GradientReducer(masters, ParallelContext(), model_parameters=list(model.parameters()))
    with pytest.raises(RuntimeError, match="after MixedPrecision"):
        model(torch.ones(2, 4)).sum().backward()


# --- beside tensor parallelism ---------------------------------------------------------------------------

def train_with_tensor_parallelism(specs: list[TrainSpec]) -> list[dict]:
    results = []
    for spec in specs:
        context = context_from_world(spec)
        results.append(result_of(train_steps(build_run(spec, context), spec, context), context))
    return results


def test_data_parallel_beside_tensor_parallelism():
    """tp=2 x dp=2: TP-sharded, vocabulary-padded and SP-partial gradients go through the buckets,
    the partial sums over TP and the global norm. (lr 2e-4: TP changes fp32 summation orders inside
    the matmuls, and Adam's m/sqrt(v) amplifies that noise on near-zero gradients by about lr.)"""
    specs = [TrainSpec(dict(DENSE, vocab_size=63), tp=2, sp=True, distributed_optimizer=True, lr=2e-4,
                       bucket_size_mb=SMALL_BUCKETS_MB / 2),
             TrainSpec(MOE, tp=2, sp=False, distributed_optimizer=False, lr=2e-4, bucket_size_mb=SMALL_BUCKETS_MB / 2)]
    results = run_distributed(train_with_tensor_parallelism, 4, specs)
    for number, spec in enumerate(specs):
        expected = single_process_result(spec)
        for rank, result in enumerate(results):
            assert relative_error(result[number]["losses"], expected["losses"]) <= TOLERANCE, (number, rank)
            assert relative_error(result[number]["grad_norms"], expected["grad_norms"]) <= TOLERANCE, (number, rank)
            for name, value in expected["params"].items():
                assert relative_error(result[number]["params"][name], value) <= TOLERANCE, (number, rank, name)
