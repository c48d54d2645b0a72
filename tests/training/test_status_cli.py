"""``meshlm status`` (meshlm/training/status_cli.py): a run's state, progress and figures read back
from its directory -- finished, stopped and unfinished runs, and runs older than the events' fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.cli import main
from meshlm.training.metrics import read_metrics
from meshlm.training.status_cli import describe, run_status
from meshlm.training.trainer import train

START = {"event": "start", "step": 0, "steps": 10, "time": 1000.0, "device": "cpu", "dtype": "fp32",
         "world_size": 4, "tp": 2, "dp": 2, "pp": 1, "cp": 1, "ep": 1, "num_parameters": 3_000_000,
         "tokens_per_step": 1000}


def write_run(path, records, evaluations=()):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    if evaluations:
        (path / "evaluations.jsonl").write_text("".join(json.dumps(record) + "\n" for record in evaluations))
    return path


def steps(first: int, last: int) -> list[dict]:
    return [{"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 500.0 + step, "mfu": 0.4,
             "memory_peak_bytes": 2 ** 30} for step in range(first, last + 1)]


def test_a_finished_run_reads_back_as_the_trainer_logged_it(make_config, capsys):
    config = make_config("train.steps=4", "train.save_every=2")
    train(config)
    run = Path(config.train.run_dir)
    status = run_status(str(run))
    records = read_metrics(run / "metrics.jsonl")
    start = next(record for record in records if record.get("event") == "start")
    assert start["steps"] == 4 and isinstance(start["time"], float)  # what status reads
    last = [record for record in records if "loss" in record and record.get("event") is None][-1]
    assert (status["state"], status["step"], status["steps"], status["starts"]) == ("finished", 4, 4, 1)
    assert status["loss"] == last["loss"] and status["tokens"] == 4 * start["tokens_per_step"]
    assert status["checkpoints"] == [2, 4] and "eta_s" not in status
    assert status["best_val_loss"] == min(r["val_loss"] for r in records if "val_loss" in r)
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run}: finished at step 4/4\n") and "checkpoints: 2 (steps 2, 4)" in out


def test_a_stopped_run_says_why_and_how_to_go_on(tmp_path):
    run = write_run(tmp_path / "stopped", [START, *steps(1, 6),
                                           {"event": "stopped", "step": 6, "reason": "SIGTERM", "time": 2000.0}])
    status = run_status(str(run))
    assert (status["state"], status["stop_reason"], status["step"]) == ("stopped", "SIGTERM", 6)
    assert describe(status)[0] == f"{run}: stopped (SIGTERM; rerun the same command to resume) at step 6/10"


def test_an_unfinished_run_gives_the_time_left_and_when_it_last_wrote(tmp_path):
    records = [START, *steps(1, 4), {"event": "resume", **{k: v for k, v in START.items() if k != "event"},
                                     "step": 4, "tokens_per_step": 2000}, *steps(5, 6),
               {"step": 6, "val_loss": 4.2}, {"event": "rollback", "step": 6}]
    run = write_run(tmp_path / "going", records, evaluations=[{"step": 4, "eval_hs_acc": 0.25, "settings": {}}])
    mtime = (run / "metrics.jsonl").stat().st_mtime
    status = run_status(str(run), now=mtime + 90)
    assert status["state"] == "not finished" and status["metrics_written_s_ago"] == pytest.approx(90)
    assert status["tokens"] == 4 * 1000 + 2 * 2000  # each span at its own batch
    median_rate = sorted(500.0 + step for step in (2, 3, 4, 5, 6))[2]
    assert status["eta_s"] == pytest.approx(2000 / median_rate * 4)
    assert (status["starts"], status["rollbacks"]) == (2, 1)
    lines = describe(status)
    assert "written 1m30s ago: still running, or interrupted" in lines[0]
    assert "left at the recent pace" in lines[2] and "tp 2, dp 2" in lines[3] and "1 rollback(s)" in lines[3]
    assert lines[-1] == "  evaluations (step 4): eval_hs_acc 0.2500"


def test_an_older_run_takes_its_length_from_the_newest_checkpoint(make_config, tmp_path):
    config = make_config("train.steps=2", "train.save_every=2", "optim.warmup_steps=1")
    train(config)
    path = Path(config.train.run_dir) / "metrics.jsonl"
    records = [{key: value for key, value in record.items() if key not in ("steps", "time")}
               for record in read_metrics(path)]  # as a run from before the fields were logged
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert run_status(str(config.train.run_dir))["state"] == "finished"


def test_a_folder_that_is_no_run_is_refused(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no metrics.jsonl; pass run directories" in capsys.readouterr().err
