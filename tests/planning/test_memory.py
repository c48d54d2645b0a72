"""The planner's parameter state (meshlm/planning/memory.py) equals, to the byte, what a real
Trainer holds after one step in real gloo processes: weights, gradient buffers and optimizer
state, on ZeRO stages 0-3 and tp / pp / ep / cp layouts, in fp32 and bf16, with LoRA too (frozen
weights: no gradient, no master, no moments), latent attention under TP, and with Muon (one
momentum and no step counter for the blocks' matrices, AdamW's state for the rest), in one
process too."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.config import load_run_config
from meshlm.parallel.mesh import ParallelContext
from meshlm.planning.hardware import GPUS
from meshlm.planning.layouts import Layout, apply_layout
from meshlm.planning.memory import memory_items, parameter_state
from meshlm.planning.predict import predict_at
from meshlm.training.memory_estimate import activation_items
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed

BASE = ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=4", "train.seq_len=16",
        "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=1", "train.eval_every=0",
        "train.save_every=0", "train.progress=false", "train.tensorboard=false", "train.plot=false",
        "train.device=cpu", "optim.warmup_steps=0", "train.prefetch_batches=false", "data.split=90,10,0"]


def measured_and_predicted(overrides: list[str]):
    from meshlm.training.trainer import Trainer
    from tests.helpers.persistent_memory import persistent_bytes

    trainer = Trainer(load_run_config(None, overrides))
    trainer.train_step()
    config, parallel, context = trainer.config, trainer.config.parallel, trainer.context
    layout = Layout(parallel.tp, parallel.sp, parallel.pp, parallel.vp, context.dp_size, parallel.cp, parallel.ep,
                    parallel.sharding_stage if context.distributed else 0, config.train.recompute)
    return persistent_bytes(trainer), parameter_state(config, layout, context.pp_rank)


CASES = [
    ["model.pattern=*-*-", "parallel.dp=2"],
    ["model.pattern=*-*-", "parallel.dp=2", "parallel.zero_stage=1", "precision.dtype=bf16"],
    ["model.pattern=*-*-", "parallel.tp=2", "parallel.sp=true"],
    ["model.pattern=*-*-", "parallel.pp=2"],
    ["model.pattern=*E*E", "model.moe_num_experts=4", "parallel.ep=2", "parallel.dp=2", "parallel.zero_stage=1"],
    ["model.pattern=*-*-", "parallel.cp=2", "parallel.zero_stage=2"],
    ["model.pattern=*-*-", "parallel.dp=2", "parallel.zero_stage=3", "precision.dtype=bf16"],
    ["model.pattern=*-*-", "model.lora_rank=4", "parallel.dp=2", "parallel.zero_stage=1", "precision.dtype=bf16"],
    ["model.pattern=*-M-", "model.mamba_num_groups=2", "model.mamba_head_dim=8", "model.lora_rank=4", "parallel.tp=2",
     "parallel.sp=true", "precision.dtype=bf16"],
    ["model.pattern=*-*-", "model.lora_rank=4", "parallel.dp=2", "parallel.zero_stage=3"],
    ["model.pattern=*-*-", "optim.optimizer=muon", "parallel.dp=2"],
    ["model.pattern=*-*-", "optim.optimizer=muon", "parallel.pp=2", "precision.dtype=bf16"],
    ["model.pattern=*-ME", "model.moe_num_experts=4", "model.mamba_num_groups=2", "model.mamba_head_dim=8",
     "optim.optimizer=muon", "parallel.tp=2", "parallel.sp=true", "precision.dtype=bf16"],
    ["model.pattern=*E*E", "model.moe_num_experts=4", "optim.optimizer=muon", "parallel.ep=2", "parallel.dp=2"],
    ["model.pattern=*-ME", "model.moe_num_experts=4", "model.mamba_num_groups=2", "model.mamba_head_dim=8",
     "optim.optimizer=muon", "parallel.ep=2", "parallel.zero_stage=1", "precision.dtype=bf16"],
    ["model.pattern=*-*-", "optim.optimizer=muon", "parallel.dp=2", "parallel.zero_stage=3", "precision.dtype=bf16"],
    ["model.pattern=*-*-", "model.attention_type=mla", "model.mla_q_lora_rank=16", "model.mla_kv_lora_rank=8",
     "model.mla_qk_nope_head_dim=8", "model.mla_qk_rope_head_dim=4", "model.mla_v_head_dim=6", "parallel.tp=2",
     "parallel.sp=true", "precision.dtype=bf16"],  # latent down-projections and norms whole on both ranks
]


@pytest.mark.parametrize("layout", CASES, ids=[" ".join(case[1:]) for case in CASES])
def test_parameter_state_is_exact_on_every_rank(layout, tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    blend = write_corpus(root / "corpus")
    overrides = [*BASE, f"train.run_dir={root / 'run'}", f"data.blend={blend}", *layout]
    for rank, (measured, predicted) in enumerate(run_distributed(measured_and_predicted, 2, overrides)):
        assert measured == predicted, (rank, measured, predicted)


def test_single_process_state_and_items():
    config = load_run_config(None, ["model.pattern=*-M-E", "model.hidden_size=64", "model.mtp_depth=1",
                                    "precision.dtype=fp32"])
    state = parameter_state(config, Layout())
    assert state["weights"] == state["gradients"]  # one process: N fp32 weights, N fp32 .grad of the masters
    assert state["optimizer"] > 2 * state["weights"]  # Adam's two moments and a step per tensor
    items = memory_items(config, Layout(), GPUS["h100"])
    assert items["activations mtp"] > 0 and items["activations blocks M"] > 0 and items["activations blocks E"] > 0
    assert items["fragmentation margin"] > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_muon_state_is_exact_in_one_process(dtype, tmp_path):
    """One process, no reducer: Muon's momentum on the blocks' and the MTP depth's matrices (the
    stacked experts too), AdamW's moments and step on the embedding, head, norms, router and
    Mamba's vectors and convolution. The gradients (the masters' ``.grad``) are released at the end
    of each step in one process (``zero_grad(set_to_none=True)``): nothing is left to measure."""
    blend = write_corpus(tmp_path / "corpus")
    measured, predicted = measured_and_predicted([
        *BASE, f"train.run_dir={tmp_path / 'run'}", f"data.blend={blend}", "model.pattern=*-ME",
        "model.moe_num_experts=4", "model.moe_aux_loss_coeff=0.01", "model.mamba_num_groups=2",
        "model.mamba_head_dim=8", "model.mtp_depth=1", "optim.optimizer=muon", f"precision.dtype={dtype}"])
    assert measured["gradients"] == 0
    assert (measured["weights"], measured["optimizer"]) == (predicted["weights"], predicted["optimizer"])


def test_a_gpu_plan_estimates_the_activations_of_a_gpu_run():
    """Planned from a CPU machine for an H100 (``train.device=cpu`` in the config): MLA's value heads
    wider than its query/key heads take CUDA's fused kernel (q, k, v, output, LSE), not the CPU's
    SDPA math path, which keeps fp32 scaled q, k, v and the [seq, seq] probabilities."""
    mla = [*BASE, "model.pattern=*-*-", "model.attention_type=mla", "model.mla_q_lora_rank=16",
           "model.mla_kv_lora_rank=8", "model.mla_qk_nope_head_dim=8", "model.mla_qk_rope_head_dim=4",
           "model.mla_v_head_dim=16", "precision.dtype=bf16", "train.seq_len=64"]
    config, layout = apply_layout(load_run_config(None, mla), Layout(), 2), Layout()
    planned = predict_at(config, layout, GPUS["h100"], 2)["memory_items"]["activations blocks *"]
    on = {device: activation_items(dataclasses.replace(config, train=dataclasses.replace(config.train, device=device)),
                                   ParallelContext())["blocks *"] for device in ("cpu", "cuda")}
    assert planned == int(on["cuda"])
    heads, seq, tokens = 4, 64, 2 * 64
    query = key = heads * (8 + 4)
    value = output = heads * 16
    math = 4 * (query + key + value) + 4 * heads * seq  # per token; o_proj's input is the same on both
    fused = 2 * (query + key + value + output) + 4 * heads  # bf16
    assert on["cpu"] - on["cuda"] == pytest.approx(2 * tokens * (math - fused), rel=1e-12)  # two attention blocks
