"""train.keep_best and train.early_stop_evals (meshlm/training/early_stopping.py) on the real
trainer and real checkpoints. The validation losses are scripted (``Trainer.evaluate`` replaced)
so that the best step and the stop are known in advance; the evaluation itself is tested elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.checkpoint.folders import checkpoint_dirs
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.cli import main
from meshlm.errors import CheckpointError, ConfigError
from meshlm.training.metrics import read_metrics
from meshlm.training.status_cli import describe, run_status
from meshlm.training.trainer import Trainer, train
from tests.helpers.distributed import run_distributed

VALIDATION = {0: 5.0, 1: 4.5, 2: 4.0, 3: 3.0, 4: 3.5, 5: 3.6, 6: 3.7, 7: 2.0, 8: 2.5}
"""Scripted validation loss by step: the best is step 3 until step 7."""


def scripted_evaluate(self) -> float:
    return VALIDATION[self.state.step]


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(Trainer, "evaluate", scripted_evaluate)


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return ["train.eval_every=1", "train.save_every=2", "train.keep_checkpoints=1", "train.steps=6",
            "optim.warmup_steps=1", f"train.run_dir={run_dir}", *extra]


def test_keep_best_saves_the_best_step_and_pruning_spares_it(make_config, scripted, tmp_path):
    config = make_config(*overrides(tmp_path / "run", "train.keep_best=true"))
    result = train(config)
    assert result.step == 6 and result.stopped_by is None
    assert [step for step, _ in checkpoint_dirs(tmp_path / "run")] == [3, 6]  # keep 1, and the best
    pointer = json.loads((tmp_path / "run" / "best_checkpoint.json").read_text())
    assert pointer == {"step": 3, "val_loss": 3.0, "checkpoint": str(tmp_path / "run/checkpoints/step_3")}
    state = json.loads((tmp_path / "run/checkpoints/step_3/trainer_state.json").read_text())
    assert (state["step"], state["best_val_step"], state["best_val_loss"]) == (3, 3, 3.0)
    assert json.loads((tmp_path / "run/checkpoints/step_6/trainer_state.json").read_text())[
        "evaluations_since_best"] == 3
    assert resolve_model_dir(tmp_path / "run" / "best") == tmp_path / "run/checkpoints/step_3"  # RUN/best, anywhere
    assert main(["generate", str(tmp_path / "run" / "best"), "--prompt", "t1 t4", "--max-new-tokens", "2",
                 "--greedy", "--device", "cpu"]) == 0


def test_run_best_without_a_kept_best_says_how_to_keep_one(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(CheckpointError, match=r"run/best: .* has no best_checkpoint.json; a run keeps its best "
                                              r"checkpoint with train.keep_best=true"):
        resolve_model_dir(tmp_path / "run" / "best")
    (tmp_path / "run" / "best_checkpoint.json").write_text(json.dumps({"step": 3, "val_loss": 1.0,
                                                                        "checkpoint": str(tmp_path / "gone")}))
    with pytest.raises(CheckpointError, match=r"names .*gone, which holds no complete checkpoint"):
        resolve_model_dir(tmp_path / "run" / "best")


def test_without_keep_best_the_best_is_pruned_as_any_other(make_config, scripted, tmp_path):
    train(make_config(*overrides(tmp_path / "run")))
    assert [step for step, _ in checkpoint_dirs(tmp_path / "run")] == [6]
    assert not (tmp_path / "run" / "best_checkpoint.json").exists()


def test_early_stop_saves_says_why_and_a_rerun_trains_nothing_until_raised(make_config, scripted, tmp_path, capsys):
    run = tmp_path / "run"
    config = make_config(*overrides(run, "train.early_stop_evals=2", "train.steps=8", "train.keep_best=true"))
    result = train(config)
    assert (result.step, result.stopped_by) == (5, "early stop")  # evaluations 4 and 5 did not beat step 3
    stopped = [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "stopped"]
    assert [(r["step"], r["reason"]) for r in stopped] == [(5, "early stop")]
    assert 5 in [step for step, _ in checkpoint_dirs(run)]
    err = capsys.readouterr().err
    assert ("meshlm train: stopped early at step 5/8: 2 evaluations in a row did not lower the validation loss "
            "(train.early_stop_evals=2); its best validation loss is 3.0000, at step 3 (its checkpoint: ") in err
    lines = describe(run_status(str(run)))
    assert lines[0] == (f"{run}: stopped early (the validation loss stopped improving: train.early_stop_evals) "
                        "at step 5/8")
    assert f"  best checkpoint: {run}/checkpoints/step_3 (validation 3.0000 at step 3)" in lines
    again = train(config)  # the same command
    assert again.step == 5 and again.already_complete.startswith("the run stopped early at step 5/8")
    assert run_status(str(run))["state"] == "stopped"  # the rerun's resume event does not hide the stop
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r and "event" not in r][-1] == 5
    patient = make_config(*overrides(run, "train.early_stop_evals=0", "train.steps=8", "train.keep_best=true"))
    resumed = train(patient)  # no early stop: trains on from step 5 and finds the new best at step 7
    assert resumed.step == 8 and resumed.stopped_by is None
    assert json.loads((run / "best_checkpoint.json").read_text())["step"] == 7


def test_settings_that_cannot_act_are_refused(make_config):
    with pytest.raises(ConfigError, match="train.keep_best follows the validation loss, and train.eval_every=0"):
        make_config("train.keep_best=true", "train.eval_every=0")
    with pytest.raises(ConfigError, match=r"train.early_stop_evals=-1 must be >= 0"):
        make_config("train.early_stop_evals=-1")


def stop_on_ranks(blend: str, run_dir: str) -> tuple[int, str | None, list[int]]:
    from tests.training.test_parallel_training import run_config
    config = run_config(Path(blend), Path(run_dir), "train.eval_every=1", "train.steps=8", "train.early_stop_evals=2",
                        "train.keep_best=true", "train.save_every=2", "train.keep_checkpoints=1")
    original, Trainer.evaluate = Trainer.evaluate, scripted_evaluate  # in this (pooled) worker, for this run only
    try:
        result = Trainer(config).run()
    finally:
        Trainer.evaluate = original
    return result.step, result.stopped_by, [step for step, _ in checkpoint_dirs(run_dir)]


def test_every_data_parallel_rank_takes_the_same_decisions(corpus_blend, tmp_path):
    ranks = run_distributed(stop_on_ranks, 2, str(corpus_blend), str(tmp_path / "dp"), timeout_s=300)
    assert ranks == [(5, "early stop", [3, 5])] * 2
