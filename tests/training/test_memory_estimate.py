"""The start-up memory estimate (meshlm/training/memory_estimate.py): close to the measured peak of
a real step, and a warning that names the numbers and the settings when it does not fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.model_files import save_model
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.optim.muon import muon_parameter
from meshlm.parallel.mesh import ParallelContext
from meshlm.precision.device_defaults import resolve_precision
from meshlm.planning.layouts import Layout
from meshlm.planning.memory import rank_parameters
from meshlm.training.memory_estimate import (counted_parameters, estimate_training_memory, frozen_items,
                                             local_parameter_counts, memory_warning)
from meshlm.training.metrics import read_metrics
from meshlm.training.trainer import Trainer, train
from tests.helpers.memory import peak_allocated_bytes

CPU = torch.device("cpu")


def resolved(config):
    """The config as the trainer holds it (precision.dtype 'auto' resolved for the CPU)."""
    return dataclasses.replace(config, precision=resolve_precision(config.precision, CPU))


@pytest.mark.parametrize("settings", [
    ("model.pattern=M-*E", "model.moe_num_experts=4", "model.moe_aux_loss_coeff=0.01", "train.seq_len=128"),
    ("model.pattern=*-*-", "train.seq_len=256", "precision.dtype=bf16", "train.recompute=full"),  # activations dominate
    ("model.pattern=*-", "model.hidden_size=128", "train.seq_len=16"),  # parameter state dominates
    ("model.pattern=*-", "model.hidden_size=128", "train.seq_len=16", "model.lora_rank=4",
     "precision.dtype=bf16"),  # frozen bf16 weights with no masters, the adapters' state
])
def test_estimate_is_within_a_factor_of_two_of_the_measured_peak(make_config, settings):
    config = make_config("model.hidden_size=64", "train.steps=1", "train.eval_every=0", "train.prefetch_batches=false",
                         "optim.warmup_steps=0", *settings)
    trainer = Trainer(config)
    weights = sum(param.numel() * param.element_size() for param in trainer.model.parameters())
    masters = sum(param.numel() * param.element_size() for param in trainer.master_parameters
                  if param.requires_grad)  # a frozen parameter is its own master
    # The first step allocates the gradients and Adam's moments, on top of the weights (and masters)
    measured = (weights + masters * trainer.precision.low_precision) + peak_allocated_bytes(trainer.train_step)
    estimate = estimate_training_memory(resolved(config))
    assert 0.5 < estimate.total / measured < 2, (estimate, measured)


def test_a_huge_seq_len_warns_with_the_estimate_and_the_fix(make_config):
    config = resolved(make_config("train.seq_len=100000"))  # nothing is built and no step runs
    estimate = estimate_training_memory(config)
    assert estimate.activations > 100 * estimate.weights
    message = memory_warning(estimate, 256 * 2 ** 20, CPU, config)
    assert message.startswith("the estimated peak memory of this process, ")
    assert "exceeds the 256 MiB available on cpu" in message
    for setting in ("train.micro_batch_size (2)", "train.seq_len (100000)", "train.recompute=full", "parallel.tp"):
        assert setting in message
    assert memory_warning(estimate, 64 * 2 ** 30, CPU, config) is None  # it fits: nothing to say
    assert memory_warning(estimate, None, CPU, config) is None  # unknown: nothing to say


def test_the_layout_and_recomputation_lower_the_estimate(make_config):
    config = resolved(make_config("model.pattern=*-*-*-*-", "train.seq_len=4096", "train.micro_batch_size=4",
                                  "train.global_batch_size=16"))
    single = estimate_training_memory(config)
    split = ParallelContext(world_size=8, tp_size=2, cp_size=2, dp_size=2, dp_cp_size=4, edp_size=4,
                            sequence_parallel=True)
    sharded = estimate_training_memory(dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, tp=2, cp=2, sp=True, zero_stage=1)), split)
    assert sharded.activations < single.activations / 3  # tokens / cp, widths / tp (the vocab-parallel loss: more)
    assert sharded.optimizer < single.optimizer / 2  # / tp, then ZeRO-1 over dp * cp
    recomputed = estimate_training_memory(dataclasses.replace(config, train=dataclasses.replace(
        config.train, recompute="full")))
    assert recomputed.activations < single.activations / 2  # 8 block inputs and one block rerun, not 8 blocks


def test_lora_counts_gradients_and_optimizer_state_of_the_adapters_only(make_config):
    config = resolved(make_config("model.pattern=*-*-", "model.hidden_size=64", "model.lora_rank=4"))
    model = LanguageModel(config.model, seed=0)
    every = sum(param.numel() for param in model.parameters())
    adapters = sum(param.numel() for name, param in model.named_parameters() if ".lora." in name)
    estimate = estimate_training_memory(config)  # fp32: 4 weight bytes each, 4 + 8 more per adapter parameter
    assert (estimate.weights, estimate.gradients, estimate.optimizer) == (4 * every, 4 * adapters, 8 * adapters)
    full = estimate_training_memory(dataclasses.replace(config, model=dataclasses.replace(config.model, lora_rank=0)))
    assert full.optimizer == 8 * (every - adapters)


def test_latent_down_projections_are_whole_on_every_tensor_parallel_rank(make_config):
    """MLA's W_qa, W_kva and latent norms are replicated over TP, the rest of its block split: the
    estimate's per-rank count is the trainer's own split (the planner's exact one) but for the
    pre-norms, which it divides too."""
    config = resolved(make_config("model.pattern=*-*-", "model.hidden_size=64", "model.attention_type=mla",
                                  "model.mla_q_lora_rank=48", "model.mla_kv_lora_rank=32",
                                  "model.mla_qk_nope_head_dim=16", "model.mla_qk_rope_head_dim=8",
                                  "model.mla_v_head_dim=12", "parallel.tp=2"))
    replicated = 2 * (64 * 48 + 64 * (32 + 8) + 48 + 32)  # two attention blocks: W_qa, W_kva, the latent norms
    assert counted_parameters(config.model)[0]["replicated"] == replicated
    layout = Layout(tp=2, dp=1)
    exact = rank_parameters(config, layout).count
    context = ParallelContext(world_size=2, tp_size=2)
    estimated = sum(local_parameter_counts(config.model, context).values())
    assert estimated == pytest.approx(exact, rel=0.005)
    assert abs(estimated - replicated / 2 - exact) > 0.02 * exact  # splitting them too would be off by more


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_muon_keeps_one_momentum_instead_of_two_moments(make_config, dtype):
    config = resolved(make_config("model.pattern=*-ME", "model.moe_num_experts=4", "model.mtp_depth=1",
                                  "model.hidden_size=64", f"precision.dtype={dtype}"))
    model = LanguageModel(config.model, seed=0)
    muon = sum(param.numel() for name, param in model.named_parameters() if muon_parameter(name, param))
    assert 0 < muon < sum(param.numel() for param in model.parameters())  # the embedding, norms, ... stay AdamW's
    adamw = estimate_training_memory(config)
    stepped = estimate_training_memory(dataclasses.replace(config, optim=dataclasses.replace(
        config.optim, optimizer="muon")))
    assert adamw.optimizer - stepped.optimizer == 4 * muon  # 4 bytes of momentum instead of Adam's 8
    assert (stepped.weights, stepped.gradients, stepped.activations) == (adamw.weights, adamw.gradients,
                                                                         adamw.activations)


def test_the_start_line_and_metrics_carry_the_estimate(make_config, capsys):
    config = make_config("train.steps=1", "train.eval_every=0")
    train(config)
    log = capsys.readouterr().err  # the progress messages' stream
    start = next(line for line in log.splitlines() if line.startswith("meshlm train: starting at step 0/1"))
    assert "memory estimate " in start and " per process of " in start and " available" in start
    record = read_metrics(Path(config.train.run_dir) / "metrics.jsonl")[0]
    assert record["memory_estimate"] == estimate_training_memory(resolved(config)).total
    assert record["memory_available"] > 0


def test_a_distillation_teacher_is_counted_as_resident_weights_and_logits(make_config, tmp_path):
    teacher_dir = save_model(LanguageModel(ModelConfig(vocab_size=64, hidden_size=48, pattern="*-*-",
                                                       num_attention_heads=4)), tmp_path / "teacher")
    config = make_config("train.eval_every=0", "train.prefetch_batches=false", f"train.distill_from={teacher_dir}")
    trainer = Trainer(config)
    teacher_bytes = sum(param.numel() * param.element_size() for param in trainer.distillation.teacher.parameters())
    items = frozen_items(resolved(config), ParallelContext())
    assert items["teacher weights"] == teacher_bytes
    tokens = config.train.micro_batch_size * config.train.seq_len
    assert items["teacher logits"] == 4 * tokens * 64 * 4
    plain = estimate_training_memory(resolved(make_config()))
    estimate = estimate_training_memory(resolved(config))
    assert estimate.frozen == int(sum(items.values())) and estimate.total > plain.total
    assert "frozen models" in estimate.describe() and "frozen models" not in plain.describe()
    # a folder that cannot be read adds nothing here: the trainer refuses it with its own message
    missing = make_config(f"train.distill_from={tmp_path / 'missing'}")
    assert frozen_items(resolved(missing), ParallelContext()) == {}
