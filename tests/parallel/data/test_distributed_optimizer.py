"""The ZeRO-1 distributed optimizer (meshlm/parallel/data/distributed_optimizer.py).

Spawned gloo ranks train a dense, an MoE and a hybrid Mamba/attention/MoE model (tied
embeddings) with the fp32 values and Adam moments sharded over DP: losses, gradient norms and
final parameters equal the plain single-process AdamW run (relative error <= 1e-5) at dp 2 and
4, with several buckets, overlap on and off, and the communication is one reduce-scatter and one
all-gather per bucket per step. Each rank keeps 1/dp of the moments and the ranks' segments tile
every parameter exactly once. The state gathered at dp=2 is the single-process AdamW state
dict, and loads at dp=4 (and into torch AdamW) to continue identically. With the parameter
all-gather left to the next forward, each bucket is waited for inside that forward (timestamps),
in forward order, and training is bitwise the same as with the gather waited for in step().
"""

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from meshlm.config import PrecisionConfig
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.data.data_parallel import build_data_parallel
from meshlm.parallel.data.distributed_optimizer import overlap_gather_with_forward
from meshlm.parallel.mesh import ParallelContext
from meshlm.precision.mixed_precision import MixedPrecision
from tests.helpers.distributed import run_distributed
from tests.helpers.memory import allocation_profile
from tests.helpers.tiny_training import (TrainSpec, build_run, context_from_world, relative_error, result_of,
                                         single_process_result, train_and_count, train_steps)

DENSE = dict(vocab_size=64, hidden_size=32, pattern="*-*-", num_attention_heads=4, ffn_hidden_size=64)
MOE = dict(vocab_size=64, hidden_size=32, pattern="*E*E", num_attention_heads=4, moe_num_experts=4, moe_top_k=2,
           moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
HYBRID_MOE = dict(MOE, pattern="M*E", mamba_head_dim=8, tie_embeddings=True)  # A_log, D, dt_bias: no decay
SMALL_BUCKETS_MB = 0.01  # 2621 fp32 elements: 5-8 buckets for these models
TOLERANCE = 1e-5


def train_sharded(specs: list[TrainSpec]) -> list[dict]:
    """In each spawned rank: train every spec; report results, collectives and the shard layout."""
    results = []
    for spec in specs:
        run, phases = train_and_count(spec, context_from_world())
        optimizer = run.optimizer
        layout = optimizer.reducer.layout
        results.append(dict(result_of(run), phases=phases, buckets=len(layout.buckets), total=layout.total,
                            moment_elements=optimizer.exp_avg.numel() + optimizer.exp_avg_sq.numel(),
                            segments=[(optimizer.reducer.names[s.param], s.start - layout.offsets[s.param],
                                       s.end - layout.offsets[s.param]) for s in optimizer.segments]))
    return results


def check_sharding(results_by_rank: list[dict], dp: int, num_parameters: dict[str, int]) -> None:
    """Moments: 1/dp of the (padded) buffer per rank; segments: every element owned exactly once."""
    total, buckets = results_by_rank[0]["total"], results_by_rank[0]["buckets"]
    assert 0 <= total - sum(num_parameters.values()) < buckets * dp  # padding: < dp per bucket
    covered = {name: torch.zeros(size, dtype=torch.int64) for name, size in num_parameters.items()}
    for result in results_by_rank:
        assert result["moment_elements"] == 2 * total // dp
        for name, start, end in result["segments"]:
            covered[name][start:end] += 1
    for name, count in covered.items():
        assert bool((count == 1).all()), f"{name}: elements owned {count.min()}..{count.max()} times"


# torch 2.13 renamed the single-tensor collectives; plain_collectives calls whichever this torch has.
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def check_communication(results_by_rank: list[dict], spec: TrainSpec, micro_per_rank: int) -> None:
    """Per step: nothing on non-final micro-batches; a reduce-scatter per bucket (during the last
    backward with overlap); one all-reduce for the global norm; an all-gather per bucket."""
    for result in results_by_rank:
        buckets = result["buckets"]
        expected = {("backward", False): {},
                    ("backward", True): {REDUCE_SCATTER: buckets} if spec.overlap else {},
                    ("reduced", True): {"all_reduce": 1} if spec.overlap else
                    {REDUCE_SCATTER: buckets, "all_reduce": 1},
                    ("stepped", True): {ALL_GATHER: buckets}}
        for event, step, micro, counts in result["phases"]:
            assert counts == expected[event, micro == micro_per_rank - 1], (event, step, micro, counts)


@pytest.mark.parametrize("dp", [2, 4])
def test_sharded_training_equals_single_process(dp):
    micro_per_rank = 2
    specs = [TrainSpec(DENSE, micro_batches=dp * micro_per_rank, distributed_optimizer=True,
                       bucket_size_mb=SMALL_BUCKETS_MB, overlap=True),
             TrainSpec(HYBRID_MOE, micro_batches=dp * micro_per_rank, distributed_optimizer=True,
                       bucket_size_mb=SMALL_BUCKETS_MB, overlap=False),
             TrainSpec(MOE, micro_batches=dp * micro_per_rank, distributed_optimizer=True, overlap=True)]
    results = run_distributed(train_sharded, dp, specs)
    assert results[0][0]["buckets"] >= 3 and results[0][2]["buckets"] == 1
    for number, spec in enumerate(specs):
        expected = single_process_result(spec)
        by_rank = [results[rank][number] for rank in range(dp)]
        for rank, result in enumerate(by_rank):
            assert relative_error(result["losses"], expected["losses"]) <= TOLERANCE, (number, rank)
            assert relative_error(result["grad_norms"], expected["grad_norms"]) <= TOLERANCE, (number, rank)
            for name, value in expected["params"].items():
                assert relative_error(result["params"][name], value) <= TOLERANCE, (number, rank, name)
                assert torch.equal(result["params"][name], by_rank[0]["params"][name]), (number, rank, name)
        check_sharding(by_rank, dp, {name: value.numel() for name, value in expected["params"].items()})
        check_communication(by_rank, spec, micro_per_rank)


# --- checkpoints: gather at one DP size, load at another -----------------------------------------------

RESHARD_SPEC = TrainSpec(MOE, micro_batches=8, distributed_optimizer=True, bucket_size_mb=SMALL_BUCKETS_MB)


def train_and_gather_state(spec: TrainSpec, steps: int) -> dict:
    context = context_from_world()
    run = train_steps(build_run(spec, context), spec, context, steps=steps)
    return {"optimizer": run.optimizer.state_dict(), "model": {k: v.clone() for k, v in run.model.state_dict().items()},
            "losses": run.losses}


def load_state_and_continue(spec: TrainSpec, state: dict, first_step: int) -> dict:
    context = context_from_world()
    run = build_run(spec, context)
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    train_steps(run, spec, context, first_step=first_step, steps=spec.steps - first_step)
    return result_of(run)


def test_state_gathered_at_dp2_is_the_single_process_state_and_continues_at_dp4():
    spec, stop = RESHARD_SPEC, 3
    gathered = run_distributed(train_and_gather_state, 2, spec, stop)
    assert all(str(state["optimizer"]) == str(gathered[0]["optimizer"]) for state in gathered)  # every rank, same

    reference = train_steps(build_run(spec, None), spec, None, steps=stop)
    expected = reference.optimizer.state_dict()
    state = gathered[0]["optimizer"]
    assert [{k: v for k, v in group.items()} for group in state["param_groups"]] == expected["param_groups"]
    assert state["state"].keys() == expected["state"].keys() and len(expected["state"]) > 0
    for index, entry in expected["state"].items():
        assert float(state["state"][index]["step"]) == float(entry["step"]) == stop
        for moment in ("exp_avg", "exp_avg_sq"):
            assert relative_error(state["state"][index][moment], entry[moment]) <= TOLERANCE, (index, moment)

    full_run = single_process_result(spec)
    continued = run_distributed(load_state_and_continue, 4, spec, gathered[0], stop)
    for result in continued:
        for name, value in full_run["params"].items():
            assert relative_error(result["params"][name], value) <= TOLERANCE, name
        assert relative_error(result["losses"], full_run["losses"][stop:]) <= TOLERANCE

    # The same file continues a plain single-process run too.
    plain = build_run(spec, None)
    plain.model.load_state_dict(gathered[0]["model"])
    plain.optimizer.load_state_dict(state)
    train_steps(plain, spec, None, first_step=stop, steps=spec.steps - stop)
    for name, value in full_run["params"].items():
        assert relative_error(result_of(plain)["params"][name], value) <= TOLERANCE, name


def test_muon_state_gathered_at_dp2_is_the_single_process_state_and_continues_in_one_process():
    """Distributed Muon (ZeRO-1, small buckets: matrices straddle the ranks' shards): the gathered
    state dict is the single-process Muon's -- Muon's matrices hold ``momentum_buffer`` and no
    step, the rest AdamW's moments and step -- and it continues a single-process run exactly."""
    spec, stop = dataclasses.replace(RESHARD_SPEC, optimizer="muon"), 3
    gathered = run_distributed(train_and_gather_state, 2, spec, stop)
    reference = train_steps(build_run(spec, None), spec, None, steps=stop)
    expected, state = reference.optimizer.state_dict(), gathered[0]["optimizer"]
    assert state["param_groups"] == expected["param_groups"] and expected["param_groups"][0]["name"] == "muon"
    assert state["state"].keys() == expected["state"].keys()
    kinds = set()
    for index, entry in expected["state"].items():
        assert state["state"][index].keys() == entry.keys(), index
        kinds.add(tuple(sorted(entry)))
        for key, value in entry.items():
            assert relative_error(state["state"][index][key], value) <= TOLERANCE, (index, key)
    assert kinds == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}
    plain = build_run(spec, None)
    plain.model.load_state_dict(gathered[0]["model"])
    plain.optimizer.load_state_dict(state)
    train_steps(plain, spec, None, first_step=stop, steps=spec.steps - stop)
    for name, value in single_process_result(spec)["params"].items():
        assert relative_error(result_of(plain)["params"][name], value) <= TOLERANCE, name


def test_single_process_state_loads_into_the_distributed_optimizer_in_one_process():
    spec = TrainSpec(DENSE, distributed_optimizer=True, bucket_size_mb=SMALL_BUCKETS_MB)
    reference = train_steps(build_run(spec, None), spec, None, steps=2)
    run = build_run(spec, ParallelContext())
    assert run.optimizer.state_dict()["state"] == {}
    run.model.load_state_dict(reference.model.state_dict())
    run.optimizer.load_state_dict(reference.optimizer.state_dict())
    assert run.optimizer.step_count == 2
    train_steps(run, spec, ParallelContext(), first_step=2, steps=3)
    expected = single_process_result(spec)
    for name, value in expected["params"].items():
        assert relative_error(result_of(run)["params"][name], value) <= TOLERANCE, name


def test_state_of_another_model_is_refused():
    spec = TrainSpec(DENSE, distributed_optimizer=True)
    other = TrainSpec(dict(DENSE, pattern="*-"), distributed_optimizer=True)
    state = train_steps(build_run(other, None), other, None, steps=1).optimizer.state_dict()
    run = build_run(spec, ParallelContext())
    with pytest.raises(ValueError, match="different model"):
        run.optimizer.load_state_dict(state)


def test_bf16_updates_the_fp32_masters_and_casts_them_into_the_model():
    spec = TrainSpec(DENSE, dtype="bf16", distributed_optimizer=True, bucket_size_mb=SMALL_BUCKETS_MB)
    expected = single_process_result(spec)
    run = train_steps(build_run(spec, ParallelContext()), spec, ParallelContext())
    assert relative_error(run.losses, expected["losses"]) <= TOLERANCE
    masters = run.precision.state_dict()["master_weights"]  # gathered from the optimizer's shards
    for name, param in run.model.named_parameters():
        assert param.dtype == torch.bfloat16 and masters[name].dtype == torch.float32
        assert torch.equal(param, masters[name].to(torch.bfloat16)), name
        assert relative_error(param.float(), expected["params"][name]) <= 1e-2, name  # one bf16 ulp is 4e-3


def train_bf16_sharded(spec: TrainSpec) -> dict:
    """bf16 + ZeRO-1 in a spawned rank: where the fp32 masters live, and a save/load round trip."""
    context = context_from_world()
    run = train_steps(build_run(spec, context), spec, context)
    optimizer = run.optimizer
    state = run.precision.state_dict()  # collective: gathers the fp32 master shards
    fresh = build_run(spec, context)
    fresh.precision.load_state_dict(state)  # each rank keeps its shard and gathers the bf16 model
    return dict(result_of(run), total=optimizer.reducer.layout.total, master_elements=optimizer.values.numel(),
                master_bytes=sum(master.untyped_storage().nbytes() for _, master in run.precision.masters),
                model_in_buffer=all(param.untyped_storage().data_ptr() == optimizer.model_values.data_ptr()
                                    for param in run.model.parameters()),
                masters=state["master_weights"],
                reloaded_model={name: param.detach().clone() for name, param in fresh.model.named_parameters()},
                reloaded_masters=fresh.precision.state_dict()["master_weights"])


def test_bf16_fp32_masters_are_sharded_over_data_parallel_ranks():
    """ZeRO-1 in bf16 keeps 1/dp of the fp32 masters per rank (6 + 12/dp bytes per parameter), the
    all-gathered bf16 model equals the cast masters, and a gathered state reloads exactly."""
    dp = 2
    spec = TrainSpec(DENSE, dtype="bf16", micro_batches=4, distributed_optimizer=True, bucket_size_mb=SMALL_BUCKETS_MB)
    expected = single_process_result(spec)
    results = run_distributed(train_bf16_sharded, dp, spec)
    for rank, result in enumerate(results):
        assert result["master_elements"] == result["total"] // dp, rank
        assert result["master_bytes"] == 4 * len(result["masters"]), rank  # one broadcast element each
        assert result["model_in_buffer"], rank
        assert relative_error(result["losses"], expected["losses"]) <= 1e-3, rank
        for name, master in result["masters"].items():
            assert torch.equal(master, results[0]["masters"][name]), (rank, name)
            assert torch.equal(result["params"][name], master.to(torch.bfloat16).float()), (rank, name)
            assert relative_error(master, expected["params"][name]) <= 1e-2, (rank, name)
            assert torch.equal(result["reloaded_masters"][name], master), (rank, name)
            assert torch.equal(result["reloaded_model"][name], master.to(torch.bfloat16)), (rank, name)


def zero_setup_peak(spec: TrainSpec, sharded_masters: bool) -> dict:
    """In a spawned rank: the peak bytes of MixedPrecision + the distributed optimizer (bf16)."""
    context = context_from_world()
    torch.manual_seed(spec.seed)
    model = LanguageModel(ModelConfig(**spec.model)).train()
    numel = sum(param.numel() for param in model.parameters())
    holder = {}

    def set_up():
        precision = MixedPrecision(model, PrecisionConfig(dtype="bf16"), sharded_masters=sharded_masters)
        holder["parts"] = (precision, *build_data_parallel(precision, spec.optim_config(), spec.parallel_config(),
                                                           context))

    peak, total = allocation_profile(set_up)
    return {"peak": peak, "total": total, "numel": numel}


def test_zero_never_copies_all_fp32_masters():
    """bf16 + ZeRO-1: setting up allocates the model's bf16 buffer, the fp32 gradient buffer and
    this rank's 1/dp of fp32 masters and moments ((2 + 4 + 12 / dp) bytes per parameter) -- never an fp32
    copy of every parameter, which the unsharded masters path does make (4 bytes more) -- and
    holds at most the fp32 model besides."""
    dp = 2
    spec = TrainSpec(dict(DENSE, hidden_size=64, ffn_hidden_size=256), dtype="bf16", distributed_optimizer=True)
    sharded = run_distributed(zero_setup_peak, dp, spec, True)
    copied = run_distributed(zero_setup_peak, dp, spec, False)
    slack = 64 * 1024
    for rank in range(dp):
        numel = sharded[rank]["numel"]
        allocated = numel * (2 + 4 + 12 / dp) + slack
        assert sharded[rank]["total"] <= allocated, (rank, sharded[rank], allocated)
        assert copied[rank]["total"] >= allocated + 4 * numel - 2 * slack, (rank, copied[rank], allocated)
        assert sharded[rank]["peak"] <= allocated + 4 * numel, (rank, sharded[rank])


# --- the parameter all-gather overlapping the next forward ----------------------------------------------

def train_with_gather_overlap(specs: list[TrainSpec]) -> list[dict]:
    """Each spec trained twice on this rank: the all-gathers waited for in step() and left to the
    next forward (``overlap_gather_with_forward``), with when each bucket was waited for."""
    context, results = context_from_world(), []
    for spec in specs:
        plain = result_of(train_steps(build_run(spec, context), spec, context), context)
        run = build_run(spec, context)
        overlap_gather_with_forward(run.model, run.optimizer)
        forwards, block_starts, waits = [], [], []
        run.model.register_forward_pre_hook(lambda module, args: forwards.append([time.perf_counter()]))
        run.model.register_forward_hook(lambda module, args, output: forwards[-1].append(time.perf_counter()))
        run.model.blocks[0].register_forward_pre_hook(lambda module, args: block_starts.append(time.perf_counter()))

        def observe(event, step, micro):
            if event == "reduced":  # the waits for the gathers launched by the previous step
                waits.append(list(run.optimizer.gather_waits))
        train_steps(run, spec, context, observe=observe)
        run.optimizer.wait_for_parameters()  # the last step's gathers: no forward followed (a checkpoint waits too)
        overlapped = result_of(run, context)
        per_rank = spec.micro_batches // context.dp_size
        first_forwards = [forwards[step * per_rank] for step in range(spec.steps)]
        first_blocks = [block_starts[step * per_rank] for step in range(spec.steps)]
        results.append(dict(plain=plain, overlapped=overlapped, waits=waits, first_forwards=first_forwards,
                            first_blocks=first_blocks, buckets=len(run.optimizer.reducer.layout.buckets)))
    return results


def test_parameter_all_gather_is_waited_for_inside_the_next_forward():
    dp = 2
    specs = [TrainSpec(DENSE, micro_batches=4, distributed_optimizer=True, bucket_size_mb=SMALL_BUCKETS_MB, steps=3),
             TrainSpec(HYBRID_MOE, micro_batches=4, distributed_optimizer=True, bucket_size_mb=SMALL_BUCKETS_MB,
                       steps=3, dtype="bf16")]
    results = run_distributed(train_with_gather_overlap, dp, specs)
    for number, spec in enumerate(specs):
        for rank in range(dp):
            result = results[rank][number]
            for key in ("losses", "grad_norms"):  # the same collectives on the same bits: identical
                assert result["overlapped"][key] == result["plain"][key], (number, rank, key)
            for name, value in result["plain"]["params"].items():
                assert torch.equal(result["overlapped"]["params"][name], value), (number, rank, name)
            assert result["buckets"] >= 3
            # Step 0's forward had nothing to wait for; from step 1 on, every bucket gathered after the
            # previous step is waited for inside the first forward, in forward order (the last
            # bucket, holding the embedding, first), some only after block 0 has started computing.
            assert result["waits"][0] == []
            for step in range(1, spec.steps):
                waits, (start, end) = result["waits"][step], result["first_forwards"][step]
                assert sorted(bucket for bucket, _, _ in waits) == list(range(result["buckets"])), (number, step)
                assert [bucket for bucket, _, _ in waits] == sorted((b for b, _, _ in waits), reverse=True)
                assert all(start <= began <= ended <= end for _, began, ended in waits), (number, rank, step)
                assert max(began for _, began, _ in waits) > result["first_blocks"][step], (number, rank, step)
        if spec.dtype == "fp32":
            expected = single_process_result(spec)
            assert relative_error(results[0][number]["overlapped"]["losses"], expected["losses"]) <= TOLERANCE
            for name, value in expected["params"].items():
                assert relative_error(results[0][number]["overlapped"]["params"][name], value) <= TOLERANCE, name
