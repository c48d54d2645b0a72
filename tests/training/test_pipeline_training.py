"""The trainer under pipeline parallelism equals the single-process trainer.

Spawned gloo ranks run ``Trainer`` for 5 steps of 4 micro-batches on the tiny corpus, for a
dense model with a tied embedding (the head on the last stage uses a copy of the first stage's
embedding) and a hybrid Mamba model, each with 8 blocks, at pp2 and pp4 with vp 1 (1F1B) and 2
(interleaved); at pp2 x tp2 with sequence parallelism and pp2 x vp2 x dp2 with the distributed
optimizer and full recomputation; with multi-token prediction at pp2 x vp2 x cp2 (the MTP depth on the last stage,
its loss shared over CP); and an MoE model at pp2 x vp2 x ep2 with the distributed optimizer.
Every step's loss and global gradient norm, the validation losses (a forward-only schedule)
and the final parameters must equal the single-process run (relative error <= 1e-5), on every
rank. A checkpoint written at pp4 x vp2 (each stage writes its own
parameters by name) resumes at pp2 x vp2 and in one process with the uninterrupted run's
losses. Layouts the pipeline cannot run are refused before any collective. (The run helpers
are those of tests/training/test_parallel_training.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshlm.training.metrics import read_metrics
from tests.helpers.distributed import import_test_file, run_distributed


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""
MODELS = {
    "dense tied": ["model.pattern=*-*-*-*-", "model.num_kv_heads=2", "model.tie_embeddings=true"],
    "hybrid": ["model.pattern=M*-MM*-M", "model.mamba_head_dim=8", "model.mamba_state_size=8",
               "model.mamba_num_groups=4", "model.mamba_chunk_size=8"],
}
LAYOUTS = {
    2: {"pp2": ["parallel.pp=2"], "pp2 vp2": ["parallel.pp=2", "parallel.vp=2"]},
    4: {"pp4": ["parallel.pp=4"], "pp4 vp2": ["parallel.pp=4", "parallel.vp=2"]},
}
EXTRA = {"dense mtp": [*HELPERS.MODELS["dense"], "model.mtp_depth=1"], "moe": HELPERS.MODELS["moe"]}
"""Multi-token prediction on the last stage: it embeds future tokens with its copy of the (untied)
embedding (the 4-block model of the CP tests: with a tied embedding, cp2 alone already ends
1.7e-4 apart from one process, pipeline or not); MoE blocks with auxiliary and z losses on the
first stage, experts over ep = dp = 2."""
MIXED = {  # world 4: name -> (model, layout)
    "dense tied pp2 tp2 sp": ("dense tied", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"]),
    "hybrid pp2 vp2 dp2 dist-opt recompute": ("hybrid", ["parallel.pp=2", "parallel.vp=2", "parallel.dp=2",
                                                         "parallel.distributed_optimizer=true",
                                                         "train.recompute=full"]),
    "dense mtp pp2 vp2 cp2": ("dense mtp", ["parallel.pp=2", "parallel.vp=2", "parallel.cp=2"]),
    "moe pp2 vp2 ep2 dist-opt": ("moe", ["parallel.pp=2", "parallel.vp=2", "parallel.ep=2",
                                         "parallel.distributed_optimizer=true"]),
}


SAVED = "hybrid pp4 vp2"
"""The run whose step-3 checkpoint is resumed at pp2 x vp2 and in one process."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Single-process references, then every layout (world 4 first: its checkpoint is resumed by
    the world-2 call)."""
    root = tmp_path_factory.mktemp("pipeline-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    single = {model: HELPERS.train_once(blend, root / f"single {model}", overrides)
              for model, overrides in {**MODELS, **EXTRA}.items()}
    by_world = {}
    for world in (4, 2):
        batch = [(f"{model} {layout}", [*MODELS[model], *overrides, *(
            ["train.save_every=3"] if f"{model} {layout}" == SAVED else [])])
            for model in MODELS for layout, overrides in LAYOUTS[world].items()]
        if world == 4:
            batch += [(name, [*{**MODELS, **EXTRA}[model], *overrides])
                      for name, (model, overrides) in MIXED.items()]
        else:
            saved = root / SAVED / "checkpoints" / "step_3"
            shutil.copytree(saved, root / "resumed pp2 vp2" / "checkpoints" / "step_3")
            batch.append(("resumed pp2 vp2", [*MODELS["hybrid"], *LAYOUTS[2]["pp2 vp2"]]))
        by_world[world] = run_distributed(HELPERS.train_runs, world, str(blend), str(root), batch, timeout_s=300)
    return dict(root=root, blend=blend, single=single, by_world=by_world)


@pytest.mark.parametrize("world", sorted(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_pipeline_training_equals_single_process(runs, model, world):
    for layout in LAYOUTS[world]:
        for rank, results in enumerate(runs["by_world"][world]):
            HELPERS.assert_same_run(results[f"{model} {layout}"], runs["single"][model],
                                    f"{model} {layout} rank {rank}")


@pytest.mark.parametrize("name", list(MIXED))
def test_pipeline_composes_with_tensor_and_data_parallelism(runs, name):
    model = MIXED[name][0]
    for rank, results in enumerate(runs["by_world"][4]):
        HELPERS.assert_same_run(results[name], runs["single"][model], f"{name} rank {rank}")


def test_start_record_names_the_pipeline_layout(runs):
    records = read_metrics(runs["root"] / "hybrid pp4 vp2" / "metrics.jsonl")
    start = next(record for record in records if record.get("event") == "start")
    assert (start["pp"], start["vp"], start["world_size"]) == (4, 2, 4)
    steps = [record["step"] for record in records if "loss" in record and "event" not in record]
    assert steps == [1, 2, 3, 4, 5]  # rank 0 (a first stage) logged every step once


def test_layouts_the_pipeline_cannot_run_are_refused_before_any_collective(runs):
    layouts = [["parallel.pp=2", "parallel.vp=2", "train.global_batch_size=12"],  # dp2: 3 micro-batches each
               ["parallel.pp=4", "parallel.vp=2", "model.pattern=*-*-"],  # 4 blocks for 8 stages
               ["parallel.pp=2", "model.pattern=*-|*-|*-"]]  # 3 marked stages for pp 2
    refusals = run_distributed(HELPERS.refused_layouts, 4, str(runs["blend"]), str(runs["root"]), layouts)
    for rank_refusals in refusals:
        (groups, groups_calls), (blocks, blocks_calls), (marks, marks_calls) = rank_refusals
        assert "in groups of parallel.pp=2" in groups and "has 3 per step" in groups, groups
        assert "4 blocks, fewer than the parallel.pp * parallel.vp = 8" in blocks, blocks
        assert "marks 3 pipeline stages" in marks, marks
        assert groups_calls == blocks_calls == marks_calls == {}


def test_checkpoint_saved_at_pp4_vp2_resumes_at_pp2_vp2_and_in_one_process(runs, tmp_path):
    expected = HELPERS.continued(runs["single"]["hybrid"])  # steps 4 and 5 of the uninterrupted run
    for rank, results in enumerate(runs["by_world"][2]):
        HELPERS.assert_same_run(results["resumed pp2 vp2"], expected, f"resumed at pp2 vp2 rank {rank}")
    run_dir = tmp_path / "resumed single"
    shutil.copytree(runs["root"] / SAVED / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
    resumed = HELPERS.train_once(runs["blend"], run_dir, MODELS["hybrid"])
    assert sorted(resumed["losses"]) == [4, 5]
    HELPERS.assert_same_run(resumed, expected, "resumed in one process")
