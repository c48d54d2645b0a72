"""ZeRO stages 2 and 3 (meshlm/parallel/data/fully_sharded.py, sharded_gradients.py, units.py).

A unit is one bucket padded to a multiple of dp, units in backward order. Spawned gloo ranks
train a dense model and a hybrid Mamba/attention/MoE model with a tied embedding at dp 2 with
stage 2 and stage 3 (fp32): losses, gradient norms and parameters equal the single-process run
(relative error <= 1e-5); between steps a rank keeps 1/dp of the gradient and, at stage 3, no
parameter storage at all besides its 1/dp shard. In bf16 and fp16 (loss scaling) stage 3
follows stage 1 to low-precision rounding. The recorded schedule shows the next block's
all-gather launched before the running block is freed, never more than two blocks gathered at
once, and a block's gradients reduced while earlier blocks still run their backward. A parameter used outside its block is refused with
one message instead of losing its gradient.
"""

from __future__ import annotations

import pytest
import torch

from meshlm.parallel.data.units import plan_unit_buckets, unit_of
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_training import (TrainSpec, build_run, context_from_world, relative_error, result_of,
                                         single_process_result, train_steps)

DENSE = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, ffn_hidden_size=64)
HYBRID_MOE_TIED = dict(vocab_size=64, hidden_size=32, pattern="M*E", num_attention_heads=4, moe_num_experts=4,
                       moe_top_k=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                       mamba_head_dim=8, tie_embeddings=True)
TOLERANCE = 1e-5


def test_units_are_blocks_the_embedding_and_the_tail_in_backward_order():
    names = ["embedding.weight", "blocks.0.norm.weight", "blocks.0.mixer.weight", "blocks.1.mixer.weight",
             "final_norm.weight", "mtp.depths.0.projection.weight"]
    units = [unit_of(name) for name in names]
    assert units == ["embedding", "blocks.0", "blocks.0", "blocks.1", "tail", "tail"]
    shapes = [torch.Size(shape) for shape in [(5, 3), (3,), (3, 3), (3, 3), (3,), (3, 6)]]
    layout, bucket_of_unit = plan_unit_buckets(shapes, units, pad_multiple=4)
    assert list(bucket_of_unit) == ["tail", "blocks.1", "blocks.0", "embedding"]  # the order backward finishes them
    assert [len(bucket.params) for bucket in layout.buckets] == [2, 1, 2, 1]
    assert [bucket.size for bucket in layout.buckets] == [24, 12, 12, 16]  # 21, 9, 12, 15 rounded up to 4s
    assert layout.total == sum(bucket.size for bucket in layout.buckets)
    for index, unit in enumerate(units):  # every parameter inside its own unit's bucket
        bucket = layout.buckets[bucket_of_unit[unit]]
        assert bucket.start <= layout.offsets[index] and layout.offsets[index] + shapes[index].numel() <= bucket.end


def train_staged(specs: list[TrainSpec]) -> list[dict]:
    """In each spawned rank: train every spec; report what persists between steps and the schedule."""
    results = []
    for spec in specs:
        context = context_from_world()
        run = build_run(spec, context)
        schedule = run.optimizer.schedule
        schedule.events = []
        observed = {}

        def observe(event, step, micro, run=run, observed=observed):
            if event == "start" and step == 1:
                schedule.events = None  # the first step's schedule is enough
            if event == "stepped":
                observed["parameter_bytes"] = sum(param.untyped_storage().nbytes() for param in run.model.parameters())

        events = schedule.events
        train_steps(run, spec, context, observe=observe)
        optimizer = run.optimizer
        results.append(dict(result_of(run), events=events, parameter_bytes=observed["parameter_bytes"],
                            grad_shard=run.reducer.shard.numel(), total=run.reducer.layout.total,
                            model_shard=getattr(optimizer, "model_shard", torch.empty(0)).numel()))
    return results


@pytest.mark.parametrize("model", [DENSE, HYBRID_MOE_TIED], ids=["dense", "hybrid-moe-tied"])
def test_stages_2_and_3_equal_single_process_at_dp2(model):
    dp = 2
    specs = [TrainSpec(model, zero_stage=stage, steps=4) for stage in (2, 3)]
    expected = single_process_result(specs[0])
    results = run_distributed(train_staged, dp, specs)
    for rank, per_spec in enumerate(results):
        for spec, result in zip(specs, per_spec):
            where = f"stage {spec.zero_stage} rank {rank}"
            assert relative_error(result["losses"], expected["losses"]) <= TOLERANCE, where
            assert relative_error(result["grad_norms"], expected["grad_norms"]) <= TOLERANCE, where
            for name, value in expected["params"].items():
                assert relative_error(result["params"][name], value) <= TOLERANCE, (where, name)
            assert result["grad_shard"] == result["total"] // dp, where  # 1/dp of the gradient persists
            if spec.zero_stage == 3:
                assert result["parameter_bytes"] == 0, where  # no parameter storage between steps
                assert result["model_shard"] == result["total"] // dp, where
            else:
                assert result["parameter_bytes"] > 0, where


def test_stage_3_gathers_ahead_and_reduces_during_backward():
    spec = TrainSpec(DENSE, zero_stage=3, steps=2, micro_batches=2)
    events = run_distributed(train_staged, 2, [spec])[0][0]["events"]
    blocks = [f"blocks.{index}" for index in range(4)]
    forward = events[:events.index(("launch", blocks[-1]))]
    for current, following in zip(blocks, blocks[1:]):  # block i+1's gather is on the wire while block i runs
        assert forward.index(("start_gather", following)) < forward.index(("release", current))
    backward = events[len(forward):]
    # block 3's gradients go out before block 0 is even gathered for its backward; the embedding last
    assert backward.index(("launch", "blocks.3")) < backward.index(("finish_gather", "blocks.0"))
    assert backward.index(("launch", "blocks.0")) < backward.index(("launch", "embedding"))
    assert ("launch", "tail") in backward
    gathered, most = set(), 0  # never more than the running block and the prefetched one
    for operation, unit in events:
        if unit.startswith("blocks."):
            if operation == "start_gather":
                gathered.add(unit)
            elif operation == "release":
                gathered.discard(unit)
            most = max(most, len(gathered))
    assert most == 2, most


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_stage_3_follows_stage_1(dtype):
    specs = [TrainSpec(DENSE, dtype=dtype, zero_stage=stage, steps=4) for stage in (1, 3)]
    specs.append(TrainSpec(DENSE, dtype=dtype, zero_stage=3, steps=4, reduce_grads_in_fp32=False))
    stage1, *others = run_distributed(train_staged_or_sharded, 2, specs)[0]
    for spec, result in zip(specs[1:], others):
        where = f"{dtype} stage 3, gradients in fp32: {spec.reduce_grads_in_fp32}"
        assert relative_error(result["losses"], stage1["losses"]) <= 1e-3, (where, result["losses"], stage1["losses"])
        for name, value in stage1["params"].items():
            assert relative_error(result["params"][name], value) <= 2e-2, (where, name)  # a few bf16/fp16 ulps
        assert result["grad_dtype"] == (torch.float32 if spec.reduce_grads_in_fp32 else result["model_dtype"]), where


def train_staged_or_sharded(specs: list[TrainSpec]) -> list[dict]:
    context = context_from_world()
    results = []
    for spec in specs:
        run = train_steps(build_run(spec, context), spec, context)
        results.append(dict(result_of(run), grad_dtype=run.reducer.buffer.dtype,
                            model_dtype=next(run.model.parameters()).dtype))
    return results


def train_with_a_parameter_used_outside_its_block(spec: TrainSpec) -> str:
    """Block 0's input also depends on a weight of block 1: that gradient is complete only after
    block 0's backward, when block 1's unit was reduced already."""
    context = context_from_world()
    run = build_run(spec, context)
    foreign = next(run.model.blocks[1].parameters())
    run.model.blocks[0].register_forward_pre_hook(lambda module, args: (args[0] + 0.0 * foreign.sum(), *args[1:]))
    try:
        train_steps(run, spec, context, steps=1)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_gradient_arriving_after_its_unit_was_reduced_is_refused():
    messages = run_distributed(train_with_a_parameter_used_outside_its_block, 2, TrainSpec(DENSE, zero_stage=2))
    for message in messages:
        assert "blocks.1" in message and "after the reduce-scatter of its unit" in message, message
