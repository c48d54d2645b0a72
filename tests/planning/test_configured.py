"""``meshlm train ... --plan`` (meshlm/planning/configured.py): the prediction for exactly the
configured layout is printed first, and the trainer logs measured memory and step time beside it."""

from __future__ import annotations

import json

import pytest

from meshlm.cli import main
from meshlm.config import load_run_config
from meshlm.planning.configured import configured_layout, configured_prediction, gpu_row
from tests.helpers.counting_corpus import write_corpus

BASE = ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=4", "train.seq_len=16",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=4", "train.log_every=1",
        "train.eval_every=0", "train.save_every=0", "train.progress=false", "train.tensorboard=false",
        "train.plot=false", "train.device=cpu", "optim.warmup_steps=1", "train.prefetch_batches=false",
        "data.split=90,10,0"]


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_train_with_plan_prints_the_configured_layout_and_logs_measured_beside_it(blend, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *BASE, f"data.blend={blend}", f"train.run_dir={run_dir}", "train.recompute=selective",
                 "--plan"]) == 0
    out = capsys.readouterr().out
    layout = "tp=1,sp=false,pp=1,vp=1,dp=1,cp=1,ep=1,zero=0,recompute=selective"
    assert f"--gpus 1 --gpu cpu --layout {layout} --micro-batch 2" in out
    assert f"\n{layout}" in out and "memory: weights" in out and "done: step 4/4" in out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checks = [record for record in records if record.get("event") == "plan_check"]
    assert len(checks) == 1
    check = checks[0]
    assert check["step"] == 3 and check["layout"] == layout and check["gpu"] == "cpu"
    assert check["timed_steps"] == 1 and not check["warmup_included"]
    assert check["measured_step_time_s"] > 0 and check["predicted_step_time_s"] > 0
    assert check["step_time_ratio"] == pytest.approx(check["measured_step_time_s"] / check["predicted_step_time_s"])
    assert check["measured_memory_bytes"] > 0 and check["predicted_memory_bytes"] > 0
    assert check["memory_ratio"] == pytest.approx(check["measured_memory_bytes"] / check["predicted_memory_bytes"])


def test_without_plan_no_check_is_logged(blend, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *BASE, "train.steps=1", f"data.blend={blend}", f"train.run_dir={run_dir}"]) == 0
    assert "--plan" not in capsys.readouterr().out
    assert "plan_check" not in (run_dir / "metrics.jsonl").read_text()


def test_the_layout_is_the_configs_over_the_started_processes(blend, monkeypatch):
    config = load_run_config(None, [*BASE, f"data.blend={blend}", "parallel.tp=2", "parallel.sp=true",
                                    "parallel.zero_stage=1", "train.recompute=full"])
    assert configured_layout(config, 4).describe() == "tp=2,sp=true,pp=1,vp=1,dp=2,cp=1,ep=1,zero=1,recompute=full"
    prediction, hardware, _, note = configured_prediction(config, 4)
    assert hardware.name == "cpu" and note is None and prediction["memory_bytes_per_gpu"] > 0
    refused, _, _, _ = configured_prediction(load_run_config(None, [*BASE, "parallel.tp=3"]), 3)
    assert "refused" in refused


@pytest.mark.parametrize("name, row, noted", [
    ("NVIDIA H100 80GB HBM3", "h100", False), ("NVIDIA H200", "h200", False), ("NVIDIA GH200 480GB", "h200", False),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb", False), ("NVIDIA L4", "h100", True),
])
def test_a_cuda_device_name_picks_its_row(name, row, noted):
    found, note = gpu_row(name)
    assert found == row and (note is not None) == noted
