"""The CPU row's calibration (``meshlm/planning/cpu_calibration.py``) and how the step time uses it."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.config import load_run_config
from meshlm.models.flops import block_flops, head_flops
from meshlm.planning.cpu_calibration import calibration_shapes, fit_fixed_and_rate, measure
from meshlm.planning.hardware import GPUS
from meshlm.planning.layouts import Layout
from meshlm.planning.step_time import step_scalar_seconds, step_time

MODEL = ["model.vocab_size=64", "model.hidden_size=32", "model.num_attention_heads=2", "model.pattern=*-ME",
         "model.moe_num_experts=4", "model.mamba_state_size=8", "model.mamba_head_dim=8", "model.mamba_chunk_size=8",
         "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=8", "precision.dtype=fp32"]


def test_the_line_through_two_timings_gives_the_fixed_part_and_the_rate():
    fixed, rate = fit_fixed_and_rate([(4e9, 0.003 + 4e9 / 50e9), (2e9, 0.003 + 2e9 / 50e9)])
    assert fixed == pytest.approx(0.003) and rate == pytest.approx(50e9)
    # noise that tilts the line past zero falls back to a rate through the larger point
    assert fit_fixed_and_rate([(2e9, 0.05), (4e9, 0.04)]) == (0.0, pytest.approx(4e9 / 0.04))


def test_the_shapes_halve_the_micro_batch_or_else_the_sequence():
    config = load_run_config(None, MODEL)
    assert calibration_shapes(config) == [(2, 16), (1, 16)]
    config = load_run_config(None, [*MODEL, "train.micro_batch_size=1", "train.seq_len=8192", "train.global_batch_size=1"])
    assert calibration_shapes(config) == [(1, 2048), (1, 1024)]


def test_every_block_kind_and_the_head_are_timed():
    measured = measure(load_run_config(None, MODEL), processes=1, repeats=1)
    assert set(measured["block_rates"]) == {"*", "-", "M", "E", "head"} == set(measured["block_fixed_s"])
    assert all(rate > 0 for rate in measured["block_rates"].values())
    assert all(fixed >= 0 for fixed in measured["block_fixed_s"].values())
    assert measured["optimizer_bytes_per_s"] > 0


def test_step_time_divides_each_blocks_share_by_its_kinds_rate_and_adds_the_fixed_part():
    config = load_run_config(None, MODEL)
    rates = {"*": 10e9, "-": 20e9, "M": 5e9, "E": 8e9, "head": 4e9}
    fixed = {"*": 1e-3, "-": 2e-3, "M": 3e-3, "E": 4e-3, "head": 5e-3}
    hardware = dataclasses.replace(GPUS["h100"], name="cpu", block_rates=rates, block_fixed_s=fixed, overhead_s=0.0,
                                   hbm_gbps=1e12)
    free_links = dataclasses.replace(hardware, intra_gbps=1e12, intra_latency_s=0.0, inter_gbps=1e12,
                                     inter_latency_s=0.0)
    seq, micro_batch = config.train.seq_len, config.train.micro_batch_size
    for layout in (Layout(), Layout(tp=2, dp=1), Layout(cp=2, dp=1)):
        micro_batches = config.train.global_batch_size // (micro_batch * layout.dp)
        blocks = sum(3 * micro_batch * block_flops(kind, config.model.for_block(index), seq).per_sequence
                     / layout.tp / layout.cp / rates[kind] + fixed[kind]
                     for index, kind in enumerate(config.model.block_kinds))
        head = 3 * micro_batch * head_flops(config.model, seq) / layout.tp / layout.cp / rates["head"] + fixed["head"]
        computed = step_time(config, layout, free_links, parameter_count=0)["pipeline_s"]
        assert computed == pytest.approx(micro_batches * (blocks + head), rel=1e-9)
        # the same with the link's latency and bandwidth: tp and cp add their messages on top
        linked = step_time(config, layout, hardware, parameter_count=0)["pipeline_s"]
        assert linked == pytest.approx(computed, rel=1e-9) if layout.world_size == 1 else linked > computed


def test_the_steps_scalar_all_reduces_are_counted_where_the_trainer_issues_them():
    config = load_run_config(None, MODEL)
    hardware = dataclasses.replace(GPUS["h100"], intra_latency_s=1e-3)
    hop = 2 * 1e-3  # a 2-rank tree: up one hop and back down
    assert step_scalar_seconds(config, Layout(), hardware) == 0.0
    assert step_scalar_seconds(config, Layout(dp=2), hardware) == pytest.approx(2 * hop)  # vote, logged sums
    assert step_scalar_seconds(config, Layout(dp=2, zero=1), hardware) == pytest.approx(3 * hop)  # + the norm
    assert step_scalar_seconds(config, Layout(tp=2, dp=1), hardware) == pytest.approx(2 * hop)  # vote, norm
    unclipped = dataclasses.replace(config, train=dataclasses.replace(config.train, grad_clip=0.0))
    assert step_scalar_seconds(unclipped, Layout(tp=2, dp=1), hardware) == pytest.approx(hop)
    # 64 ranks: log2(64) = 6 hops each way, not a ring's 63
    one_node = dataclasses.replace(hardware, gpus_per_node=64)
    assert step_scalar_seconds(config, Layout(dp=64), one_node) == pytest.approx(2 * 12 * 1e-3)
