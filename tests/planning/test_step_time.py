"""The step time (``meshlm/planning/step_time.py``). Its Muon term: nothing for AdamW; on one GPU the
Newton-Schulz FLOPs of the model's matrices over the fp32 matmul rate; less per rank under ZeRO-1
(Distributed Muon), more with tensor parallelism's gathers, less with experts split over EP. Latent
attention (MLA) under tensor and context parallelism: the down-projections every TP rank computes
whole, their partial gradients' all-reduce, and the padded key/value chunks ring attention sends."""

from __future__ import annotations

import pytest
import torch

from meshlm.config import load_run_config
from meshlm.models.language_model import LanguageModel
from meshlm.optim.muon import muon_parameter
from meshlm.planning.hardware import GPUS
from meshlm.planning.layouts import Layout, apply_layout
from meshlm.planning.memory import rank_parameters
from meshlm.planning.step_time import block_times, ring_kv_elements, ring_seconds, step_flops, step_time

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
    parts = (adamw["pipeline_s"] + adamw["dp_exposed_s"] + adamw["optimizer_s"] + adamw["step_scalars_s"]
             + adamw["tp_partial_s"])
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


# --- multi-head latent attention ---------------------------------------------------------------------------
MLA = ["model.attention_type=mla", "model.mla_q_lora_rank=24", "model.mla_kv_lora_rank=16",
       "model.mla_qk_nope_head_dim=12", "model.mla_qk_rope_head_dim=8", "model.mla_v_head_dim=10"]
"""A DeepSeek-V3-shaped attention, small: h 32, 2 heads, r_q 24, r 16, d_n 12, d_r 8, d_v 10."""


def test_latent_down_projections_are_computed_whole_on_every_tensor_parallel_rank():
    """parallelize_latent_attention keeps W_qa and W_kva whole: each TP rank projects the whole
    sequence down (2 T h r_q + 2 T h (r + d_r) forward); the rest of the block is split by heads."""
    config = load_run_config(None, [*TINY, *MLA])
    seq, hidden = config.train.seq_len, config.model.hidden_size
    replicated = 2 * seq * hidden * 24 + 2 * seq * hidden * (16 + 8)
    total = block_times(config, Layout(), H100, seq)[0]["flops"]
    assert block_times(apply_layout(config, Layout(tp=2, dp=1), 1), Layout(tp=2, dp=1), H100, seq)[0]["flops"] \
        == (total - replicated) / 2 + replicated
    # the hardware FLOPs count the second rank's copy, forward and backward; the model FLOPs do not
    flops = step_flops(apply_layout(config, Layout(tp=2, dp=1), 1), Layout(tp=2, dp=1))
    sequences = config.train.global_batch_size
    assert flops["hardware_flops"] - flops["model_flops"] == 3 * replicated * sequences  # TINY: one "*" block


def test_partial_gradients_are_summed_over_tensor_parallelism_once_per_step():
    """W_qa, W_kva and the two latent norms' weights: whole on each TP rank, each rank's gradient
    partial (its own heads'), all-reduced in fp32 once per step. Without SP nothing else is partial."""
    layout = Layout(tp=2, dp=1)
    partial = 32 * 24 + 32 * (16 + 8) + 24 + 16  # TINY: one "*" block
    assert rank_parameters(apply_layout(load_run_config(None, [*TINY, *MLA]), layout, 1), layout).partial_count \
        == partial
    assert rank_parameters(apply_layout(load_run_config(None, TINY), layout, 1), layout).partial_count == 0
    mla = step_time(apply_layout(load_run_config(None, [*TINY, *MLA]), layout, 1), layout, H100, 100_000, partial)
    assert mla["tp_partial_s"] == pytest.approx(ring_seconds(partial * 4, 2, H100, intra=True), rel=1e-12)
    assert times(TINY, layout)["tp_partial_s"] == 0.0
    parts = sum(mla[key] for key in ("pipeline_s", "dp_exposed_s", "optimizer_s", "step_scalars_s", "tp_partial_s"))
    assert mla["step_time_s"] == pytest.approx(parts, rel=1e-12)


def test_ring_attention_passes_latent_keys_and_values_padded_to_the_wider_head():
    """What ring attention sends per token: each head's key (d_n + d_r) and value (d_v), both at
    max(d_n + d_r, d_v) channels, read off the block's own projections."""
    config = load_run_config(None, [*TINY, *MLA])
    torch.manual_seed(0)
    attention = LanguageModel(config.model, seed=0).blocks[0].mixer
    positions = torch.arange(5)[None]
    _, key, value = attention.project(torch.randn(1, 5, 32), positions)
    width = max(key.shape[-1], value.shape[-1])
    assert ring_kv_elements(config.model) == (key.shape[1] + value.shape[1]) * width == 2 * 2 * 20
    wider_values = load_run_config(None, [*TINY, *MLA[:-1], "model.mla_v_head_dim=32"])
    assert ring_kv_elements(wider_values.model) == 2 * 2 * 32
    assert times([*TINY, *MLA], Layout(cp=2, dp=1))["step_time_s"] > 0
