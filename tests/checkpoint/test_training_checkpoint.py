"""Training checkpoints: atomic step folders, what they hold, exact restore, and clear errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from meshlm.checkpoint.model_files import CheckpointError, load_model
from meshlm.checkpoint.training_checkpoint import (TrainerState, capture_rng_state, check_model_config,
                                                   checkpoint_dirs, latest_checkpoint, load_model_state,
                                                   load_training_state, prune_checkpoints, read_checkpoint,
                                                   restore_rng_state, save_checkpoint)
from meshlm.config import load_run_config
from meshlm.models.language_model import LanguageModel
from meshlm.precision.mixed_precision import MixedPrecision
from meshlm.training.optimizer import build_optimizer


def make_run(dtype: str = "fp32", hidden_size: int = 32):
    """A tiny model, its precision wrapper and an optimizer that has taken one step."""
    torch.manual_seed(0)
    config = load_run_config(None, ["model.vocab_size=64", f"model.hidden_size={hidden_size}", "model.pattern=*-",
                                    f"precision.dtype={dtype}"])
    model = LanguageModel(config.model)
    precision = MixedPrecision(model, config.precision)
    optimizer = build_optimizer(precision.master_parameters(), config.optim)
    tokens = torch.randint(0, 64, (2, 8))
    precision.scale_loss(model(tokens, tokens).loss).backward()
    precision.gradients_to_master()
    optimizer.step()
    precision.master_to_model()
    optimizer.zero_grad(set_to_none=True)
    return config, model, precision, optimizer


def save(run_dir, step: int, run, keep: int = 3, tokenizer_file=None):
    config, model, precision, optimizer = run
    return save_checkpoint(run_dir, TrainerState(step=step, consumed_samples=8 * step), model, optimizer, precision,
                           config, keep, tokenizer_file=tokenizer_file)


def test_checkpoint_holds_everything_and_restores_exactly(tmp_path):
    run = make_run()
    config, model, precision, optimizer = run
    tokenizer = tmp_path / "my_tokenizer.json"
    tokenizer.write_text('{"not": "checked here"}')
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    path = save(tmp_path / "run", 5, run, tokenizer_file=tokenizer)
    assert path == tmp_path / "run" / "checkpoints" / "step_5"
    assert sorted(p.name for p in path.iterdir()) == sorted([
        "config.json", "model.safetensors", "optimizer.pt", "precision.pt", "rng.pt", "run.yaml",
        "trainer_state.json", "tokenizer.json", "tokenizer_config.json"])
    assert json.loads((path / "config.json").read_text())["run"]["model"]["hidden_size"] == 32
    assert json.loads((path / "trainer_state.json").read_text())["consumed_samples"] == 40

    loaded = load_model(path)  # what `meshlm generate` / `meshlm convert` do with a checkpoint
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)

    checkpoint = read_checkpoint(path, config.model)
    _, fresh_model, fresh_precision, fresh_optimizer = make_run()
    torch.nn.init.zeros_(fresh_model.embedding.weight)
    load_model_state(checkpoint, fresh_model)
    state = load_training_state(checkpoint, fresh_optimizer, fresh_precision)
    assert state.step == 5 and state.consumed_samples == 40
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[name], tensor)
    saved_moments = optimizer.state_dict()["state"]
    for index, moments in fresh_optimizer.state_dict()["state"].items():
        assert torch.equal(moments["exp_avg_sq"], saved_moments[index]["exp_avg_sq"])


def test_bf16_master_weights_keep_their_fp32_bits(tmp_path):
    run = make_run("bf16")
    config, model, precision, _ = run
    masters = {name: master.detach().clone() for name, master in precision.master_parameters()}
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())  # not representable in bf16
    checkpoint = read_checkpoint(save(tmp_path, 1, run), config.model)
    _, fresh_model, fresh_precision, fresh_optimizer = make_run("bf16")
    load_model_state(checkpoint, fresh_model)
    load_training_state(checkpoint, fresh_optimizer, fresh_precision)
    for name, master in fresh_precision.master_parameters():
        assert torch.equal(master, masters[name])
    assert next(fresh_model.parameters()).dtype == torch.bfloat16


def test_rng_state_round_trip():
    state = capture_rng_state()
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1]) and drawn[2] == again[2]


def test_latest_is_the_highest_complete_step_and_pruning_keeps_k(tmp_path):
    run = make_run()
    for step in (2, 9, 10):
        save(tmp_path, step, run, keep=10)
    (tmp_path / "checkpoints" / "step_11.tmp-abcd").mkdir()  # a save that crashed
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_10"  # numeric, not lexicographic, order
    save(tmp_path, 12, run, keep=2)
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [10, 12]
    assert not (tmp_path / "checkpoints" / "step_11.tmp-abcd").exists()
    assert (tmp_path / "checkpoints" / "notes").exists()  # not ours: left alone
    assert prune_checkpoints(tmp_path, keep=1) == [tmp_path / "checkpoints" / "step_10"]


def test_saving_a_step_again_replaces_it(tmp_path):
    run = make_run()
    save(tmp_path, 3, run)
    run[1].embedding.weight.data.fill_(0.5)
    save(tmp_path, 3, run)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_3"]
    assert torch.all(load_model(tmp_path / "checkpoints" / "step_3").embedding.weight == 0.5)


def test_a_failed_save_leaves_no_folder(tmp_path):
    config, model, precision, optimizer = make_run()

    class BrokenPrecision:
        def state_dict(self):
            raise OSError("disk full")

    save(tmp_path, 1, (config, model, precision, optimizer))
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, 2, (config, model, BrokenPrecision(), optimizer))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]


@pytest.mark.parametrize("name", ["optimizer.pt", "precision.pt", "rng.pt", "model.safetensors"])
def test_truncated_files_are_named(tmp_path, name):
    run = make_run()
    path = save(tmp_path, 1, run)
    (path / name).write_bytes((path / name).read_bytes()[:64])
    with pytest.raises(CheckpointError, match=rf"{name}: unreadable or truncated.*; move \S+step_1 out of the "
                                              r"checkpoints folder to resume from the one before it"):
        read_checkpoint(path, run[0].model)


def test_missing_files_and_different_models_are_named(tmp_path):
    run = make_run()
    path = save(tmp_path, 1, run)
    other = load_run_config(None, ["model.vocab_size=64", "model.hidden_size=48", "model.pattern=*-*-"]).model
    with pytest.raises(CheckpointError, match=r"hidden_size: checkpoint 32 vs config 48; model.pattern: "
                                              r"checkpoint '\*-' vs config '\*-\*-'"):
        check_model_config(path / "config.json", other)
    (path / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete: missing trainer_state.json"):
        read_checkpoint(path, run[0].model)


def test_an_optimizer_state_for_other_parameters_is_refused(tmp_path):
    run = make_run()
    checkpoint = read_checkpoint(save(tmp_path, 1, run), run[0].model)
    _, model, precision, _ = make_run()
    optimizer = torch.optim.AdamW([next(model.parameters())])  # one group, one parameter
    with pytest.raises(CheckpointError, match="optimizer.pt does not match this run's AdamW"):
        load_training_state(checkpoint, optimizer, precision)
