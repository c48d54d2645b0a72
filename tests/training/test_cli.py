"""``meshlm train``: YAML + overrides, --list-keys, exit status 2 for user errors, torchrun-style
launches; and the other commands accept what training writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshlm.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def config_file(make_config, tmp_path) -> Path:
    """The tiny test run written as a YAML file, the way a user would keep it."""
    path = tmp_path / "tiny.yaml"
    config = make_config("train.steps=2", "train.eval_every=0", "optim.warmup_steps=1")  # no warmup warning
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def test_train_from_yaml_with_overrides(config_file, tmp_path, capsys):
    run_dir = tmp_path / "cli-run"
    assert main(["train", str(config_file), "train.steps=3", f"train.run_dir={run_dir}"]) == 0
    assert "done: step 3/3" in capsys.readouterr().out
    assert (run_dir / "checkpoints" / "step_3" / "complete.json").is_file()
    saved = yaml.safe_load((run_dir / "checkpoints" / "step_3" / "run.yaml").read_text())
    assert saved["train"]["steps"] == 3 and saved["model"]["hidden_size"] == 32


def test_list_keys_shows_defaults_and_docs(capsys):
    assert main(["train", "--list-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = next(line for line in lines if line.startswith("train.steps "))
    assert steps.startswith("train.steps = 100  # Optimizer steps to run")
    assert any(line.startswith("model.pattern = '*-*-'  # Layer stack") for line in lines)
    assert any(line.startswith("data.prefixes = []") for line in lines)
    assert all(" # " in line for line in lines) and len(lines) > 80


@pytest.mark.parametrize("arguments, message", [
    (["train.stepz=3"], "unknown config key 'train.stepz'. Did you mean train.steps"),
    (["train.steps=many"], "train.steps='many' has the wrong type"),
    (["model.vocab_size=32"], "model.vocab_size=32 is smaller than the vocabulary"),
    (["data.blend=/nonexistent/blend.json"], "run `meshlm data demo`"),
])
def test_user_errors_exit_2_with_one_line(config_file, capsys, arguments, message):
    assert main(["train", str(config_file), *arguments]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error and error.count("\n") == 1


def test_missing_config_file_exits_2(capsys, tmp_path):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_and_convert_accept_a_training_checkpoint(config_file, tmp_path, capsys):
    run_dir = tmp_path / "gen-run"
    assert main(["train", str(config_file), f"train.run_dir={run_dir}"]) == 0
    capsys.readouterr()
    checkpoint = run_dir / "checkpoints" / "step_2"
    for target in (checkpoint, run_dir):  # a checkpoint folder, or the run (its latest step)
        assert main(["generate", str(target), "--prompt", "t1 t4 t7", "--max-new-tokens", "5", "--greedy",
                     "--json"]) == 0
        output = json.loads(capsys.readouterr().out.strip())
        assert len(output["ids"]) == 5 and all(0 <= token < 64 for token in output["ids"])
    assert main(["convert", "meshlm-to-hf", str(checkpoint), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def run_module(arguments: list[str], world_size: str) -> subprocess.CompletedProcess:
    """``python -m meshlm ...`` with the environment torchrun gives a single process."""
    environment = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1",
                       MASTER_PORT="29511", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "meshlm", *arguments], capture_output=True, text=True,
                          env=environment, cwd=REPO_ROOT, timeout=120)


def test_python_dash_m_under_a_torchrun_environment(config_file, tmp_path):
    run_dir = tmp_path / "module-run"
    finished = run_module(["train", str(config_file), f"train.run_dir={run_dir}"], world_size="1")
    assert finished.returncode == 0, finished.stderr
    # stderr is a pipe here: plain log lines, no carriage returns
    assert "step 1/2 | loss" in finished.stderr and "step 2/2 | loss" in finished.stderr
    assert "\r" not in finished.stderr
    # a layout that does not fit the world is refused before the process group is joined (the
    # second rank never starts, so joining would hang)
    refused = run_module(["train", str(config_file), f"train.run_dir={tmp_path / 'new-run'}", "parallel.tp=3"],
                         world_size="2")  # a new run: a finished one refuses any new setting first (preflight.py)
    assert refused.returncode == 2 and "world of 2 processes is not divisible by tp*pp*cp" in refused.stderr


def test_print_config_prints_a_config_that_loads_back_as_the_run_and_trains_nothing(config_file, tmp_path, capsys):
    from meshlm.config import load_run_config

    overrides = [f"train.run_dir={tmp_path / 'never'}", "train.steps=7", "model.pattern=M*-"]
    assert main(["train", str(config_file), *overrides, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"# meshlm train {config_file} ") and "'model.pattern=M*-'" in printed.splitlines()[0]
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_run_config(tmp_path / "printed.yaml").to_dict() == load_run_config(config_file, overrides).to_dict()
    assert not (tmp_path / "never").exists()
    assert main(["train", str(config_file), "train.steps=-1", "--print-config"]) == 2  # checked, as a run is
    assert "train.steps" in capsys.readouterr().err
