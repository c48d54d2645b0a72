"""parallel.dp_sync: local SGD, DiLoCo and PALSGD (meshlm/parallel/data/low_communication.py).

The algorithm pieces are checked in spawned gloo processes against hand computations (local SGD
with plain SGD at sync_every=1 is DDP; DiLoCo with outer lr 1 and no momentum is local SGD;
the Nesterov outer step is torch's SGD on the global copy; bf16 messages keep the replicas'
global copies identical). The trainer is checked end to end: DiLoCo at tp2 x dp2 equals one
process that runs the two replicas' data one after the other with the same algorithm (also when
the run starts from another model's weights, ``train.init_from``, as bench/local_sgd.py does), the DP
bytes are the outer steps' alone (1/H of DDP's), and a run resumed from a checkpoint saved
between two syncs continues bitwise (DiLoCo and PALSGD).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshlm.checkpoint.model_files import save_model
from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.config import ParallelConfig
from meshlm.errors import ConfigError
from meshlm.models.language_model import LanguageModel
from meshlm.optim.build import build_optimizer
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.comm_log import record_communication
from meshlm.parallel.data.low_communication import LowCommunicationSync, check_dp_sync, uniform_draw
from meshlm.parallel.groups import group_of
from meshlm.parallel.mesh import ParallelContext
from meshlm.parallel.simulated_link import SimulatedLink, parse_link
from meshlm.training.data_loading import build_training_data, read_batch
from meshlm.training.schedules import learning_rate
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_training import relative_error
from tests.helpers.trainer_runs import load_parallel_training_helpers

HELPERS = load_parallel_training_helpers()
DENSE = ["model.pattern=*-*-", "model.num_kv_heads=2"]


# --- settings and pieces that need no process group ---------------------------------------------------------
def test_refusals_name_the_field_and_the_fix():
    base = ParallelConfig(dp_sync="diloco")
    for changes, words in [({"zero_stage": 1}, "zero_stage=0"), ({"ep": 2}, "parallel.ep=1"),
                           ({"dp_sync": "local_sgd", "outer_sync_dtype": "bf16"}, "dp_sync=diloco"),
                           ({"dp_sync": "gossip"}, "parallel.dp_sync"), ({"sync_every": 0}, "sync_every"),
                           ({"palsgd_p": 1.0}, "palsgd_p"), ({"simulate_link": "fast"}, "1Gbps,5ms"),
                           ({"local_warmup": -1}, "local_warmup"),
                           ({"dp_sync": "palsgd", "local_warmup": 4}, "parallel.palsgd_warmup")]:
        with pytest.raises(ConfigError, match=words):
            check_dp_sync(dataclasses.replace(base, **changes))
    check_dp_sync(base)


def test_palsgd_coin_is_fixed_by_seed_replica_and_step():
    draws = [uniform_draw(7, 1, step) for step in range(4000)]
    assert draws == [uniform_draw(7, 1, step) for step in range(4000)]
    assert draws != [uniform_draw(7, 0, step) for step in range(4000)]
    assert all(0 <= draw < 1 for draw in draws)
    assert abs(sum(draw < 0.2 for draw in draws) / len(draws) - 0.2) < 0.03


def test_simulated_link_is_alpha_beta_over_ring_bytes():
    link = parse_link("1Gbps,5ms")
    assert link == SimulatedLink(1e9, 0.005)
    # an all-reduce of 1 MB over 4 ranks sends 2 * 3/4 MB per rank: 12 ms at 1 Gbps, + 5 ms (idle links)
    assert parse_link("1Gbps,5ms").deadline("all_reduce", 10 ** 6, 4, issued=0.0) == pytest.approx(0.012 + 0.005)
    assert parse_link("1Gbps,5ms").deadline("all_gather", 10 ** 6, 2, issued=0.0) == pytest.approx(0.004 + 0.005)
    assert parse_link(None) is None and parse_link("") is None


def test_simulated_link_sends_one_message_at_a_time():
    link = parse_link("1Gbps,5ms")
    # two 1 MB all-reduces over 4 ranks issued together: the second leaves once the first has
    # (12 ms each on the wire), both arrive a latency after leaving
    assert link.deadline("all_reduce", 10 ** 6, 4, issued=100.0) == pytest.approx(100.0 + 0.012 + 0.005)
    assert link.deadline("all_reduce", 10 ** 6, 4, issued=100.0) == pytest.approx(100.0 + 0.024 + 0.005)
    # one issued after the wire has gone idle starts at once
    assert link.deadline("all_gather", 10 ** 6, 2, issued=101.0) == pytest.approx(101.0 + 0.004 + 0.005)


def linked_all_reduces(link_text: str) -> list[float]:
    """In each spawned rank: a synchronous and an asynchronous all-reduce of 1 MB over a group
    carrying the simulated link; seconds each took (the asynchronous one until ``wait()`` returns)."""
    group = dataclasses.replace(group_of(dist.group.WORLD, "dp", torch.device("cpu")), link=parse_link(link_text))
    tensor = torch.ones(250_000)
    start = time.perf_counter()
    all_reduce_(tensor, group)
    synchronous = time.perf_counter() - start
    start = time.perf_counter()
    all_reduce_(tensor, group, async_op=True).wait()
    return [synchronous, time.perf_counter() - start, float(tensor[0])]


def test_collectives_over_a_simulated_link_wait_out_its_delay():
    # 1 MB all-reduce over 2 ranks at 100 Mbps: 1 MB on the wire = 80 ms, + 20 ms latency
    for synchronous, asynchronous, value in run_distributed(linked_all_reduces, 2, "100Mbps,20ms"):
        assert value == 4.0
        assert synchronous >= 0.1 and asynchronous >= 0.1


# --- the algorithm in two processes --------------------------------------------------------------------------
def _sync(mode: str, params, **settings) -> LowCommunicationSync:
    parallel = ParallelConfig(dp_sync=mode, **settings)
    rank = dist.get_rank()
    context = ParallelContext(rank=rank, world_size=2, dp_size=2, dp_rank=rank,
                              dp_group=group_of(dist.group.WORLD, "dp", torch.device("cpu")))
    return LowCommunicationSync(parallel, params, context, seed=0)


def _replica_params(rank: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shared = [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]
    return [(f"p{index}", torch.nn.Parameter(value.clone())) for index, value in enumerate(shared)]


@torch.no_grad()
def algorithm_checks() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    results = {}
    # local SGD, sync_every=1, plain SGD: theta - lr * mean(g) -- DDP's step (where the two coincide:
    # an update linear in the gradient; with AdamW the replicas' moments differ)
    named = _replica_params(rank)
    sync = _sync("local_sgd", named, sync_every=1)
    grads = [torch.randn_like(value) for _, value in named]
    for (_, value), grad in zip(named, grads):
        value.sub_(0.1 * grad)
    sync.outer_step()
    results["local_sgd"] = [value.clone() for _, value in named]
    results["grads"] = grads
    # DiLoCo with outer lr 1 and no momentum equals local SGD; with Nesterov, torch's SGD on the global copy
    for name, settings in [("diloco lr1", {"outer_lr": 1.0, "outer_momentum": 0.0}),
                           ("diloco nesterov", {"outer_lr": 0.7, "outer_momentum": 0.9}),
                           ("diloco bf16", {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_sync_dtype": "bf16"})]:
        named = _replica_params(rank)
        sync = _sync("diloco", named, sync_every=1, **settings)
        trajectory = []
        for round_ in range(3):
            for (_, value), grad in zip(named, grads):
                value.sub_(0.1 * (round_ + 1) * grad + 0.01 * rank)
            trajectory.append([value.clone() for _, value in named])
            sync.outer_step()
        results[name] = [value.clone() for _, value in named]
        results[name + " trajectory"] = trajectory
        results[name + " global"] = sync.global_copy.clone()
    return results


def test_outer_steps_match_hand_computations():
    results = run_distributed(algorithm_checks, 2)
    start = [value.detach() for _, value in _replica_params(0)]
    grads = [results[0]["grads"], results[1]["grads"]]
    for rank in range(2):
        for index, value in enumerate(results[rank]["local_sgd"]):  # DDP: theta - lr * mean(g)
            expected = start[index] - 0.1 * (grads[0][index] + grads[1][index]) / 2
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
        for a, b in zip(results[rank]["diloco lr1"], results[0]["diloco lr1"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # every replica loads the same global copy
    # DiLoCo lr 1, no momentum == the average of the replicas (local SGD), round after round
    global_copy = [value.clone() for value in start]
    for round_ in range(3):
        replicas = [results[rank]["diloco lr1 trajectory"][round_] for rank in range(2)]
        global_copy = [(a + b) / 2 for a, b in zip(*replicas)]
    for value, expected in zip(results[0]["diloco lr1"], global_copy):
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
    # Nesterov: torch.optim.SGD(nesterov) on the global copy with the mean delta as its gradient
    global_copy = [value.clone().requires_grad_(True) for value in start]
    outer = torch.optim.SGD(global_copy, lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(3):
        replicas = [results[rank]["diloco nesterov trajectory"][round_] for rank in range(2)]
        for value, a, b in zip(global_copy, *replicas):
            value.grad = value.detach() - (a + b) / 2
        outer.step()
        for value in global_copy:  # the replicas load it; the next round starts from it
            value.grad = None
    for value, expected in zip(results[0]["diloco nesterov"], global_copy):
        torch.testing.assert_close(value, expected.detach(), rtol=1e-5, atol=1e-6)
    # bf16 messages: the replicas' global copies stay identical, and near the fp32 result
    torch.testing.assert_close(results[0]["diloco bf16 global"], results[1]["diloco bf16 global"], rtol=0, atol=0)
    assert relative_error(results[0]["diloco bf16 global"], results[0]["diloco nesterov global"]) < 1e-2


# --- the trainer ----------------------------------------------------------------------------------------------------
def reference_replicas(blend: Path, run_dir: Path, overrides: list[str], dp: int, mode: str,
                       overlap: bool = False, model_seed: int | None = None, warmup: int = 0) -> dict:
    """One process, the replicas one after the other: each its own model and optimizer on its own
    micro-batches, then every sync_every-th step (and the last) the outer step by hand; with
    ``overlap``, a sync's outer step is applied after the next step, each replica keeping its
    progress since the sync (the last step syncs at once). ``model_seed``: the models' initial
    values (default train.seed's). ``warmup``: the first steps are DDP steps (every replica steps
    with the replicas' mean gradient), the global copy taken after them."""
    config = HELPERS.run_config(blend, run_dir, *overrides)
    train, parallel = config.train, config.parallel
    dataset = build_training_data(config).train
    models = [LanguageModel(config.model, seed=train.seed if model_seed is None else model_seed) for _ in range(dp)]
    optimizers = [build_optimizer(list(model.named_parameters()), config.optim) for model in models]
    global_copy = [param.detach().clone() for param in models[0].parameters()]
    momentum = [torch.zeros_like(value) for value in global_copy]
    per_replica = train.global_batch_size // train.micro_batch_size // dp
    losses, pending = {}, None

    @torch.no_grad()
    def apply_sync(anchors: list[list[torch.Tensor]]) -> None:
        replicas = [list(model.parameters()) for model in models]
        for index, value in enumerate(global_copy):
            mean = sum(anchor[index] for anchor in anchors) / dp
            if mode == "local_sgd":
                value.copy_(mean)
            else:
                delta = value - mean
                momentum[index].mul_(parallel.outer_momentum).add_(delta)
                value.sub_(parallel.outer_lr * (delta + parallel.outer_momentum * momentum[index]))
            for params, anchor in zip(replicas, anchors):
                params[index].copy_(value + (params[index] - anchor[index]))

    for step in range(train.steps):
        lr = learning_rate(step, config.optim, train.steps)
        if step == warmup > 0:
            global_copy = [param.detach().clone() for param in models[0].parameters()]
        totals = []
        for replica, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for index in range(per_replica):
                start = step * train.global_batch_size + (replica * per_replica + index) * train.micro_batch_size
                batch = read_batch(dataset, start, train.micro_batch_size, torch.device("cpu"))
                loss = model(batch["input_ids"], batch["labels"], return_logits=False).loss
                (loss / per_replica).backward()
                total += loss.item()
            totals.append(total)
        if step < warmup:  # a DDP step: every replica gets the mean gradient
            for params in zip(*(model.parameters() for model in models)):
                mean = sum(param.grad for param in params) / dp
                for param in params:
                    param.grad = mean.clone()
        for replica, (model, optimizer) in enumerate(zip(models, optimizers)):
            total = totals[replica]
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), train.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            if replica == 0:
                losses[step + 1] = total / per_replica
        if pending is not None:  # overlap: the sync of the step before
            apply_sync(pending)
            pending = None
        if step >= warmup and ((step + 1 - warmup) % parallel.sync_every == 0 or step + 1 == train.steps):
            anchors = [[param.detach().clone() for param in model.parameters()] for model in models]
            if overlap and step + 1 < train.steps:
                pending = anchors
            else:
                apply_sync(anchors)
    return {"losses": losses, "params": {name: param.detach().clone() for name, param in models[0].named_parameters()}}


def counted_run(blend: str, run_dir: str, overrides: list[str]) -> dict:
    """In each spawned rank: one trainer run, with its bytes over the DP groups counted."""
    torch.set_num_threads(1)
    trainer = HELPERS.Trainer(HELPERS.run_config(Path(blend), Path(run_dir), *overrides))
    context = trainer.context
    with record_communication({"dp": context.dp_group, "dp_cp": context.dp_cp_group}) as log:
        result = trainer.run()
    dp_bytes = sum(count.ring_bytes_sent for (kind, label), count in log.counts.items() if label in ("dp", "dp_cp"))
    state = HELPERS.gather_pipeline_state_dict(trainer.model, context)
    padded = trainer.dp_sync.padded if trainer.dp_sync is not None else trainer.reducer.buffer.numel()
    return {"losses": result.losses, "params": {name: value.clone() for name, value in state.items()},
            "dp_bytes": dp_bytes, "elements": padded}


def trainer_runs(blend: str, root: str, runs: list[tuple[str, list[str]]]) -> dict:
    return {name: counted_run(blend, str(Path(root) / name), overrides) for name, overrides in runs}


DILOCO = ["parallel.dp_sync=diloco", "parallel.sync_every=2", "train.eval_every=0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("low-communication") / "corpus")


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_diloco_at_tp2_dp2_equals_the_replicas_run_one_after_the_other(corpus, tmp_path, optimizer):
    """The inner optimizer is the run's: AdamW, or Muon (its TP shards gathered over each replica's
    own TP group)."""
    overrides = [*DENSE, *DILOCO, f"optim.optimizer={optimizer}"]
    expected = reference_replicas(corpus, tmp_path / "reference", overrides, dp=2, mode="diloco")
    runs = run_distributed(trainer_runs, 4, str(corpus), str(tmp_path),
                           [("tp2xdp2", [*overrides, "parallel.tp=2", "parallel.dp=2", "parallel.sp=true"])])
    for rank, results in enumerate(runs):
        actual = results["tp2xdp2"]
        if rank == 0:  # the logging rank's losses are its replica's (replica 0)
            assert relative_error(list(actual["losses"].values()), list(expected["losses"].values())) <= 1e-5
        for name, value in expected["params"].items():
            assert relative_error(actual["params"][name], value) <= 1e-5, (rank, name)


def test_diloco_from_init_from_starts_replicas_and_global_copy_from_the_folder(corpus, tmp_path):
    """bench/local_sgd.py's protocol: every method continues from one DDP-trained model
    (``train.init_from``). The folder's weights (seed 7) are not the run's own initial values (its
    train.seed), so a replica or a global copy left at the latter would miss the reference."""
    overrides = [*DENSE, *DILOCO, "parallel.outer_lr=0.5", "parallel.outer_momentum=0.5"]
    config = HELPERS.run_config(corpus, tmp_path / "unused", *overrides)
    save_model(LanguageModel(config.model, seed=7), tmp_path / "start")
    expected = reference_replicas(corpus, tmp_path / "reference", overrides, dp=2, mode="diloco", model_seed=7)
    unrelated = reference_replicas(corpus, tmp_path / "own-init", overrides, dp=2, mode="diloco")
    runs = run_distributed(trainer_runs, 2, str(corpus), str(tmp_path),
                           [("continued", [*overrides, "parallel.dp=2", f"train.init_from={tmp_path / 'start'}"])])
    for rank, results in enumerate(runs):
        for name, value in expected["params"].items():
            assert relative_error(results["continued"]["params"][name], value) <= 1e-5, (rank, name)
    assert max(relative_error(unrelated["params"][name], value) for name, value in expected["params"].items()) > 1e-2


@pytest.mark.parametrize("mode", ["diloco", "local_sgd"])
def test_local_warmup_takes_ddp_steps_first(corpus, tmp_path, mode):
    """parallel.local_warmup=2 (post-local SGD): steps 1-2 are DDP steps, then the replicas train
    alone from the agreed model (DiLoCo: the global copy taken then), syncing 2 steps later."""
    overrides = [*DENSE, f"parallel.dp_sync={mode}", "parallel.sync_every=2", "train.eval_every=0",
                 "parallel.local_warmup=2"]
    expected = reference_replicas(corpus, tmp_path / "reference", overrides, dp=2, mode=mode, warmup=2)
    cold = reference_replicas(corpus, tmp_path / "cold", overrides, dp=2, mode=mode)
    runs = run_distributed(trainer_runs, 2, str(corpus), str(tmp_path), [("warm", [*overrides, "parallel.dp=2"])])
    for rank, results in enumerate(runs):
        for name, value in expected["params"].items():
            assert relative_error(results["warm"]["params"][name], value) <= 1e-5, (rank, name)
    assert max(relative_error(cold["params"][name], value) for name, value in expected["params"].items()) > 1e-3


def test_overlapped_diloco_equals_the_one_step_stale_reference(corpus, tmp_path):
    overrides = [*DENSE, *DILOCO, "parallel.outer_overlap=true"]
    expected = reference_replicas(corpus, tmp_path / "reference", overrides, dp=2, mode="diloco", overlap=True)
    plain = reference_replicas(corpus, tmp_path / "plain", overrides, dp=2, mode="diloco")
    runs = run_distributed(trainer_runs, 2, str(corpus), str(tmp_path), [("overlap", [*overrides, "parallel.dp=2"])])
    for rank, results in enumerate(runs):
        for name, value in expected["params"].items():
            assert relative_error(results["overlap"]["params"][name], value) <= 1e-5, (rank, name)
    # the stale sync is a different algorithm: the reference tells them apart
    assert max(relative_error(plain["params"][name], value) for name, value in expected["params"].items()) > 1e-3


def test_local_sgd_and_dp_bytes_are_one_outer_step_per_h(corpus, tmp_path):
    local = [*DENSE, "parallel.dp_sync=local_sgd", "parallel.sync_every=2", "train.eval_every=0"]
    expected = reference_replicas(corpus, tmp_path / "reference", local, dp=2, mode="local_sgd")
    runs = run_distributed(trainer_runs, 2, str(corpus), str(tmp_path),
                           [("ddp", [*DENSE, "parallel.dp=2", "train.eval_every=0"]),
                            ("local", [*local, "parallel.dp=2"]),
                            ("diloco", [*DENSE, *DILOCO, "parallel.dp=2"])])
    for name, value in expected["params"].items():
        assert relative_error(runs[0]["local"]["params"][name], value) <= 1e-5, name
    steps, every, dp = 5, 2, 2
    outer_steps = 3  # after steps 2 and 4, and the last (5)
    ring = 2 * (dp - 1) / dp
    ddp = runs[0]["ddp"]
    # At world 2 the DP group is the world, so a step's few control bytes (the stop-request agreement,
    # the collective checks, DDP's logged losses) are counted with it: at most 64 bytes a step.
    def assert_bytes(run: dict, messages: int, where: str) -> None:
        control = run["dp_bytes"] - messages * ring * 4 * run["elements"]
        assert 0 <= control <= 64 * steps, (where, control)

    assert_bytes(ddp, steps, "ddp")  # one fp32 all-reduce of the gradients a step
    # local SGD: one fp32 all-reduce of the parameters; DiLoCo: reduce-scatter + all-gather, the same bytes
    for name in ("local", "diloco"):
        assert_bytes(runs[0][name], outer_steps, name)
    assert runs[0]["diloco"]["elements"] <= ddp["elements"] + dp  # the same parameters (padded to dp)
    assert runs[0]["diloco"]["dp_bytes"] / ddp["dp_bytes"] == pytest.approx(outer_steps / steps, rel=1e-3)
    assert outer_steps == steps // every + 1  # one per H steps, plus the closing sync


@pytest.mark.parametrize("mode, saved", [(["parallel.dp_sync=diloco", "parallel.outer_sync_dtype=bf16"], 3),
                                         (["parallel.dp_sync=palsgd", "parallel.palsgd_warmup=2",
                                           "parallel.palsgd_p=0.4"], 3),
                                         (["parallel.dp_sync=diloco", "parallel.outer_overlap=true"], 2)],
                         ids=["diloco-bf16", "palsgd", "diloco-overlap-pending"])
def test_resume_between_syncs_is_bitwise(corpus, tmp_path, mode, saved):
    """Saved between two syncs (replicas differ); with overlap, while a sync is still pending.
    (H=2: DiLoCo syncs after steps 2 and 4; PALSGD, after its 2-step warm-up, after step 4.)"""
    overrides = [*DENSE, *mode, "parallel.sync_every=2", "parallel.dp=2", "train.eval_every=0",
                 f"train.save_every={saved}"]
    first = run_distributed(trainer_runs, 2, str(corpus), str(tmp_path), [("whole", overrides)])
    if saved == 3:  # after an inner step: the two replicas' weights differ in the checkpoint
        stored = read_global_tensors(tmp_path / "whole" / "checkpoints" / f"step_{saved}")
        assert any(not stored[f"replica1/{key}"].equal(value) for key, value in stored.items()
                   if key.startswith("model/"))
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / f"step_{saved}",
                    resumed_dir / "checkpoints" / f"step_{saved}")
    second = run_distributed(trainer_runs, 2, str(corpus), str(tmp_path), [("resumed", overrides)])
    later = list(range(saved + 1, 6))
    for rank in range(2):
        whole, resumed = first[rank]["whole"], second[rank]["resumed"]
        assert sorted(resumed["losses"]) == later
        assert [resumed["losses"][step] for step in later] == [whole["losses"][step] for step in later]
        for name, value in whole["params"].items():
            assert torch.equal(resumed["params"][name], value), (rank, name)
