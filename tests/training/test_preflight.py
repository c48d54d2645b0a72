"""Start-up checks (meshlm/training/preflight.py): a finished run re-run, MoE without balancing,
a warmup as long as the run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from meshlm.cli import main
from meshlm.training.preflight import startup_warnings
from meshlm.training.trainer import Trainer


@pytest.fixture
def finished_run(make_config, tmp_path, capsys) -> tuple[Path, Path]:
    """(config file, run directory) of a tiny run already trained to its train.steps=2."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(make_config("train.steps=2", "train.eval_every=0").to_dict()))
    assert main(["train", str(path)]) == 0
    capsys.readouterr()
    return path, Path(make_config().train.run_dir)


def run_files(run_dir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("arguments, step_of", [([], "step 2 of train.steps=2"),
                                                (["train.steps=1"], "step 2 of train.steps=1")])
def test_rerunning_a_finished_run_says_so_trains_nothing_and_exits_0(finished_run, capsys, arguments, step_of):
    config_file, run_dir = finished_run
    before = run_files(run_dir)
    assert main(["train", str(config_file), *arguments]) == 0
    out = capsys.readouterr().out
    assert "already complete" in out and step_of in out and "nothing was trained" in out
    assert "train.steps=M with M > 2" in out and "train.run_dir=NEW_DIR" in out
    assert run_files(run_dir) == before  # no checkpoint, no metrics line, no resume event


def test_a_finished_run_refuses_command_line_settings_it_would_ignore(finished_run, capsys):
    config_file, run_dir = finished_run
    before = run_files(run_dir)
    assert main(["train", str(config_file), "parallel.tp=2", "train.steps=2", "optim.lr=1e-3"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "already complete (step 2 of train.steps=2)" in error
    assert "command line (optim.lr, parallel.tp) would be ignored" in error
    assert "train.steps=M with M > 2" in error and "train.run_dir=NEW_DIR" in error
    assert run_files(run_dir) == before


def test_a_finished_run_refuses_a_config_changed_since_its_checkpoint(finished_run, capsys):
    config_file, _ = finished_run
    values = yaml.safe_load(config_file.read_text())
    values["train"]["seq_len"] = 8
    config_file.write_text(yaml.safe_dump(values))
    assert main(["train", str(config_file)]) == 2
    error = capsys.readouterr().err
    assert "already complete" in error and "train.seq_len: checkpoint 16, now 8" in error


def messages(record) -> list[str]:
    return [str(warning.message) for warning in record]


def test_moe_without_any_balancing_warns_at_start(make_config):
    with pytest.warns(UserWarning) as record:
        Trainer(make_config("model.pattern=*E", "model.moe_num_experts=4", "model.moe_top_k=2"))
    found = [text for text in messages(record) if "no load balancing" in text]
    assert len(found) == 1 and "model.moe_aux_loss_coeff" in found[0] and "model.moe_bias_update_rate" in found[0]


@pytest.mark.parametrize("settings", [("model.moe_aux_loss_coeff=0.01",), ("model.moe_bias_update_rate=0.001",),
                                      ("model.moe_top_k=4",), ("model.pattern=*-",)])
def test_moe_balancing_or_no_routing_choice_does_not_warn(make_config, settings):
    config = make_config("model.pattern=*E", "model.moe_num_experts=4", "model.moe_top_k=2", *settings)
    assert not [text for text in startup_warnings(config) if "load balancing" in text]


def test_moe_blocks_in_the_mtp_pattern_count_too(make_config):
    config = make_config("model.mtp_depth=1", "model.mtp_pattern=*E", "model.moe_num_experts=4")
    assert any("no load balancing" in text for text in startup_warnings(config))


def test_a_warmup_as_long_as_the_run_warns_at_start(make_config):
    with pytest.warns(UserWarning) as record:
        Trainer(make_config("train.steps=4", "optim.warmup_steps=8"))
    found = [text for text in messages(record) if "optim.warmup_steps" in text]
    assert len(found) == 1 and "optim.warmup_steps=8 >= train.steps=4" in found[0]
    assert "to 0.0015; optim.lr=0.003" in found[0]  # the last step's rate: 4/8 of the peak


def test_a_warmup_shorter_than_the_run_does_not_warn(make_config):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of any kind from the tiny run's start
        Trainer(make_config("train.steps=4", "optim.warmup_steps=3"))
    assert startup_warnings(make_config("train.steps=4", "optim.warmup_steps=0")) == []
