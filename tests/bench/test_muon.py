"""bench/muon.py: a tiny run on the counting corpus records both optimizers, with the numbers adding
up; bad flags and bad overrides are refused with one sentence."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.muon import main
from tests.helpers.counting_corpus import VOCAB_SIZE, write_corpus

TINY_YAML = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")  # its lr, warmup and schedule
TINY = [f"model.vocab_size={VOCAB_SIZE}", "model.hidden_size=32", "model.pattern=*-*-", "train.seq_len=32",
        "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_every=3", "train.eval_batches=2",
        "optim.warmup_steps=1"]


def test_a_tiny_run_records_both_optimizers(tmp_path, capsys):
    blend = write_corpus(tmp_path / "corpus")
    argv = ["--config", TINY_YAML, "--steps", "6", "--muon-lr", "4e-3", "--repeats", "1", "--timed-steps", "1",
            "--overrides", *TINY, f"data.blend={blend}"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    runs = record["runs"]
    assert set(runs) == {"adamw", "muon", "muon lr=0.004"} and record["lr"] == 2e-3  # tiny.yaml's
    for run in runs.values():
        assert list(run["val_curve"]) == ["0", "3", "6"]
        assert all(math.isfinite(loss) for loss in [*run["val_curve"].values(), run["final_train_loss"]])
        assert run["final_val_loss"] == run["val_curve"]["6"] < run["val_curve"]["0"]
    assert len({run["val_curve"]["0"] for run in runs.values()}) == 1  # same seed: the same initial model
    for name in ("muon", "muon lr=0.004"):
        assert runs[name]["val_loss_ratio"] == pytest.approx(runs[name]["final_val_loss"]
                                                             / runs["adamw"]["final_val_loss"])
    assert record["val_loss_ratio"] == runs["muon"]["val_loss_ratio"]
    seconds, states = record["seconds_per_step"], record["optimizer_state_bytes"]
    assert record["step_time_ratio"] == pytest.approx(seconds["muon"] / seconds["adamw"])
    assert 0 < states["muon"] < states["adamw"]
    assert record["state_ratio"] == pytest.approx(states["muon"] / states["adamw"])
    assert 0 < record["muon_parameters"] < record["parameters"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--muon-lr", "1e-3", "-1"], "--muon-lr -1.0 must be a positive number"),
    (["--config", "configs/nowhere.yaml"], "--config configs/nowhere.yaml is not a file"),
    (["--config", TINY_YAML, "--overrides", "optim.lrr=1"], "unknown config key 'optim.lrr'"),
    (["--config", TINY_YAML, "--overrides", "train.eval_every=0"], "train.eval_every=0 computes no validation loss"),
])
def test_bad_flags_are_refused_with_one_sentence(argv, message, capsys):
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1
