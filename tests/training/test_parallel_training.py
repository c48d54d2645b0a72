"""The trainer under TP / SP / DP / the distributed optimizer equals the single-process trainer.

Spawned gloo ranks (``tests.helpers.distributed.run_distributed``) run ``Trainer`` on the tiny
corpus for 5 steps of 4 micro-batches, for a dense, a hybrid Mamba and an MoE model, at the
layouts tp2, dp2, dp2 + distributed optimizer (world 2), tp2 x dp2 with SP, with and without
the distributed optimizer, and tp4 with SP (world 4): each model at two layouts of each world,
each layout with two models (``SAMPLED``). Every step's loss and global gradient
norm, the validation losses and the final full parameters must equal the single-process run
(relative error <= 1e-5). The runs use lr 5e-4 and Adam eps 1e-5: Adam divides each gradient
element by its own running RMS, so the last-bit differences that fp32 summation order leaves in
near-zero gradient elements come out of the update amplified (by up to lr / eps for elements
near eps), and over 5 steps of these tiny models they reached 1.0-1.2e-5 of the largest weight at
lr 1e-3 / eps 1e-8 -- the noise floor, not a layout error (the losses agree to ~1e-7).
Checkpoints written at tp2 x dp2 load with ``load_model`` and resume at other layouts with the losses of the uninterrupted run; layouts that do not fit are
refused before any collective.

(The spawned children cannot use pytest fixtures, so the corpus is written here and the
children get its path.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import load_model
from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.parallel.pipeline.state import gather_pipeline_state_dict
from meshlm.training.metrics import read_metrics
from tests.helpers.counting_corpus import write_corpus as write_tiny_corpus  # the name the trainer tests call it by
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_training import counting_collectives, relative_error

TOLERANCE = 1e-5
MODELS = {
    "dense": ["model.pattern=*-*-", "model.num_kv_heads=2"],
    "hybrid": ["model.pattern=M*-M", "model.mamba_head_dim=8", "model.mamba_state_size=8",
               "model.mamba_num_groups=4", "model.mamba_chunk_size=8"],
    "moe": ["model.pattern=*E*-", "model.moe_num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32",
            "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"],
}
LAYOUTS = {
    2: {"tp2": ["parallel.tp=2"], "dp2": ["parallel.dp=2"],
        "dp2 dist-opt": ["parallel.dp=2", "parallel.distributed_optimizer=true"]},
    4: {"tp2xdp2 sp": ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true"],
        "tp2xdp2 sp dist-opt": ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true",
                                "parallel.distributed_optimizer=true"],
        "tp4 sp": ["parallel.tp=4", "parallel.sp=true"]},  # the dense model's 2 KV heads are replicated
}
SAMPLED = {"dense": {2: ("tp2", "dp2 dist-opt"), 4: ("tp2xdp2 sp dist-opt", "tp4 sp")},
           "hybrid": {2: ("tp2", "dp2"), 4: ("tp2xdp2 sp", "tp4 sp")},
           "moe": {2: ("dp2", "dp2 dist-opt"), 4: ("tp2xdp2 sp", "tp2xdp2 sp dist-opt")}}
"""The layouts each model trains at: two of each world's three, so that every layout runs two of the
three models (a sample of the 18 pairs: on a 2-core machine each pair costs a few seconds)."""
assert all(sorted({name for chosen in SAMPLED.values() for name in chosen[world]}) == sorted(LAYOUTS[world])
           for world in LAYOUTS)
CHECKPOINTED = ("dense", "tp2xdp2 sp dist-opt")
"""The run whose step-3 and step-5 checkpoints the load and resume tests use."""



def run_config(blend: Path, run_dir: Path, *overrides: str):
    """The tiny run every layout trains. ``optim.eps=1e-5``: AdamW turns a gradient element far below
    eps into an update of lr * g / eps, so eps bounds how much an fp32 rounding difference between
    layouts (reduction order) is amplified in the parameters. At 1e-6 one element of the MoE model's
    second attention out-projection reached 1.18e-5 at tp4 (6.3e-6 at tp2) on an AVX-512 host, over
    the 1e-5 tolerance; at 1e-5 every parameter of every layout is within 1.9e-6."""
    base = ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=4", "model.ffn_hidden_size=64",
            "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=5",
            "train.log_every=1", "train.eval_every=5", "train.eval_batches=1", "train.save_every=0",
            "train.keep_checkpoints=5", "train.progress=false", "train.tensorboard=false", "train.plot=false",
            "train.device=cpu", f"train.run_dir={run_dir}", f"data.blend={blend}", "data.split=90,10,0",
            "optim.lr=5e-4", "optim.eps=1e-5", "optim.warmup_steps=2", "train.grad_clip=0.5",
            "parallel.check_collectives=true"]  # every multi-process run compares its ranks' collectives
    return load_run_config(None, [*base, *overrides])


def train_once(blend: Path, run_dir: Path, overrides: list[str]) -> dict:
    """Train (or resume) and return the losses and the full single-process parameters."""
    torch.set_num_threads(1)
    trainer = Trainer(run_config(blend, run_dir, *overrides))
    result = trainer.run()
    state = gather_pipeline_state_dict(trainer.model, trainer.context)  # every stage's, under pp
    grad_norms = None
    if trainer.context.is_logging_rank:  # it wrote metrics.jsonl (closed when run() returned)
        grad_norms = {record["step"]: record["grad_norm"] for record in read_metrics(run_dir / "metrics.jsonl")
                      if "grad_norm" in record and record["step"] in result.losses}
    return {"losses": result.losses, "val_losses": result.val_losses, "grad_norms": grad_norms,
            "params": {name: value.clone() for name, value in state.items()}}


def train_runs(blend: str, root: str, runs: list[tuple[str, list[str]]]) -> dict:
    """In each spawned rank: train every (name, overrides) run in ``root/name``."""
    return {name: train_once(Path(blend), Path(root) / name, overrides) for name, overrides in runs}


def refused_layouts(blend: str, root: str, layouts: list[list[str]]) -> list[tuple[str, dict]]:
    """In each spawned rank: build a Trainer for each bad layout; (its ConfigError, collectives called)."""
    refusals = []
    for number, overrides in enumerate(layouts):
        counts = {}
        with counting_collectives(counts):
            try:
                Trainer(run_config(Path(blend), Path(root) / f"bad{number}", *overrides))
            except ConfigError as error:
                refusals.append((str(error), dict(counts)))
                continue
        refusals.append(("no error", dict(counts)))
    return refusals


def assert_same_run(actual: dict, expected: dict, where: str, param_tolerance: float = TOLERANCE) -> None:
    """Same losses, gradient norms and validation losses (relative error <= TOLERANCE) and the same
    final parameters (<= ``param_tolerance``; a failure names the three furthest tensors)."""
    steps = sorted(expected["losses"])
    assert sorted(actual["losses"]) == steps, where
    assert relative_error([actual["losses"][s] for s in steps], [expected["losses"][s] for s in steps]) <= TOLERANCE, \
        (where, actual["losses"], expected["losses"])
    if actual["grad_norms"] is not None:  # the global norm before clipping: every element counted once
        assert sorted(actual["grad_norms"]) == steps, where
        assert relative_error([actual["grad_norms"][s] for s in steps],
                              [expected["grad_norms"][s] for s in steps]) <= TOLERANCE, where
    checks = sorted(expected["val_losses"])
    assert sorted(actual["val_losses"]) == checks, where
    assert relative_error([actual["val_losses"][s] for s in checks],
                          [expected["val_losses"][s] for s in checks]) <= TOLERANCE, where
    assert set(actual["params"]) == set(expected["params"]), where
    for name, value in expected["params"].items():
        assert actual["params"][name].shape == value.shape, (where, name)
    errors = sorted(((relative_error(actual["params"][name], value), name) for name, value in expected["params"].items()),
                    reverse=True)
    assert not errors or errors[0][0] <= param_tolerance, (where, errors[:3])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Single-process references, then every model at every layout (world 4 first: its checkpoints
    are resumed by the world-2 call and here)."""
    root = tmp_path_factory.mktemp("parallel-training")
    blend = write_tiny_corpus(root / "corpus")
    single = {model: train_once(blend, root / f"single {model}", overrides) for model, overrides in MODELS.items()}
    world4 = [(f"{model} {layout}", [*model_overrides, *LAYOUTS[4][layout], *(
        ["train.save_every=3"] if (model, layout) == CHECKPOINTED else [])])
        for model, model_overrides in MODELS.items() for layout in SAMPLED[model][4]]
    results4 = run_distributed(train_runs, 4, str(blend), str(root), world4, timeout_s=300)
    # resume the tp2 x dp2 run's step-3 checkpoint at dp2 with the distributed optimizer
    saved = root / " ".join(CHECKPOINTED) / "checkpoints"
    resumed_dir = root / "resumed dp2 dist-opt" / "checkpoints"
    shutil.copytree(saved / "step_3", resumed_dir / "step_3")
    world2 = [(f"{model} {layout}", [*model_overrides, *LAYOUTS[2][layout]])
              for model, model_overrides in MODELS.items() for layout in SAMPLED[model][2]]
    world2.append(("resumed dp2 dist-opt", [*MODELS["dense"], *LAYOUTS[2]["dp2 dist-opt"]]))
    results2 = run_distributed(train_runs, 2, str(blend), str(root), world2, timeout_s=300)
    return dict(root=root, blend=blend, single=single, saved=saved, by_rank={2: results2, 4: results4})


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", list(MODELS))
def test_parallel_training_equals_single_process(runs, model, world):
    for layout in SAMPLED[model][world]:
        for rank, results in enumerate(runs["by_rank"][world]):
            assert_same_run(results[f"{model} {layout}"], runs["single"][model], f"{model} {layout} rank {rank}")


def test_only_rank_zero_writes_metrics(runs):
    for world, layouts in SAMPLED["dense"].items():
        for layout in layouts:
            records = read_metrics(runs["root"] / f"dense {layout}" / "metrics.jsonl")
            steps = [record["step"] for record in records if "loss" in record and "event" not in record]
            assert steps == [1, 2, 3, 4, 5], (layout, steps)  # one line per step: no rank wrote twice
            start = next(record for record in records if record.get("event") == "start")
            assert start["world_size"] == world and start["tp"] * start["dp"] == world


def test_checkpoint_from_tp2_dp2_loads_single_process(runs):
    final = runs["saved"] / "step_5"
    model = load_model(final)  # what `meshlm generate` does
    expected = runs["single"]["dense"]["params"]
    state = model.state_dict()
    for name, value in expected.items():
        assert relative_error(state[name], value) <= TOLERANCE, name
    json.loads((final / "config.json").read_text())  # a readable model config beside the shards


def continued(run: dict) -> dict:
    """What a run resumed from its step-3 checkpoint must reproduce: steps 4-5 and the final state."""
    later = {"losses": {step: run["losses"][step] for step in (4, 5)}, "val_losses": {5: run["val_losses"][5]}}
    if run["grad_norms"] is not None:
        later["grad_norms"] = {step: run["grad_norms"][step] for step in (4, 5)}
    return {**run, **later}


def test_checkpoint_from_tp2_dp2_resumes_at_other_layouts(runs, tmp_path):
    single = runs["single"]["dense"]
    # at dp1 (this process): steps 4 and 5 continue the uninterrupted run
    run_dir = tmp_path / "resumed single"
    shutil.copytree(runs["saved"] / "step_3", run_dir / "checkpoints" / "step_3")
    resumed = train_once(runs["blend"], run_dir, MODELS["dense"])
    assert sorted(resumed["losses"]) == [4, 5]
    assert_same_run(resumed, continued(single), "resumed at dp1")
    # at dp2 with the distributed optimizer (spawned in the fixture)
    for rank, results in enumerate(runs["by_rank"][2]):
        assert_same_run(results["resumed dp2 dist-opt"], continued(results["dense dp2 dist-opt"]),
                        f"resumed at dp2 dist-opt rank {rank}")


def test_bad_layouts_are_refused_before_any_collective(runs):
    layouts = [["parallel.tp=3"], ["parallel.tp=4", "model.num_attention_heads=2", "model.pattern=*-"]]
    refusals = run_distributed(refused_layouts, 4, str(runs["blend"]), str(runs["root"]), layouts)
    for rank_refusals in refusals:
        (world_message, world_calls), (heads_message, heads_calls) = rank_refusals
        assert "world of 4 processes is not divisible by tp*pp*cp" in world_message and world_calls == {}
        assert "model.num_attention_heads = 2 is not divisible by parallel.tp=4" in heads_message
        assert heads_calls == {}


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sp=true"],
                                    ["parallel.dp=2", "parallel.distributed_optimizer=true"]],
                         ids=["tp2 sp", "dp2 dist-opt"])
def test_bf16_checkpoint_keeps_the_fp32_masters(tmp_path, layout):
    """bf16 + TP, or + ZeRO-1 (whose fp32 masters are sharded over DP): the fp32 masters and Adam
    moments are saved in single-process coordinates and read back into the shards, so resuming at the same
    layout repeats the uninterrupted run's losses exactly; resuming single-process continues the
    same curve up to bf16 rounding of the layout."""
    blend = write_tiny_corpus(tmp_path / "corpus")
    bf16 = [*MODELS["dense"], "precision.dtype=bf16", "train.eval_every=0", "train.save_every=3"]
    parallel = [*bf16, *layout]
    uninterrupted = run_distributed(train_runs, 2, str(blend), str(tmp_path), [("bf16", parallel)])[0]["bf16"]
    saved = tmp_path / "bf16" / "checkpoints" / "step_3"
    masters = read_global_tensors(saved, ["master/embedding.weight"])
    assert masters["master/embedding.weight"].shape == (64, 32)
    assert masters["master/embedding.weight"].dtype == torch.float32
    for name in ("resumed", "resumed single"):
        shutil.copytree(saved, tmp_path / name / "checkpoints" / "step_3")
    again = run_distributed(train_runs, 2, str(blend), str(tmp_path), [("resumed", parallel)])[0]["resumed"]
    assert again["losses"] == {step: uninterrupted["losses"][step] for step in (4, 5)}
    single = train_once(blend, tmp_path / "resumed single", bf16)
    assert sorted(single["losses"]) == [4, 5]
    assert relative_error([single["losses"][step] for step in (4, 5)],
                          [uninterrupted["losses"][step] for step in (4, 5)]) <= 1e-2
