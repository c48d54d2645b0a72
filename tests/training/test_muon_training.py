"""Muon (``optim.optimizer=muon``) under every kind of parallelism equals the single-process run.

The trainer trains the tiny dense, hybrid (Mamba-2 + attention, with and without an MTP depth)
and MoE models of the parallel tests with Muon for 5 steps, in one process and at layouts that
cut the matrices Muon orthogonalizes every way it can be cut: column- and row-parallel TP shards
(dense tp2 x dp2 + SP), replicated KV rows (tp4: 2 KV heads), Mamba's in_proj partitioned as
[z, x, B, C, dt] (hybrid tp2 + SP), experts split over EP and cut on their FFN width over ETP
(MoE tp2 x ep2), context parallelism (hybrid cp2) and interleaved pipeline stages with an MTP
depth (tp2 x pp2 x vp2 + SP); and under ZeRO (Distributed Muon: the directions gathered over DP
bucket by bucket): ZeRO-1 at tp2 x dp2 + SP, the hybrid at dp2 and the MoE at dp4 x ep2 (experts
over edp 2), ZeRO-2 for the hybrid at dp2, ZeRO-3 for the dense model at pp2 x dp2 and the MoE at dp2. Each rank gathers the momentum of a cut matrix whole, so every
step's loss and gradient norm, the validation losses and the final parameters must equal the
single-process run's (relative error <= 1e-5). Checkpoints written at tp2 x dp2, with and
without ZeRO-1, resume at other layouts with the uninterrupted run's losses, and one written under AdamW is refused by
a Muon run with the way out.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.config import load_run_config
from meshlm.errors import CheckpointError
from meshlm.models.language_model import LanguageModel
from meshlm.optim.muon import muon_parameter
from meshlm.training.metrics import format_count, read_metrics
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import import_test_file, run_distributed

HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
MODELS = {
    "dense": HELPERS.MODELS["dense"],
    "hybrid": HELPERS.MODELS["hybrid"],
    "moe": [*HELPERS.MODELS["moe"], "model.moe_shared_expert_ffn_hidden_size=32"],
    "hybrid mtp": [*HELPERS.MODELS["hybrid"], "model.mtp_depth=1"],
}
MUON = ["optim.optimizer=muon", "optim.lr=2e-3", "train.save_every=3"]
LAYOUTS = {  # world -> {name: (model, layout)}
    4: {"dense tp2xdp2 sp": ("dense", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true"]),
        "dense tp4 sp": ("dense", ["parallel.tp=4", "parallel.sp=true"]),
        "moe tp2 ep2": ("moe", ["parallel.tp=2", "parallel.ep=2"]),
        "dense tp2xdp2 sp zero1": ("dense", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true",
                                             "parallel.zero_stage=1"]),
        "moe dp4 ep2 zero1": ("moe", ["parallel.ep=2", "parallel.zero_stage=1"]),
        "dense pp2 dp2 zero3": ("dense", ["parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=3"]),
        "hybrid mtp tp2 pp2 vp2 sp": ("hybrid mtp", ["parallel.tp=2", "parallel.pp=2", "parallel.vp=2",
                                                     "parallel.sp=true"])},
    2: {"hybrid tp2 sp": ("hybrid", ["parallel.tp=2", "parallel.sp=true"]),
        "hybrid cp2": ("hybrid", ["parallel.cp=2"]),
        "hybrid dp2 zero1": ("hybrid", ["parallel.dp=2", "parallel.zero_stage=1"]),
        "hybrid dp2 zero2": ("hybrid", ["parallel.dp=2", "parallel.zero_stage=2"]),
        "moe dp2 zero3": ("moe", ["parallel.dp=2", "parallel.zero_stage=3"])},
}
RESUMED = {"dense tp4 sp resumed": ("dense tp2xdp2 sp", ["parallel.tp=4", "parallel.sp=true"]),
           "dense dp2 pp2 resumed": ("dense tp2xdp2 sp", ["parallel.dp=2", "parallel.pp=2"]),
           "dense dp4 zero1 resumed": ("dense tp2xdp2 sp", ["parallel.dp=4", "parallel.zero_stage=1"]),
           "dense tp4 from zero1 resumed": ("dense tp2xdp2 sp zero1", ["parallel.tp=4", "parallel.sp=true"])}
"""Layouts that resume a step-3 checkpoint of the run named first (momentum written whole per TP
shard, or as ZeRO-1 segments)."""


def muon_overrides(model: str) -> list[str]:
    return [*MODELS[model], *MUON]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("muon-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    single = {model: HELPERS.train_once(blend, root / f"single {model}", muon_overrides(model)) for model in MODELS}
    adamw = HELPERS.train_once(blend, root / "adamw dense", [*MODELS["dense"], "train.save_every=3"])
    by_world = {}
    for world, layouts in LAYOUTS.items():
        batch = [(name, [*muon_overrides(model), *layout]) for name, (model, layout) in layouts.items()]
        by_world[world] = run_distributed(HELPERS.train_runs, world, str(blend), str(root), batch, timeout_s=400)
    return dict(root=root, blend=blend, single=single, adamw=adamw, by_world=by_world)


@pytest.mark.parametrize("world,name", [(world, name) for world, layouts in LAYOUTS.items() for name in layouts])
def test_muon_layout_equals_single_process(runs, world, name):
    model = LAYOUTS[world][name][0]
    for rank, results in enumerate(runs["by_world"][world]):
        HELPERS.assert_same_run(results[name], runs["single"][model], f"{name} rank {rank}")


def test_muon_trains_differently_from_adamw_and_keeps_one_momentum_per_matrix(runs):
    """Same model, data and lr schedule: Muon's losses differ from AdamW's after the first step
    (the optimizer really changed), and its checkpoint holds a momentum for exactly the matrices
    ``muon_parameter`` names and AdamW's two moments for everything else."""
    muon, adamw = runs["single"]["dense"], runs["adamw"]
    assert muon["losses"][1] == pytest.approx(adamw["losses"][1], rel=1e-6)  # before any update
    assert all(muon["losses"][step] != adamw["losses"][step] for step in (3, 4, 5))
    saved = runs["root"] / "single moe" / "checkpoints" / "step_3"
    tensors = read_global_tensors(saved)
    with torch.device("meta"):  # the parameters (the router's expert bias is a buffer)
        params = dict(LanguageModel(load_run_config(saved / "run.yaml").model).named_parameters())
    with_momentum = {key.split("/")[1] for key in tensors if key.endswith("/momentum_buffer")}
    with_moments = {key.split("/")[1] for key in tensors if key.endswith("/exp_avg")}
    assert with_momentum == {name for name, value in params.items() if muon_parameter(name, value)}
    assert with_momentum and not with_momentum & with_moments
    assert with_momentum | with_moments == set(params)
    assert any(".experts." in name for name in with_momentum)
    assert "embedding.weight" in with_moments and any(name.endswith("router.weight") for name in with_moments)


def test_muon_checkpoint_resumes_at_other_layouts(runs, tmp_path):
    """The step-3 checkpoints of dense tp2 x dp2 + SP (with and without ZeRO-1) resume at tp4 + SP,
    dp2 x pp2 and dp4 + ZeRO-1: steps 4 and 5 and the final parameters repeat the uninterrupted
    single-process run's (Muon's momentum resharded)."""
    batch = []
    for name, (source, layout) in RESUMED.items():
        shutil.copytree(runs["root"] / source / "checkpoints" / "step_3", tmp_path / name / "checkpoints" / "step_3")
        batch.append((name, [*muon_overrides("dense"), *layout]))
    resumed = run_distributed(HELPERS.train_runs, 4, str(runs["blend"]), str(tmp_path), batch, timeout_s=400)[0]
    expected = runs["single"]["dense"]
    for name in RESUMED:
        assert sorted(resumed[name]["losses"]) == [4, 5], name
        assert HELPERS.relative_error([resumed[name]["losses"][s] for s in (4, 5)],
                                      [expected["losses"][s] for s in (4, 5)]) <= HELPERS.TOLERANCE, name
        for param, value in expected["params"].items():
            assert HELPERS.relative_error(resumed[name]["params"][param], value) <= HELPERS.TOLERANCE, (name, param)


def test_adamw_checkpoint_is_refused_by_a_muon_run_with_the_way_out(runs, tmp_path):
    saved = runs["root"] / "adamw dense" / "checkpoints" / "step_3"
    shutil.copytree(saved, tmp_path / "switched" / "checkpoints" / "step_3")
    with pytest.raises(CheckpointError, match=r"no momentum_buffer .* saved with optim.optimizer=adamw. Resume with "
                                              r"optim.optimizer=adamw, or .* train.init_from"):
        HELPERS.train_once(runs["blend"], tmp_path / "switched", muon_overrides("dense"))


def test_the_start_line_and_metrics_name_the_optimizer(runs, tmp_path):
    trainer = Trainer(HELPERS.run_config(runs["blend"], tmp_path / "start", *muon_overrides("moe")))
    muon = sum(param.numel() for name, param in trainer.model.named_parameters() if muon_parameter(name, param))
    assert trainer.trainable_note() == f" (Muon: {format_count(muon)}, AdamW: the rest)"
    starts = [record for record in read_metrics(runs["root"] / "single moe" / "metrics.jsonl")
              if record.get("event") == "start"]
    assert [record["optimizer"] for record in starts] == ["muon"]
