"""The trainer with ZeRO stages 2 and 3 (``parallel.zero_stage``) equals the single-process trainer.

Spawned gloo ranks run ``Trainer`` for 5 steps of 4 micro-batches on the tiny corpus with
``parallel.check_collectives`` on: a dense, a hybrid Mamba and an MoE model at dp2 with stage 2 and
stage 3 (world 2), and at world 4: dp4, tp2 x dp2 with sequence parallelism, pp2 x dp2 (a tied
embedding: the last stage's copy is summed with the first stage's on their reduced shards) cp2 x dp2
(dense weights sharded over the DP and CP ranks together), and, for the MoE model, ep2 x edp2
(experts sharded over edp, dense weights over dp) and the hybrid at pp2 x vp2 x dp2 with full
recomputation (a block's forward rerun inside its backward, gathered); a GPT-2-style model (learned
positions: their table shares the embedding's unit; a parallel residual) at tp2 x dp2 with SP and
stage 3, and at dp2 with stage 1 whose all-gathers overlap the forward; a model whose MLP blocks
apply the norm of the attention block beside them (``model.parallel_residual_shared_norm``) at dp2
with stage 2. Every step's loss and global gradient norm, the validation losses and the final
parameters must equal the single-process run (relative error <= 1e-5) on every rank. A stage-3
checkpoint written at dp4 resumes at stage 1 (dp2) and at tp2 with stage 3, with the uninterrupted
run's losses. (The run helpers are those of tests/training/test_parallel_training.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.distributed import import_test_file, run_distributed


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""
MODELS = {**HELPERS.MODELS,
          "dense tied": ["model.pattern=*-*-*-*-", "model.num_kv_heads=2", "model.tie_embeddings=true"],
          # learned positions: their table is part of the embedding's unit (gathered before the lookup);
          # attention beside the MLP (a parallel residual: the MLP block reads the attention block's input);
          # a QK LayerNorm with a weight per head (split with the heads under TP; no bias: without RoPE a
          # key bias moves all of a query's scores alike, its gradient is rounding noise that Adam amplifies)
          "gpt2-style": ["model.pattern=*-*-", "model.position_embedding=learned", "model.max_position_embeddings=32",
                         "model.norm=layernorm", "model.attention_bias=true", "model.mlp_bias=true",
                         "model.mlp_activation=gelu_tanh", "model.qk_norm=true", "model.qk_norm_type=layernorm",
                         "model.qk_norm_per_head=true", "model.tie_embeddings=true",
                         "model.parallel_residual=true"],
          # one norm per pair, the attention block's, which the MLP block beside it applies too
          "shared norm": ["model.pattern=*-*-", "model.norm=layernorm", "model.parallel_residual=true",
                          "model.parallel_residual_shared_norm=true", "model.rope_fraction=0.5"]}
Z2, Z3 = "parallel.zero_stage=2", "parallel.zero_stage=3"
WORLD2 = {"dp2 zero2": ["parallel.dp=2", Z2], "dp2 zero3": ["parallel.dp=2", Z3]}
WORLD2_MODELS = ("dense", "hybrid", "moe")
WORLD4 = {  # name -> (model, layout)
    "dense dp4 zero3": ("dense", ["parallel.dp=4", Z3, "train.save_every=3"]),
    "dense dp4 zero2": ("dense", ["parallel.dp=4", Z2]),
    "dense tp2xdp2 sp zero3": ("dense", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", Z3]),
    "moe tp2xdp2 sp zero2": ("moe", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", Z2]),
    "dense tied pp2xdp2 zero3": ("dense tied", ["parallel.pp=2", "parallel.dp=2", Z3]),
    "hybrid pp2 vp2 dp2 zero3 recompute": ("hybrid", ["parallel.pp=2", "parallel.vp=2", "parallel.dp=2", Z3,
                                                      "model.pattern=M*-MM*-M", "train.recompute=full"]),
    "dense cp2xdp2 zero3": ("dense", ["parallel.cp=2", "parallel.dp=2", Z3]),
    "moe ep2xedp2 zero3": ("moe", ["parallel.ep=2", Z3]),
    "moe ep2xedp2 zero2": ("moe", ["parallel.ep=2", Z2]),
    "gpt2-style tp2xdp2 sp zero3": ("gpt2-style", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true", Z3]),
}
POSITIONS_ZERO1 = ("gpt2-style dp2 zero1", ["parallel.dp=2", "parallel.distributed_optimizer=true"])
"""ZeRO-1 with its parameter all-gathers overlapping the forward: the table's bucket is waited for
before the positions are looked up."""
SHARED_NORM_ZERO2 = ("shared norm dp2 zero2", ["parallel.dp=2", Z2])
"""A norm two blocks apply, its gradient complete before its block's unit is reduce-scattered
(stage 3, which gathers a block for its own forward alone, refuses it)."""
SAVED = "dense dp4 zero3"
"""Its step-3 checkpoint resumes at stage 1 and at another layout."""
RESUMED = {"resumed dp2 zero1": ["parallel.dp=2", "parallel.zero_stage=1"],
           "resumed tp2 zero3": ["parallel.tp=2", Z3]}


def model_overrides(model: str, layout: list[str]) -> list[str]:
    return [*MODELS[model], *layout]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Single-process references, the world-4 runs (one of them saves), then the world-2 runs
    and the resumptions of the saved stage-3 checkpoint."""
    root = tmp_path_factory.mktemp("fully-sharded-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    references = {model: [*MODELS[model]] for model in MODELS}
    references["hybrid 8 blocks"] = [*MODELS["hybrid"], "model.pattern=M*-MM*-M"]
    single = {name: HELPERS.train_once(blend, root / f"single {name}", overrides)
              for name, overrides in references.items()}
    world4 = [(name, model_overrides(model, layout)) for name, (model, layout) in WORLD4.items()]
    results4 = run_distributed(HELPERS.train_runs, 4, str(blend), str(root), world4, timeout_s=600)
    saved = root / SAVED / "checkpoints"
    for name in RESUMED:
        shutil.copytree(saved / "step_3", root / name / "checkpoints" / "step_3")
    world2 = [(f"{model} {layout}", model_overrides(model, overrides))
              for model in WORLD2_MODELS for layout, overrides in WORLD2.items()]
    world2 += [(name, model_overrides("dense", overrides)) for name, overrides in RESUMED.items()]
    world2.append((POSITIONS_ZERO1[0], model_overrides("gpt2-style", POSITIONS_ZERO1[1])))
    world2.append((SHARED_NORM_ZERO2[0], model_overrides("shared norm", SHARED_NORM_ZERO2[1])))
    results2 = run_distributed(HELPERS.train_runs, 2, str(blend), str(root), world2, timeout_s=600)
    return dict(single=single, results4=results4, results2=results2)


def reference_of(name: str) -> str:
    model = WORLD4[name][0] if name in WORLD4 else name.split(" ")[0]
    return "hybrid 8 blocks" if model == "hybrid" and name in WORLD4 else model


@pytest.mark.parametrize("name", list(WORLD4))
def test_zero_stages_at_world_4_equal_single_process(runs, name):
    for rank, results in enumerate(runs["results4"]):
        HELPERS.assert_same_run(results[name], runs["single"][reference_of(name)], f"{name} rank {rank}")


@pytest.mark.parametrize("model", WORLD2_MODELS)
@pytest.mark.parametrize("layout", list(WORLD2))
def test_zero_stages_at_dp2_equal_single_process(runs, model, layout):
    for rank, results in enumerate(runs["results2"]):
        HELPERS.assert_same_run(results[f"{model} {layout}"], runs["single"][model], f"{model} {layout} rank {rank}")


def test_learned_positions_under_zero_1_with_overlapped_gathers_equal_single_process(runs):
    name = POSITIONS_ZERO1[0]
    for rank, results in enumerate(runs["results2"]):
        HELPERS.assert_same_run(results[name], runs["single"]["gpt2-style"], f"{name} rank {rank}")


def test_a_shared_parallel_residual_norm_under_zero_2_equals_single_process(runs):
    name = SHARED_NORM_ZERO2[0]
    for rank, results in enumerate(runs["results2"]):
        HELPERS.assert_same_run(results[name], runs["single"]["shared norm"], f"{name} rank {rank}")


@pytest.mark.parametrize("name", list(RESUMED))
def test_stage_3_checkpoint_resumes_at_stage_1_and_at_another_layout(runs, name):
    expected = runs["single"]["dense"]
    for rank, results in enumerate(runs["results2"]):
        resumed = results[name]
        assert sorted(resumed["losses"]) == [4, 5], (name, rank)
        tail = {"losses": {step: expected["losses"][step] for step in (4, 5)},
                "grad_norms": {step: expected["grad_norms"][step] for step in (4, 5)},
                "val_losses": {step: loss for step, loss in expected["val_losses"].items() if step >= 4},
                "params": expected["params"]}
        HELPERS.assert_same_run(resumed, tail, f"{name} rank {rank}")
