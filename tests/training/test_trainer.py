"""The single-process trainer: learning, accumulation, exact resume, checkpoint safety, metrics."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.folders import checkpoint_dirs, latest_checkpoint
from meshlm.checkpoint.whole_tensors import read_global_tensors
from meshlm.errors import CheckpointError
from meshlm.training.metrics import read_metrics
from meshlm.training.trainer import Trainer, resolve_device, train

STEP_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "loss_scale", "skipped_steps", "loss_lm"}


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r and "event" not in r]


def tree_digest(directory: Path) -> dict[str, str]:
    return {str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(directory.rglob("*")) if path.is_file()}


class SimulatedCrash(RuntimeError):
    pass


def crash_after(monkeypatch, step: int) -> None:
    """Make the trainer die right after finishing ``step`` (logged, evaluated, maybe saved)."""
    original = Trainer.after_step

    def after_step(self, *args):
        original(self, *args)
        if self.state.step == step:
            raise SimulatedCrash(f"killed after step {step}")

    monkeypatch.setattr(Trainer, "after_step", after_step)


def test_loss_falls_and_outputs_are_written(make_config):
    config = make_config("train.steps=30", "train.log_every=5", "train.eval_every=10", "train.save_every=10",
                         "train.tensorboard=true", "train.plot=true")
    result = train(config)
    run_dir = Path(config.train.run_dir)
    losses = [result.losses[step] for step in sorted(result.losses)]
    assert result.step == 30 and len(losses) == 30
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    assert all(STEP_KEYS <= set(r) for r in records)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["loss_scale"] == 1.0 for r in records)
    peaks = [r["memory_peak_bytes"] for r in records]  # the process's resident high-water mark: never falls
    assert peaks == sorted(peaks) and peaks[0] > 64 * 2 ** 20  # a process with torch loaded holds far more
    validation = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in validation] == [0, 10, 20, 30] == sorted(result.val_losses)  # 0: the start
    assert validation[-1]["val_loss"] < validation[0]["val_loss"]
    header = read_metrics(run_dir / "metrics.jsonl")[0]
    assert header["event"] == "start" and header["peak_flops"] > 0 and "measured" in header["peak_flops_source"]
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint.name == "step_30" and (checkpoint / "tokenizer.json").is_file()


def test_auto_dtype_resolves_to_fp32_on_cpu_and_tf32_stays_untouched(make_config):
    config = make_config("train.steps=1", "train.eval_every=0", "precision.tf32=true")
    assert config.precision.dtype == "auto"
    tf32_before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    trainer = Trainer(config)
    assert trainer.config.precision.dtype == "fp32" and config.precision.dtype == "auto"
    assert not trainer.precision.low_precision
    assert all(param.dtype == torch.float32 for param in trainer.model.parameters())
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == tf32_before  # CPU: no effect
    trainer.run()
    start = read_metrics(Path(config.train.run_dir) / "metrics.jsonl")[0]
    assert start["event"] == "start" and start["dtype"] == "fp32" and start["tf32"] is False
    assert start["attention_kernels"] is None  # a CPU: PyTorch's own attention kernel


def test_the_trainer_prefers_the_configured_attention_kernel_on_its_device(make_config, monkeypatch):
    """model.attention_kernel is put into effect by the trainer (meshlm/models/attention_kernels.py)
    and the start record says which order is in force (None: PyTorch's own, as on this CPU)."""
    asked = []
    monkeypatch.setattr("meshlm.training.trainer.prefer_attention_kernel",
                        lambda kernel, device: asked.append((kernel, device)) or ["math", "flash"])
    trainer = Trainer(make_config("train.steps=1", "train.eval_every=0", "model.attention_kernel=math"))
    assert asked == [("math", trainer.device)] and trainer.attention_kernels == ["math", "flash"]
    trainer.run()
    start = read_metrics(Path(trainer.config.train.run_dir) / "metrics.jsonl")[0]
    assert start["event"] == "start" and start["attention_kernels"] == ["math", "flash"]


def test_gradient_accumulation_matches_one_large_micro_batch(make_config, tmp_path):
    def config(micro: int):
        return make_config("train.global_batch_size=8", f"train.micro_batch_size={micro}", "train.steps=3",
                           "train.eval_every=0", "train.save_every=0", f"train.run_dir={tmp_path / str(micro)}")

    accumulated, single = Trainer(config(2)), Trainer(config(8))
    gradients = {}
    for trainer in (accumulated, single):
        assert len(trainer.next_micro_batches()) == 8 // trainer.config.train.micro_batch_size
        trainer.forward_backward(trainer.next_micro_batches())
        trainer.finish_gradients()
        gradients[trainer] = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        trainer.optimizer.zero_grad(set_to_none=True)
    for name, gradient in gradients[accumulated].items():
        torch.testing.assert_close(gradient, gradients[single][name], rtol=0, atol=1e-6)
    # Whole steps, optimizer included: the same losses (Adam amplifies 1e-7 gradient differences
    # in near-zero coordinates, so the weights themselves are compared via the losses they give).
    losses_accumulated, losses_single = accumulated.run().losses, single.run().losses
    for step in (1, 2, 3):
        assert losses_accumulated[step] == pytest.approx(losses_single[step], abs=1e-6)


def test_resume_after_a_crash_is_bitwise_identical(make_config, tmp_path, monkeypatch):
    settings = ("train.steps=6", "train.save_every=3", "train.eval_every=3")
    uninterrupted = make_config(*settings, f"train.run_dir={tmp_path / 'whole'}")
    train(uninterrupted)
    interrupted = make_config(*settings, f"train.run_dir={tmp_path / 'crashed'}")
    with monkeypatch.context() as patch:
        crash_after(patch, 5)  # steps 4 and 5 are logged, then lost: the checkpoint is at step 3
        with pytest.raises(SimulatedCrash):
            train(interrupted)
    assert [r["step"] for r in step_records(tmp_path / "crashed")] == [1, 2, 3, 4, 5]
    result = train(interrupted)
    assert sorted(result.losses) == [4, 5, 6]  # resumed at step 3

    expected, resumed = step_records(tmp_path / "whole"), step_records(tmp_path / "crashed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # the lost steps 4, 5 are not duplicated
    for before, after in zip(expected, resumed):
        assert (before["loss"], before["grad_norm"], before["lr"]) == (after["loss"], after["grad_norm"], after["lr"])

    def validation(run: str):
        return [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path / run / "metrics.jsonl") if "val_loss" in r]
    assert validation("whole") == validation("crashed")
    whole = read_global_tensors(tmp_path / "whole/checkpoints/step_6")
    again = read_global_tensors(tmp_path / "crashed/checkpoints/step_6")
    assert any(key.endswith("exp_avg") for key in whole)  # weights and Adam moments, every bit
    assert set(whole) == set(again) and all(torch.equal(whole[key], again[key]) for key in whole)


def test_extending_a_finished_run_continues_the_longer_run_exactly(make_config, tmp_path):
    """A run trained to step 3 and resumed with train.steps=6 reads the samples the 6-step run
    reads (the sample order is prefix-stable); with a constant LR the losses are bitwise equal."""
    constant = ("optim.schedule=constant", "optim.warmup_steps=0", "train.eval_every=0", "train.save_every=3")
    train(make_config(*constant, "train.steps=6", f"train.run_dir={tmp_path / 'long'}"))
    train(make_config(*constant, "train.steps=3", f"train.run_dir={tmp_path / 'short'}"))
    with pytest.warns(UserWarning, match="train.steps: checkpoint 3, now 6"):
        extended = train(make_config(*constant, "train.steps=6", f"train.run_dir={tmp_path / 'short'}"))
    assert sorted(extended.losses) == [4, 5, 6]
    assert [r["loss"] for r in step_records(tmp_path / "short")] == [r["loss"] for r in step_records(tmp_path / "long")]


def test_keeps_only_the_last_checkpoints(make_config):
    config = make_config("train.steps=5", "train.save_every=1", "train.keep_checkpoints=2", "train.eval_every=0")
    train(config)
    assert [step for step, _ in checkpoint_dirs(config.train.run_dir)] == [4, 5]


def test_an_interrupted_save_is_ignored(make_config):
    train(make_config("train.steps=2"))
    run_dir = Path(make_config().train.run_dir)
    partial = run_dir / "checkpoints" / "step_4.tmp-crashed"
    shutil.copytree(run_dir / "checkpoints" / "step_2", partial)
    (partial / "complete.json").unlink()
    (partial / "__0_0.distcp").write_bytes(b"half a file")
    assert latest_checkpoint(run_dir).name == "step_2"

    result = train(make_config("train.steps=4"))
    assert sorted(result.losses) == [3, 4]  # resumed from step_2, not from the broken step_4
    assert not partial.exists()  # removed once a complete checkpoint was written
    assert [step for step, _ in checkpoint_dirs(run_dir)] == [2, 4]


@pytest.mark.parametrize("damage, named", [
    (lambda ckpt: (ckpt / "__0_0.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes()[:100]),
     r"__0_0.distcp: 100 bytes, but \d+ were written"),
    (lambda ckpt: (ckpt / ".metadata").write_bytes(b"x" + (ckpt / ".metadata").read_bytes()[1:]),
     r".metadata: corrupted"),
    (lambda ckpt: (ckpt / "complete.json").unlink(), "incomplete: no complete.json"),
])
def test_a_corrupt_checkpoint_fails_clearly_and_is_left_alone(make_config, damage, named):
    train(make_config("train.steps=2", "train.save_every=1", "train.eval_every=0"))
    run_dir = Path(make_config().train.run_dir)
    damage(run_dir / "checkpoints" / "step_2")
    before = tree_digest(run_dir / "checkpoints")
    with pytest.raises(CheckpointError, match=named):
        train(make_config("train.steps=4", "train.save_every=1", "train.eval_every=0"))
    assert tree_digest(run_dir / "checkpoints") == before


def test_a_different_model_is_refused(make_config):
    train(make_config("train.steps=2"))
    run_dir = Path(make_config().train.run_dir)
    before = tree_digest(run_dir / "checkpoints")
    with pytest.raises(CheckpointError, match=r"model.hidden_size: checkpoint 32 vs config 48"):
        train(make_config("train.steps=4", "model.hidden_size=48"))
    assert tree_digest(run_dir / "checkpoints") == before


def test_moe_run_logs_each_loss_term_and_expert_load(make_config):
    config = make_config("model.pattern=*E", "model.moe_num_experts=4", "model.moe_top_k=2",
                         "model.moe_ffn_hidden_size=32", "model.moe_aux_loss_coeff=0.01",
                         "model.moe_z_loss_coeff=0.001", "train.steps=2", "train.eval_every=0")
    train(config)
    for record in step_records(Path(config.train.run_dir)):
        assert {"loss_lm", "loss_moe_aux", "loss_moe_z", "moe_max_load", "moe_min_load"} <= set(record)
        combined = record["loss_lm"] + 0.01 * record["loss_moe_aux"] + 0.001 * record["loss_moe_z"]
        assert record["loss"] == pytest.approx(combined, rel=1e-5)
        assert record["moe_min_load"] <= 1.0 <= record["moe_max_load"]


def test_a_finished_run_does_nothing_more(make_config):
    train(make_config("train.steps=2"))
    result = train(make_config("train.steps=2"))
    assert result.step == 2 and result.losses == {}


@pytest.mark.parametrize("environment,expected", [({}, 3), ({"WORLD_SIZE": "4", "LOCAL_RANK": "2"}, 2)],
                         ids=["one process", "torchrun"])
def test_a_bare_cuda_device_is_given_an_index(monkeypatch, environment, expected):
    """``train.device=cuda`` names the current GPU (LOCAL_RANK's under torchrun) with its index:
    ``torch.cuda.set_device`` and ``mem_get_info`` refuse a bare ``cuda`` (seen on the first GPU run).
    The CUDA calls are stood in for (this machine has none); the GPU tier trains with a bare ``cuda``."""
    for name in ("WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert resolve_device("cuda") == torch.device("cuda", expected) and chosen == [torch.device("cuda", expected)]
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


HYBRID_WITH_KERNELS = ("model.pattern=M*", "model.mamba_head_dim=16", "model.mamba_state_size=16",
                       "model.mamba_num_groups=1", "model.mamba_chunk_size=16", "train.steps=1", "train.eval_every=0",
                       "optim.warmup_steps=0",
                       "model.mamba_scan=triton")


def test_the_trainer_checks_the_triton_scan_before_its_first_step(make_config, monkeypatch):
    """model.mamba_scan=triton (here in Triton's interpreter): the kernels are checked against the
    PyTorch scan when the trainer starts (meshlm/models/scan_kernels.py); kernels that pass run,
    kernels that compute wrong numbers stop the run before any step."""
    pytest.importorskip("triton")
    import meshlm.kernels.ssd_diagonal as kernels
    from meshlm.errors import ConfigError
    from meshlm.models.scan_kernels import scan_kernel_failure

    scan_kernel_failure.cache_clear()
    trainer = Trainer(make_config(*HYBRID_WITH_KERNELS))
    assert trainer.scan_kernels_note is None
    trainer.run()
    start = read_metrics(Path(trainer.config.train.run_dir) / "metrics.jsonl")[0]
    assert start["event"] == "start" and start["scan_kernels_note"] is None

    original = kernels.diagonal_forward
    monkeypatch.setattr(kernels, "diagonal_forward", lambda *args: original(*args) * 1.5)
    scan_kernel_failure.cache_clear()
    try:
        with pytest.raises(ConfigError, match="model.mamba_scan=triton, but the Triton SSD kernels fail their check "
                                              "on cpu: y differs from the PyTorch scan"):
            Trainer(make_config(*HYBRID_WITH_KERNELS, "train.run_dir=" + str(Path(trainer.config.train.run_dir) / "b")))
    finally:
        scan_kernel_failure.cache_clear()
