"""The step time's Muon term (``meshlm/planning/step_time.py``): nothing for AdamW; on one GPU the
Newton-Schulz FLOPs of the model's matrices over the fp32 matmul rate; less per rank under ZeRO-1
(Distributed Muon), more with tensor parallelism's gathers, less with experts split over EP."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import load_run_config
from meshlm.models.language_model import LanguageModel
from meshlm.optim.muon import muon_parameter
from meshlm.planning.hardware import GPUS
from meshlm.planning.layouts import Layout, apply_layout
from meshlm.planning.step_time import step_time

H100 = GPUS["h100"]
TINY = ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=2", "model.pattern=*-",
        "model.ffn_hidden_size=64", "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=8",
        "precision.dtype=bf16"]
WIDE = ["model.vocab_size=256", "model.hidden_size=1024", "model.num_attention_heads=8", "model.pattern=*-*-",
        "model.ffn_hidden_size=4096", "train.seq_len=64", "train.micro_batch_size=1", "train.global_batch_size=8",
        "precision.dtype=bf16", "optim.optimizer=muon"]


def times(overrides: list[str], layout: Layout) -> dict:
    config = apply_layout(load_run_config(None, overrides), layout, 1)
    return step_time(config, layout, H100, parameter_count=100_000)


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=2, zero=1), Layout(tp=2, dp=1), Layout(pp=2, dp=1)])
def test_adamw_has_no_muon_term_and_muon_changes_nothing_else(layout):
    adamw = times(TINY, layout)
    assert adamw["muon_s"] == 0.0
    parts = adamw["pipeline_s"] + adamw["dp_exposed_s"] + adamw["optimizer_s"] + adamw["step_scalars_s"]
    assert adamw["step_time_s"] == pytest.approx(parts, rel=1e-12)
    muon = times([*TINY, "optim.optimizer=muon"], layout)
    assert muon["muon_s"] > 0
    assert muon["step_time_s"] == pytest.approx(adamw["step_time_s"] + muon["muon_s"], rel=1e-12)


def test_one_gpu_pays_newton_schulz_on_every_matrix_at_the_tf32_rate():
    config = load_run_config(None, [*TINY, "optim.optimizer=muon"])
    with torch.device("meta"):
        model = LanguageModel(config.model, seed=0)
    shapes = sorted(tuple(param.shape) for name, param in model.named_parameters() if muon_parameter(name, param))
    # attention q, k, v, o: 32 x 32; the SwiGLU MLP's gate and up 64 x 32, down 32 x 64
    assert shapes == sorted([(32, 32)] * 4 + [(64, 32)] * 2 + [(32, 64)])
    square = 4 * 32 ** 2 * 32 + 2 * 32 ** 3  # m = n = 32: X X^T, B X (4 m^2 n) and A A (2 m^3)
    wide = 4 * 32 ** 2 * 64 + 2 * 32 ** 3  # m = 32, n = 64
    flops = 5 * (4 * square + 3 * wide)  # optim.muon_ns_steps = 5
    tf32 = H100.rate("matmul") * 494.7 / 989.4  # an H100's dense TF32 peak is half its bf16 peak
    assert times([*TINY, "optim.optimizer=muon"], Layout())["muon_s"] == pytest.approx(flops / tf32, rel=1e-12)
    # precision.tf32=false: plain fp32 (66.9 TFLOP/s on the data sheet)
    plain = times([*TINY, "optim.optimizer=muon", "precision.tf32=false"], Layout())["muon_s"]
    assert plain == pytest.approx(flops / (H100.rate("matmul") * 66.9 / 989.4), rel=1e-12)


def test_zero_1_and_tensor_parallelism_share_the_matrices():
    muon = {layout: times(WIDE, layout)["muon_s"] for layout in
            (Layout(), Layout(dp=2), Layout(dp=2, zero=1), Layout(dp=4, zero=1), Layout(tp=2, dp=1),
             Layout(tp=4, dp=1), Layout(pp=2, dp=1))}
    # without ZeRO every DP rank orthogonalizes every matrix; with it, about 1/dp of them
    assert muon[Layout(dp=2)] == pytest.approx(muon[Layout()], rel=1e-12)
    assert muon[Layout(dp=4, zero=1)] < muon[Layout(dp=2, zero=1)] < muon[Layout(dp=2)]
    # TP deals its cut matrices over its ranks: 1/tp of the Newton-Schulz each, plus two all-to-alls
    assert muon[Layout(tp=4, dp=1)] < muon[Layout(tp=2, dp=1)] < muon[Layout()]
    # each pipeline rank steps its own blocks' matrices
    assert muon[Layout(pp=2, dp=1)] < muon[Layout()]


def test_routed_experts_split_over_ep_are_fewer_matrices_per_rank():
    moe = [*WIDE, "model.pattern=*E", "model.moe_num_experts=8", "model.moe_ffn_hidden_size=1024"]
    assert times(moe, Layout(dp=2, ep=2))["muon_s"] < times(moe, Layout(dp=2))["muon_s"]
