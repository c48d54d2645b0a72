"""train.profile_steps (meshlm/training/profiling.py): a Chrome trace of the chosen steps and the top-operator table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.training.trainer import train


def test_profiled_steps_give_a_chrome_trace_and_a_top_operator_table(make_config, capsys):
    config = make_config("train.steps=3", "train.profile_steps=2:3", "train.eval_every=0", "train.save_every=0")
    result = train(config)
    assert sorted(result.losses) == [1, 2, 3]
    trace = json.loads((Path(config.train.run_dir) / "profile" / "rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"train_step_2", "train_step_3"} <= names and "train_step_1" not in names
    assert any(name and name.startswith("aten::mm") for name in names)  # the model's matmuls were recorded
    output = capsys.readouterr().err
    assert "top 15 operators by self cpu time total" in output
    table = output.split("self cpu time total:\n", 1)[1]
    assert "Self CPU" in table.splitlines()[1] and "aten::" in table


@pytest.mark.parametrize("value, message", [
    ("x", "must look like A:B"),
    ("3", "must look like A:B"),
    ("0:2", "1 <= A <= B <= train.steps (4)"),
    ("3:2", "1 <= A <= B <= train.steps (4)"),
    ("2:9", "1 <= A <= B <= train.steps (4)"),
])
def test_profile_steps_are_checked_at_start_up(value, message):
    with pytest.raises(ConfigError, match=r"^train\.profile_steps=.*" + message.replace("(", r"\(").replace(")", r"\)")):
        load_run_config(None, ["train.steps=4", f"train.profile_steps='{value}'"])


def test_a_colon_override_stays_text():
    """YAML 1.1 would read 2:3 as the base-60 number 123."""
    assert load_run_config(None, ["train.steps=4", "train.profile_steps=2:3"]).train.profile_steps == "2:3"


def profile_in_rank(overrides: list[str]) -> dict:
    """In each spawned rank: train with profiling; what this rank's trace holds."""
    import torch.distributed as dist

    config = load_run_config(None, overrides)
    train(config)
    path = Path(config.train.run_dir) / "profile" / f"rank{dist.get_rank()}.json"
    events = json.loads(path.read_text())["traceEvents"]
    return {"file": path.name, "steps": sorted({e["name"] for e in events if e.get("name", "").startswith("train_step")}),
            "collectives": any("all_reduce" in e.get("name", "") for e in events)}


def test_every_rank_writes_its_own_trace(corpus_blend, tmp_path):
    from tests.helpers.distributed import run_distributed

    overrides = ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=*-", "model.num_attention_heads=4",
                 "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=2",
                 "train.eval_every=0", "train.save_every=0", "train.progress=false", "train.tensorboard=false",
                 "train.plot=false", "train.device=cpu", f"train.run_dir={tmp_path / 'run'}",
                 f"data.blend={corpus_blend}", "data.split=90,10,0", "train.profile_steps=2:2"]
    ranks = run_distributed(profile_in_rank, 2, overrides)  # data parallel over 2 gloo processes
    assert [rank["file"] for rank in ranks] == ["rank0.json", "rank1.json"]
    assert all(rank["steps"] == ["train_step_2"] and rank["collectives"] for rank in ranks)
