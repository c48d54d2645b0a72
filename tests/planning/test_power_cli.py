"""``meshlm power``: on a real two-process run's timeline, from a plan, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshlm.cli import main
from meshlm.training.metrics import read_metrics
from meshlm.training.phase_timeline import TIMELINE_FILE
from meshlm.training.trainer import Trainer
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer_runs import load_parallel_training_helpers


def train_dp2(blend: str, run_dir: str) -> None:
    """In each spawned rank: 4 steps at dp2 over a slow simulated link, a checkpoint at step 2 and 4."""
    torch.set_num_threads(1)
    helpers = load_parallel_training_helpers()
    config = helpers.run_config(Path(blend), Path(run_dir), "parallel.dp=2", "parallel.simulate_link=20Mbps,20ms",
                                "train.steps=4", "train.save_every=2")
    Trainer(config).run()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("power-cli")
    blend = write_corpus(root / "corpus")
    run_distributed(train_dp2, 2, str(blend), str(root / "run"), timeout_s=300)
    return root / "run"


def power_json(capsys, *arguments: str) -> dict:
    assert main(["power", *arguments, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_power_of_a_real_run(run_dir, capsys):
    records = read_metrics(run_dir / TIMELINE_FILE)
    steps = [record for record in records if "step" in record and "pause" not in record and "start" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4]
    assert [record["step"] for record in records if record.get("pause") == "checkpoint"] == [2, 4]
    assert any(phase[0] == "dp_cp" for record in steps for phase in record["phases"])
    spans = [(record["start"], record["end"]) for record in records if "start" in record]
    spans += [(phase[1], phase[2]) for record in records for phase in record.get("phases", [])]  # waits before step 1 too
    first, last = min(start for start, _ in spans), max(end for _, end in spans)
    report = power_json(capsys, str(run_dir), "--out", str(run_dir / "power.png"))
    assert report["gpus"] == 2 and report["gpu"] == "cpu"  # the run's world size and device
    assert report["seconds"] == pytest.approx(last - first, abs=0.01)
    baseline = report["rows"][0]
    assert baseline["mitigation"] == "none"
    assert 0 < baseline["swing_mw"] <= 2 * 250 / 1e6 and baseline["peak_mw"] <= 2 * 250 / 1e6 + 1e-12
    floors = report["rows"][1:]
    assert [row["power_floor"] for row in floors] == [0.5, 0.7, 0.9]
    assert all(row["swing_mw"] <= baseline["swing_mw"] + 1e-12 for row in floors)
    assert [row["extra_energy_mwh"] for row in floors] == sorted(row["extra_energy_mwh"] for row in floors)
    assert floors[-1]["extra_energy_mwh"] > 0 and floors[-1]["trough_mw"] >= 0.9 * 2 * 250 / 1e6 - 1e-9
    if report["plot"] is not None:
        assert Path(report["plot"]).stat().st_size > 0
    scaled = power_json(capsys, str(run_dir), "--gpus", "1000", "--no-plot")
    assert scaled["rows"][0]["swing_mw"] == pytest.approx(baseline["swing_mw"] * 500)
    assert scaled["rows"][0]["band_fraction"] == pytest.approx(baseline["band_fraction"])
    assert main(["power", str(run_dir), "--no-plot", "--gpu", "h100", "--levels", "communication=200"]) == 0
    text = capsys.readouterr().out
    assert "meshlm power:" in text and "communication 200" in text and "floor 0.9" in text


def test_power_from_a_plan(capsys):
    arguments = ["configs/tiny.yaml", "--gpus", "8", "--layout", "tp=2,pp=2,dp=2"]
    assert main(["plan", *arguments, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    report = power_json(capsys, "--plan", *arguments, "train.eval_every=0", "--steps", "40", "--rate", "50000", "--no-plot",
                        "--checkpoint-seconds", "0")
    seconds = planned["step_time_s"] * 40  # 40 predicted steps, no saves nor evaluations
    assert report["seconds"] == pytest.approx(seconds, rel=0.01)
    baseline = report["rows"][0]
    items = planned["step_time_items"]
    computing = items["pipeline_s"] - items["bubble_s"] - items["pp_p2p_s"]  # with TP's all-reduces in it
    tp_share = items["tp_comm_s"] / computing
    assert baseline["peak_mw"] == pytest.approx(8 * (700 - tp_share * (700 - 315)) / 1e6, rel=1e-6)
    assert baseline["trough_mw"] < 8 * 0.45 * 700 / 1e6 + 1e-9  # the bubble or a collective
    assert "planned: 40 steps" in report["notes"][0]


@pytest.mark.parametrize("arguments, message", [
    (["/no/such/run"], "run directory /no/such/run does not exist"),
    (["{tmp}"], "power_timeline.jsonl does not exist"),
    (["{tmp}", "--power-floor", "1.5"], "--power-floor '1.5' must be fractions"),
    (["{tmp}", "--band", "20,0.1"], "--band '20,0.1' must be LOW,HIGH"),
    (["{tmp}", "--band", "0.1,200", "--rate", "100"], "--rate 100 must be positive and at least twice"),
    (["--plan", "configs/tiny.yaml"], "needs --gpus N"),
    (["--plan", "configs/tiny.yaml", "--gpus", "8", "--layout", "tp=2"], "uses tp*pp*cp*dp = 2 GPUs but --gpus is 8"),
])
def test_refusals_are_one_sentence(arguments, message, tmp_path, capsys):
    assert main(["power", *(argument.replace("{tmp}", str(tmp_path)) for argument in arguments)]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and error.startswith("meshlm power: error:") and "\n" not in error
