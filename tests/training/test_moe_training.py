"""MoE balancing and ``train.init_from`` through the real trainer.

- The 'global' balance loss and the aux-loss-free expert bias at dp2 (2 gloo ranks, one
  micro-batch of 2 sequences each) equal a single process reading both micro-batches as one of 4
  sequences with the plain micro-batch loss: the counts summed over DP are that micro-batch's
  counts, and the mean over the ranks of E * sum f_global * P_local is E * sum f * P of the
  whole. Losses, grad norms and final parameters (the expert biases included) within 1e-5 —
  which shows the trainer hands the MoE layers the DP group and updates the biases from the
  DP-summed loads.
- The expert bias moves, is saved in the checkpoint, and a resumed run continues exactly.
- metrics.jsonl carries the load imbalance (max/mean tokens per expert) of each MoE layer.
- ``train.init_from`` starts a run from a model folder's weights (fresh optimizer) and refuses
  a folder whose model differs; a dense run's checkpoint upcycled by ``meshlm upcycle`` (with
  the overrides it prints) starts at the dense model's validation loss and trains.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from meshlm.checkpoint.model_files import save_model
from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.cli import main
from meshlm.errors import CheckpointError
from meshlm.models.language_model import LanguageModel
from meshlm.models.moe.router import TopKRouter
from meshlm.training.metrics import read_metrics
from meshlm.training.trainer import Trainer
from tests.helpers.distributed import import_test_file, run_distributed


HELPERS = import_test_file(Path(__file__).parent / "test_parallel_training.py", "parallel_training_helpers")
"""tests/training/test_parallel_training.py's run helpers (test files cannot import each other)."""
MOE = [*HELPERS.MODELS["moe"], "model.moe_bias_update_rate=0.01", "train.global_batch_size=4"]


def test_global_aux_loss_and_bias_update_at_dp2_equal_one_process_with_the_whole_batch(tmp_path):
    blend = HELPERS.write_tiny_corpus(tmp_path / "corpus")
    single = HELPERS.train_once(blend, tmp_path / "single", [*MOE, "train.micro_batch_size=4", "train.eval_batches=1"])
    # validation: one micro-batch of 4 sequences there, two of 2 here (the same tokens)
    runs = [("dp2 global", [*MOE, "parallel.dp=2", "model.moe_aux_loss_type=global", "train.eval_batches=2"])]
    for rank, results in enumerate(run_distributed(HELPERS.train_runs, 2, str(blend), str(tmp_path), runs,
                                                   timeout_s=120)):
        HELPERS.assert_same_run(results["dp2 global"], single, f"dp2 global rank {rank}")
    biases = [value for name, value in single["params"].items() if name.endswith("expert_bias")]
    assert len(biases) == 1 and biases[0].abs().sum() > 0  # the bias moved, and dp2 moved it alike


def expert_bias(trainer: Trainer) -> torch.Tensor:
    return next(module for module in trainer.model.modules() if isinstance(module, TopKRouter)).expert_bias


def test_expert_bias_is_checkpointed_and_resume_is_exact(make_config, tmp_path):
    rate = 0.001
    overrides = ["model.pattern=*E", "model.moe_num_experts=4", "model.moe_ffn_hidden_size=32",
                 "model.moe_score_function=sigmoid", f"model.moe_bias_update_rate={rate}", "train.eval_every=0"]
    uninterrupted = Trainer(make_config(*overrides, f"train.run_dir={tmp_path / 'full'}"))
    full = uninterrupted.run()
    final_bias = expert_bias(uninterrupted)
    steps_taken = final_bias / rate  # each step moves each bias by -1, 0 or +1 times the rate
    assert final_bias.abs().sum() > 0 and torch.allclose(steps_taken, steps_taken.round(), atol=1e-3)
    assert steps_taken.abs().max() <= 4
    checkpoints = tmp_path / "full" / "checkpoints"
    def saved_bias(step: int) -> torch.Tensor:  # the bias is part of the model in the checkpoint
        key = "model/blocks.1.mixer.router.expert_bias"
        return read_global_tensors(checkpoints / f"step_{step}", [key])[key]

    assert saved_bias(2).shape == final_bias.shape and torch.equal(saved_bias(4), final_bias)
    shutil.copytree(checkpoints / "step_2", tmp_path / "run" / "checkpoints" / "step_2")
    resumed_trainer = Trainer(make_config(*overrides))
    assert torch.equal(expert_bias(resumed_trainer), saved_bias(2))
    resumed = resumed_trainer.run()
    assert sorted(resumed.losses) == [3, 4]
    assert [resumed.losses[step] for step in (3, 4)] == [full.losses[step] for step in (3, 4)]
    assert torch.equal(expert_bias(resumed_trainer), final_bias)


def test_metrics_log_the_load_imbalance_of_each_moe_layer(make_config):
    config = make_config("model.pattern=*E*E", "model.moe_num_experts=4", "model.moe_ffn_hidden_size=32",
                         "train.steps=2", "train.eval_every=0")
    Trainer(config).run()
    records = [r for r in read_metrics(Path(config.train.run_dir) / "metrics.jsonl") if "loss" in r]
    assert len(records) == 2
    for record in records:
        per_layer = record["moe_max_load_per_layer"]
        assert len(per_layer) == 2 and all(value >= 1.0 for value in per_layer)
        assert record["moe_max_load"] == pytest.approx(max(per_layer))


def test_init_from_starts_from_the_folder_weights_with_a_fresh_optimizer(make_config, tmp_path):
    config = make_config("train.steps=1", "train.eval_every=0")
    torch.manual_seed(7)
    source = LanguageModel(config.model)
    save_model(source, tmp_path / "start")
    trainer = Trainer(make_config("train.steps=1", "train.eval_every=0", f"train.init_from={tmp_path / 'start'}"))
    for name, value in source.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], value), name
    assert trainer.state.step == 0 and not trainer.optimizer.state  # fresh optimizer and step
    result = trainer.run()
    assert result.step == 1
    with pytest.raises(CheckpointError, match="model.hidden_size: folder 32 vs run 64"):
        Trainer(make_config("model.hidden_size=64", f"train.init_from={tmp_path / 'start'}",
                            f"train.run_dir={tmp_path / 'other'}"))


def test_an_upcycled_checkpoint_trains_from_the_dense_models_validation_loss(make_config, tmp_path, capsys):
    dense_run = tmp_path / "dense"
    dense = Trainer(make_config("model.pattern=*-*-", "train.steps=2", f"train.run_dir={dense_run}")).run()
    code = main(["upcycle", str(dense_run / "checkpoints" / "step_2"), str(tmp_path / "moe"), "--experts", "8",
                 "--top-k", "4", "--granularity", "2", "--set", "moe_aux_loss_coeff=0.01"])
    assert code == 0
    command = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("train it with:"))
    overrides = command.split("meshlm train CONFIG ", 1)[1].split()  # train.init_from=... model.pattern='*E*E' ...
    moe = Trainer(make_config("train.steps=3", f"train.run_dir={tmp_path / 'moe run'}", *overrides)).run()
    # validation before the first step: the upcycled model computes what the dense model did at its end
    assert abs(moe.val_losses[0] - dense.val_losses[2]) <= 1e-5 * dense.val_losses[2]
    assert sorted(moe.losses) == [1, 2, 3] and all(math.isfinite(loss) for loss in moe.losses.values())
    records = [r for r in read_metrics(tmp_path / "moe run" / "metrics.jsonl") if "loss" in r]
    assert all(record["loss_moe_aux"] > 0 and len(record["moe_max_load_per_layer"]) == 2 for record in records)
