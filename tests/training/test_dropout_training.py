"""Training with dropout gives the single-process run at every layout, and resumes exactly.

The dropout masks are hashes of global coordinates (meshlm/models/dropout.py), so a run with
``model.hidden_dropout=0.1`` (and ``attention_dropout=0.1`` where attention is not a ring) must
equal the single-process run with the same dropout: spawned gloo ranks train a hybrid Mamba /
attention / MLP model 5 steps of 4 micro-batches at tp2 x dp2 with sequence parallelism (SP
ranks mask their slices of the sequence, TP ranks their attention heads, DP ranks their own
sample indices), pp2 x tp2 with SP (stages build their own contexts) and cp2 x tp2 with SP
(zigzag chunks with global positions, then SP slices of those; hidden dropout only, 32 tokens), and
a model of DeepSeek's latent attention at tp2 x dp2 with SP. Losses, gradient norms,
validation losses and final parameters equal the single-process run (fp32, relative error
<= 1e-5), on every rank. In one process: the dropout changes the training losses but not the
validation losses (eval mode is dropout-free), and a run resumed from its step-3 checkpoint
repeats steps 4-5 bitwise (the masks depend on the step, which the checkpoint restores); the
dropout fields may change on resume and are absent from older checkpoints.
(The run helpers are those of tests/training/test_parallel_training.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import import_test_file, run_distributed


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""
HYBRID = HELPERS.MODELS["hybrid"]
MODELS = {
    "hidden+attention": [*HYBRID, "model.hidden_dropout=0.1", "model.attention_dropout=0.1"],
    "hidden": [*HYBRID, "model.hidden_dropout=0.1", "train.seq_len=32"],  # ring attention: no attention dropout
    # DeepSeek's latent attention: its explicit dropout core over value heads narrower than the keys
    "latent attention": ["model.pattern=*-*-", "model.attention_type=mla", "model.mla_q_lora_rank=16",
                         "model.mla_kv_lora_rank=8", "model.mla_qk_nope_head_dim=8", "model.mla_qk_rope_head_dim=4",
                         "model.mla_v_head_dim=6", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"],
}
"""(At seq_len 16 the cp2 x tp2 + SP run's losses match to 6e-8 -- as without dropout -- but one
Mamba weight ends 1.5e-5 apart: Adam amplifying fp32 summation noise in tiny gradient elements,
which the CP tests avoid with seq_len 32 too.)"""
LAYOUTS = {  # world 4: name -> (model, layout)
    "tp2 dp2 sp": ("hidden+attention", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true"]),
    "pp2 tp2 sp": ("hidden+attention", ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"]),
    "cp2 tp2 sp": ("hidden", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
    "latent attention tp2 dp2 sp": ("latent attention", ["parallel.tp=2", "parallel.dp=2", "parallel.sp=true"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dropout-training")
    blend = HELPERS.write_tiny_corpus(root / "corpus")
    single = {model: HELPERS.train_once(blend, root / f"single {model}", [*overrides, "train.save_every=3"])
              for model, overrides in MODELS.items()}
    single["none"] = HELPERS.train_once(blend, root / "single none", HYBRID)
    batch = [(name, [*MODELS[model], *overrides]) for name, (model, overrides) in LAYOUTS.items()]
    parallel = run_distributed(HELPERS.train_runs, 4, str(blend), str(root), batch, timeout_s=300)
    return dict(root=root, blend=blend, single=single, parallel=parallel)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropout_training_equals_single_process(runs, layout):
    model = LAYOUTS[layout][0]
    for rank, results in enumerate(runs["parallel"]):
        HELPERS.assert_same_run(results[layout], runs["single"][model], f"{layout} rank {rank}")


def test_dropout_changes_training_but_not_evaluation(runs):
    dropped, plain = runs["single"]["hidden+attention"], runs["single"]["none"]
    assert all(abs(dropped["losses"][step] - plain["losses"][step]) > 1e-4 for step in range(1, 6))
    assert dropped["val_losses"][0] == plain["val_losses"][0]  # the same initial weights, in eval mode


def test_resume_with_dropout_is_bitwise_exact(runs, tmp_path):
    whole = runs["single"]["hidden+attention"]
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs["root"] / "single hidden+attention" / "checkpoints" / "step_3",
                    run_dir / "checkpoints" / "step_3")
    resumed = HELPERS.train_once(runs["blend"], run_dir, MODELS["hidden+attention"])
    assert sorted(resumed["losses"]) == [4, 5]
    assert all(resumed["losses"][step] == whole["losses"][step] for step in (4, 5))
    assert resumed["val_losses"][5] == whole["val_losses"][5]
    assert resumed["params"].keys() == whole["params"].keys()
    assert all(torch.equal(resumed["params"][name], value) for name, value in whole["params"].items())


def test_checkpoints_resume_with_other_dropout_and_from_before_dropout_existed(tmp_path):
    import json

    from meshlm.checkpoint.training_checkpoint import check_model_config
    from meshlm.errors import CheckpointError
    from meshlm.models.config import ModelConfig

    older = ModelConfig().to_dict()
    del older["hidden_dropout"], older["attention_dropout"]  # written before the fields existed
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"model": older}))
    check_model_config(config_file, ModelConfig())
    check_model_config(config_file, ModelConfig(hidden_dropout=0.1, attention_dropout=0.2))  # training-only
    with pytest.raises(CheckpointError, match="model.hidden_size"):
        check_model_config(config_file, ModelConfig(hidden_size=32, hidden_dropout=0.1))
