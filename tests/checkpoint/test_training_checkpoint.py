"""Training checkpoints in one process: what a step folder holds, exact restore, atomic commit,
keep-last-K, clear errors for damaged or foreign checkpoints, older single-process checkpoints."""

from __future__ import annotations

import hashlib
import json
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from meshlm.checkpoint.distributed import Checkpointer
from meshlm.checkpoint.folders import checkpoint_dirs, latest_checkpoint, prune_checkpoints
from meshlm.checkpoint.global_state import TrainingParts
from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.checkpoint.training_checkpoint import TrainerState, capture_rng_state, restore_rng_state
from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.config import load_run_config, save_run_config
from meshlm.errors import CheckpointError
from meshlm.models.language_model import LanguageModel
from meshlm.optim.adamw import build_adamw
from meshlm.precision.mixed_precision import MixedPrecision


def make_run(dtype: str = "fp32", hidden_size: int = 32, seed: int = 0, steps: int = 1):
    """A tiny model, its precision wrapper and an optimizer that has taken ``steps`` steps."""
    torch.manual_seed(seed)
    config = load_run_config(None, ["model.vocab_size=64", f"model.hidden_size={hidden_size}", "model.pattern=*-",
                                    f"precision.dtype={dtype}", "train.keep_checkpoints=3"])
    model = LanguageModel(config.model)
    precision = MixedPrecision(model, config.precision)
    optimizer = build_adamw(precision.master_parameters(), config.optim)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (2, 8))
        precision.scale_loss(model(tokens, tokens).loss).backward()
        precision.gradients_to_master()
        optimizer.step()
        precision.master_to_model()
        optimizer.zero_grad(set_to_none=True)
    return config, TrainingParts(model, optimizer, precision)


def save(run_dir, step: int, run, keep: int = 3, tokenizer_file=None, async_save=False):
    config, parts = run
    checkpointer = Checkpointer(run_dir, config, tokenizer_file=tokenizer_file, keep=keep)
    path = checkpointer.save(TrainerState(step=step, consumed_samples=8 * step), parts, async_save=async_save)
    checkpointer.wait()
    return path


def load(path, run):
    config, parts = run
    return Checkpointer(path.parent.parent, config).load(path, parts)


def tree_digest(directory) -> dict[str, str]:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def assert_same_state(parts, other) -> None:
    for (name, value), (_, again) in zip(parts.model.state_dict().items(), other.model.state_dict().items()):
        assert torch.equal(value, again), name
    for (name, master), (_, again) in zip(parts.precision.master_parameters(), other.precision.master_parameters()):
        assert torch.equal(master, again), name
    for param, again in zip(parts.optimizer.param_groups[0]["params"], other.optimizer.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(parts.optimizer.state[param][key], other.optimizer.state[again][key]), key


def test_a_checkpoint_holds_everything_and_restores_exactly(tmp_path):
    run = make_run(steps=2)
    tokenizer = tmp_path / "my_tokenizer.json"
    tokenizer.write_text('{"not": "checked here"}')
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    path = save(tmp_path / "run", 5, run, tokenizer_file=tokenizer)
    drawn = torch.rand(3)  # the first draw after the RNG state the checkpoint holds
    assert path == tmp_path / "run" / "checkpoints" / "step_5"
    assert sorted(p.name for p in path.iterdir()) == sorted([
        ".metadata", "__0_0.distcp", "complete.json", "config.json", "run.yaml", "trainer_state.json",
        "training.json", "tokenizer.json", "tokenizer_config.json"])
    marker = json.loads((path / "complete.json").read_text())
    assert marker["step"] == 5 and set(marker["files"]) == {p.name for p in path.iterdir()} - {"complete.json"}
    assert json.loads((path / "trainer_state.json").read_text())["consumed_samples"] == 40
    loaded = load_model(path)  # what `meshlm generate` / `meshlm convert` do with a checkpoint
    for name, tensor in run[1].model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    fresh = make_run(seed=1, steps=0)  # other weights, no optimizer state yet
    assert load(path, fresh).consumed_samples == 40
    assert_same_state(run[1], fresh[1])
    assert torch.equal(torch.rand(3), drawn)  # the RNG states were restored


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp32_masters_keep_their_bits_and_any_dtype_resumes(tmp_path, dtype):
    run = make_run(dtype, steps=2)
    masters = {name: master.detach().clone() for name, master in run[1].precision.master_parameters()}
    assert any(not torch.equal(m, m.to(run[1].precision.dtype).float()) for m in masters.values())
    path = save(tmp_path, 2, run)
    fresh = make_run(dtype, seed=1, steps=0)
    load(path, fresh)
    assert_same_state(run[1], fresh[1])
    as_fp32 = make_run("fp32", seed=1, steps=0)  # the fp32 masters become the fp32 weights
    load(path, as_fp32)
    for name, param in as_fp32[1].model.named_parameters():
        assert torch.equal(param, masters[name]), name
    back = make_run(dtype, seed=2, steps=0)  # and an fp32 checkpoint seeds the masters exactly
    load(save(tmp_path / "fp32", 2, as_fp32), back)
    for name, master in back[1].precision.master_parameters():
        assert torch.equal(master, masters[name]), name


def test_asynchronous_save_writes_the_same_checkpoint(tmp_path):
    run = make_run(steps=2)
    sync_path = save(tmp_path / "sync", 2, run)
    config, parts = run
    checkpointer = Checkpointer(tmp_path / "async", config)
    path = checkpointer.save(TrainerState(step=2, consumed_samples=16), parts, async_save=True)
    for param in parts.model.parameters():  # training goes on while the copy is written
        param.data.add_(1.0)
    assert checkpointer.wait() == path and latest_checkpoint(tmp_path / "async") == path
    written, expected = read_global_tensors(path), read_global_tensors(sync_path)
    assert set(written) == set(expected) and all(torch.equal(written[key], expected[key]) for key in expected)


def test_rng_state_round_trip():
    state = capture_rng_state()
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(state)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1]) and drawn[2] == again[2]


def test_latest_is_the_highest_step_and_pruning_keeps_k(tmp_path):
    run = make_run()
    for step in (2, 9, 10):
        save(tmp_path, step, run, keep=10)
    crashed = tmp_path / "checkpoints" / "step_11.tmp-abcd"  # a save that crashed
    shutil.copytree(tmp_path / "checkpoints" / "step_10", crashed)
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert latest_checkpoint(tmp_path).name == "step_10"  # numeric, not lexicographic, order
    save(tmp_path, 12, run, keep=2)
    assert [step for step, _ in checkpoint_dirs(tmp_path)] == [10, 12]
    assert not crashed.exists()
    assert (tmp_path / "checkpoints" / "notes").exists()  # not ours: left alone
    assert prune_checkpoints(tmp_path, keep=1) == [tmp_path / "checkpoints" / "step_10"]


def test_saving_a_step_again_replaces_it(tmp_path):
    run = make_run()
    save(tmp_path, 3, run)
    run[1].model.embedding.weight.data.fill_(0.5)
    save(tmp_path, 3, run)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_3"]
    assert torch.all(load_model(tmp_path / "checkpoints" / "step_3").embedding.weight == 0.5)


def test_a_failed_save_leaves_no_folder(tmp_path):
    config, parts = make_run()
    save(tmp_path, 1, (config, parts))
    with pytest.raises(CheckpointError, match="tokenizer file is missing"):
        save(tmp_path, 2, (config, parts), tokenizer_file=tmp_path / "missing.json")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]


@pytest.mark.parametrize("damage, message", [
    (lambda path: (path / "__0_0.distcp").write_bytes((path / "__0_0.distcp").read_bytes()[:-10]),
     r"__0_0.distcp: \d+ bytes, but \d+ were written \(truncated or overwritten\); move \S+step_1 out of the "
     r"checkpoints folder to resume from the one before it"),
    (lambda path: (path / "__0_0.distcp").write_bytes(bytes([255 - b for b in (path / "__0_0.distcp").read_bytes()])),
     r"__0_0.distcp: corrupted \(its CRC-32 differs"),
    (lambda path: (path / "__0_0.distcp").unlink(), r"__0_0.distcp: missing"),
    (lambda path: (path / "complete.json").unlink(), r"step_1 is incomplete: no complete.json"),
    (lambda path: shutil.rmtree(path), r"step_1: no such checkpoint directory"),
])
def test_damaged_checkpoints_are_named_and_left_alone(tmp_path, damage, message):
    run = make_run()
    path = save(tmp_path, 1, run)
    damage(path)
    before = tree_digest(tmp_path)
    fresh = make_run(seed=1)
    weights = {name: value.clone() for name, value in fresh[1].model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        load(path, fresh)
    assert tree_digest(tmp_path) == before
    assert all(torch.equal(value, weights[name]) for name, value in fresh[1].model.state_dict().items())


def test_a_checkpoint_of_another_model_names_what_differs(tmp_path):
    path = save(tmp_path, 1, make_run())
    with pytest.raises(CheckpointError, match=r"model.hidden_size: checkpoint 32 vs config 48"):
        load(path, make_run(hidden_size=48))
    config_path = path / "config.json"  # a config edited to match, over shards of the other shape
    payload = json.loads(config_path.read_text())
    payload["model"]["hidden_size"] = 48
    config_path.write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=r"\.metadata does not fit this run's model \(shape mismatch: "
                                              r"master/blocks.0.mixer.k_proj.weight: checkpoint \(32, 32\) vs run "
                                              r"\(48, 48\)|model/blocks.0.mixer.k_proj.weight: checkpoint \(32, 32\)"):
        load(path, make_run(hidden_size=48))


def write_single_process_checkpoint(directory, run) -> None:
    """The step folder older meshlm versions wrote (full tensors, torch.save'd states)."""
    config, parts = run
    save_model(parts.model, directory, extra_config={"run": config.to_dict()})
    torch.save(parts.optimizer.state_dict(), directory / "optimizer.pt")
    torch.save(parts.precision.state_dict(), directory / "precision.pt")
    torch.save(capture_rng_state(), directory / "rng.pt")
    save_run_config(config, directory / "run.yaml")
    (directory / "trainer_state.json").write_text(json.dumps({"step": 4, "consumed_samples": 32}))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_older_single_process_checkpoints_still_load(tmp_path, dtype):
    run = make_run(dtype, steps=2)
    write_single_process_checkpoint(tmp_path / "checkpoints" / "step_4", run)
    fresh = make_run(dtype, seed=1, steps=0)
    assert load(latest_checkpoint(tmp_path), fresh).consumed_samples == 32
    assert_same_state(run[1], fresh[1])
    if dtype == "fp32":  # (bf16 runs take their weights from the fp32 masters in precision.pt)
        save_file({"x": torch.zeros(1)}, str(tmp_path / "checkpoints" / "step_4" / "model.safetensors"))
        with pytest.raises(CheckpointError, match=r"step_4 does not fit this run's model \(missing \d+: model/"):
            load(latest_checkpoint(tmp_path), make_run(dtype, seed=1, steps=0))


def test_resuming_with_another_sample_order_warns(tmp_path):
    config, parts = make_run()
    path = save(tmp_path, 1, (config, parts))
    base = ["model.vocab_size=64", "model.hidden_size=32", "model.pattern=*-"]
    longer = load_run_config(None, [*base, "train.steps=200"])
    with pytest.warns(UserWarning, match=r"train.steps: checkpoint 100, now 200: the samples continue") as caught:
        Checkpointer(tmp_path, longer).load(path, parts)
    assert not any("sample order" in str(warning.message) for warning in caught)  # the order is prefix-stable
    reseeded = load_run_config(None, [*base, "train.seed=7"])
    with pytest.warns(UserWarning, match=r"train.seed: checkpoint \d+, now 7\): the order of the training samples"):
        Checkpointer(tmp_path, reseeded).load(path, parts)
