"""``meshlm checkpoint inspect|consolidate`` and the model commands on a sharded checkpoint.

A bf16 run at tp2 (2 spawned gloo ranks) writes a checkpoint of TP shards; one process then
inspects it (after verifying every file), consolidates it into a single-file model (bf16
weights, or the fp32 masters) that equals the run's parameters, generates from it, converts it
to Hugging Face and upcycles it -- each command given the checkpoint or the run directory alike.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import load_model
from meshlm.cli import main
from tests.helpers.distributed import import_test_file, run_distributed


helpers = import_test_file(Path(__file__).parents[1] / "training" / "test_parallel_training.py",
                           "meshlm_parallel_training_helpers")
LAYOUT = [*helpers.MODELS["dense"], "precision.dtype=bf16", "parallel.tp=2", "parallel.vocab_pad_multiple=3",
          "train.steps=2", "train.eval_every=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("checkpoint-cli")
    blend = helpers.write_tiny_corpus(root / "corpus")
    results = run_distributed(helpers.train_runs, 2, str(blend), str(root), [("tp2", LAYOUT)])
    return {"root": root, "run_dir": root / "tp2", "checkpoint": root / "tp2" / "checkpoints" / "step_2",
            "params": results[0]["tp2"]["params"]}


def test_inspect_prints_step_layout_and_global_shapes(run, capsys):
    assert main(["checkpoint", "inspect", str(run["run_dir"])]) == 0  # a run directory: its newest
    text = capsys.readouterr().out
    assert "step 2, samples consumed 16" in text and "tp 2" in text and "dtype bf16" in text
    assert "model/embedding.weight" in text and "(64, 32)  (2 chunks)" in text  # vocab padding not stored
    assert "sizes and CRC-32s verified" in text
    assert "optim/" not in text.replace("(optim/*;", "") and "optimizer tensors (optim/*; --all lists them)" in text
    assert main(["checkpoint", "inspect", str(run["checkpoint"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layout"]["tp"] == 2 and info["tensors"]["master/embedding.weight"]["dtype"] == "float32"
    assert info["model"]["hidden_size"] == 32 and info["verified"] is True
    assert info["optimizer_tensors"] > 0 and not any(key.startswith("optim/") for key in info["tensors"])
    assert main(["checkpoint", "inspect", str(run["checkpoint"]), "--json", "--all"]) == 0
    listed = json.loads(capsys.readouterr().out)["tensors"]
    assert len([key for key in listed if key.startswith("optim/")]) == info["optimizer_tensors"]
    assert "optim/embedding.weight/exp_avg" in listed


@pytest.mark.parametrize("damage, words", [("truncate", "bytes, but"), ("flip a byte", "corrupted")])
def test_inspect_refuses_a_damaged_shard_unless_told_not_to_verify(run, tmp_path, capsys, damage, words):
    copy = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(run["checkpoint"], copy)
    shard = sorted(copy.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2:]
    else:
        data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["checkpoint", "inspect", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert f"{shard}: " in error and words in error and error.count("\n") == 1
    assert main(["checkpoint", "inspect", str(copy), "--no-verify"]) == 0
    assert "not verified (--no-verify)" in capsys.readouterr().out


def test_consolidate_writes_a_single_file_model_of_the_run(run, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["checkpoint", "consolidate", str(run["checkpoint"]), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    model = load_model(out)
    assert model.embedding.weight.dtype == torch.bfloat16
    for name, value in model.state_dict().items():
        assert torch.equal(value, run["params"][name]), name
    masters = tmp_path / "masters"
    assert main(["checkpoint", "consolidate", str(run["checkpoint"]), str(masters), "--fp32-masters"]) == 0
    fp32 = load_model(masters)
    assert fp32.embedding.weight.dtype == torch.float32
    assert torch.equal(fp32.embedding.weight.bfloat16(), run["params"]["embedding.weight"])
    capsys.readouterr()
    assert main(["checkpoint", "consolidate", str(run["checkpoint"]), str(out)]) == 2  # not empty: refused
    assert "exists and is not empty" in capsys.readouterr().err


def test_generate_and_convert_read_the_shards(run, tmp_path, capsys):
    for target in (run["checkpoint"], run["run_dir"]):
        assert main(["generate", str(target), "--prompt", "t1 t4 t7", "--max-new-tokens", "4", "--greedy",
                     "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out.strip())["ids"]) == 4
    assert main(["convert", "meshlm-to-hf", str(run["checkpoint"]), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_every_model_command_takes_the_run_directory(run, tmp_path, capsys):
    """convert meshlm-to-hf, upcycle and consolidate given the run directory write what they write
    given its newest checkpoint (the one resolver, meshlm/checkpoint/locate.py)."""
    for name, target in (("step", run["checkpoint"]), ("run", run["run_dir"])):
        assert main(["convert", "meshlm-to-hf", str(target), str(tmp_path / f"hf-{name}")]) == 0
        assert f"from {run['checkpoint']}" in capsys.readouterr().out
        assert main(["upcycle", str(target), str(tmp_path / f"moe-{name}"), "--experts", "4", "--top-k", "2"]) == 0
        assert main(["checkpoint", "consolidate", str(target), str(tmp_path / f"model-{name}")]) == 0
    for folder in ("hf", "moe", "model"):
        for file in ("model.safetensors", "config.json", "tokenizer.json"):
            assert (tmp_path / f"{folder}-run" / file).read_bytes() == (tmp_path / f"{folder}-step" / file).read_bytes()


def test_written_files_get_the_mode_of_the_umask(run, tmp_path):
    """Exported models are readable by the group and others as any file the user writes (0644
    under umask 022), not 0600 like a temporary file's."""
    previous = os.umask(0o022)
    try:
        assert main(["convert", "meshlm-to-hf", str(run["checkpoint"]), str(tmp_path / "hf")]) == 0
        assert main(["convert", "hf-to-meshlm", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
        assert main(["upcycle", str(run["checkpoint"]), str(tmp_path / "moe"), "--experts", "4", "--top-k", "2"]) == 0
        assert main(["checkpoint", "consolidate", str(run["checkpoint"]), str(tmp_path / "model")]) == 0
    finally:
        os.umask(previous)
    written = [path for folder in ("hf", "back", "moe", "model") for path in (tmp_path / folder).iterdir()]
    assert len(written) == 12
    assert {str(path): oct(path.stat().st_mode & 0o777) for path in written} == {str(path): "0o644" for path in written}
    assert {oct((tmp_path / folder).stat().st_mode & 0o777) for folder in ("hf", "back", "moe", "model")} == {"0o755"}


def test_a_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    error = capsys.readouterr().err
    assert "nope: no such model, checkpoint or run directory" in error and "Traceback" not in error
