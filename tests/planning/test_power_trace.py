"""meshlm/planning/power_trace.py, power_levels.py and power_mitigation.py on hand-built timelines:
every number compared with a hand computation."""

from __future__ import annotations

import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.planning.power_levels import TDP_WATTS, calibrate_levels, default_levels, parse_levels
from meshlm.planning.power_mitigation import mitigation_rows, power_report, with_floor
from meshlm.planning.power_spectrum import spectrum
from meshlm.planning.power_trace import (OFF_PADDING_S, Interval, intervals_from_plan, intervals_from_timeline,
                                         paint, plan_step)
from meshlm.training.power_floor import PHASE_POWER_FRACTION

H100 = default_levels("h100")  # compute 700 W, communication 315 W, bubble 175 W, idle 105 W


def steps(count: int, compute_s: float = 0.6, wait_s: float = 0.4, group: str = "dp") -> list[dict]:
    """Timeline records of ``count`` steps: computation, then a wait on ``group``."""
    records, now = [], 100.0
    for number in range(1, count + 1):
        records.append({"step": number, "start": now, "end": now + compute_s + wait_s,
                        "phases": [[group, now + compute_s, now + compute_s + wait_s]]})
        now += compute_s + wait_s
    return records


def test_levels_are_tdp_times_the_fractions_and_overridable():
    assert H100["compute"] == 700.0 and H100["communication"] == pytest.approx(0.45 * 700) and H100["off"] == 0.0
    for gpu, watts in TDP_WATTS.items():
        assert default_levels(gpu)["bubble"] == pytest.approx(watts * PHASE_POWER_FRACTION["bubble"])
    custom = parse_levels("compute=690, communication=300", H100)
    assert custom["compute"] == 690.0 and custom["communication"] == 300.0 and custom["bubble"] == H100["bubble"]
    assert custom.source == "defaults + --levels"


@pytest.mark.parametrize("text", ["compute", "power=5", "compute=-1", "compute=abc", "communication=800", "compute=0"])
def test_bad_levels_are_refused(text):
    with pytest.raises(ConfigError, match="--levels"):
        parse_levels(text, H100)


def test_unknown_gpu_is_refused():
    with pytest.raises(ConfigError, match="--gpu 'tpu'"):
        default_levels("tpu")


def test_nvml_calibration_skips_cleanly_without_a_gpu():
    import torch

    levels, note = calibrate_levels(H100, seconds=0.2)
    if levels is None:
        assert "skipped" in note
    else:  # on a machine with NVML and CUDA: measured, ordered levels
        assert torch.cuda.is_available() and levels.source == "NVML"
        assert levels["compute"] > levels["communication"] > levels["idle"] > 0


def test_trace_of_a_two_phase_step():
    """0.6 s computing, 0.4 s on a DP collective, 5 steps, 1000 GPUs, 100 samples per second."""
    trace = paint(intervals_from_timeline(steps(5)), H100, 100.0, 1000)
    running = trace.run_part(trace.watts_per_gpu)
    assert len(running) == 500 and trace.run_start == int(OFF_PADDING_S * 100)
    assert np.allclose(running[:60], 700.0) and np.allclose(running[60:100], 315.0)
    assert trace.watts_per_gpu[:trace.run_start].max() == 0.0  # off before the job
    report = power_report(trace, trace.watts_per_gpu, (0.1, 20.0), 0.1)
    assert report["swing_mw"] == pytest.approx((700 - 315) * 1000 / 1e6)
    assert report["peak_mw"] == pytest.approx(0.7) and report["trough_mw"] == pytest.approx(0.315)
    assert report["dominant_hz"] == pytest.approx(1.0)  # one step per second
    assert report["max_ramp_up_mw_per_s"] == pytest.approx(0.7 / 0.1)  # the job's start: 0 to 0.7 MW at once
    assert report["running_ramp_mw_per_s"] == pytest.approx(0.385 / 0.1)
    energy_mwh = 5 * (0.6 * 0.7 + 0.4 * 0.315) / 3600
    assert report["energy_mwh"] == pytest.approx(energy_mwh)


def test_short_phases_keep_their_energy():
    """Phases shorter than a sample are averaged into it, not dropped."""
    intervals = [Interval("compute", 0.0, 1.0)] + [Interval("communication", 0.1 * k, 0.1 * k + 0.003)
                                                    for k in range(10)]
    trace = paint(intervals, H100, 10.0, 1)
    exact = 1.0 * 700 - 10 * 0.003 * (700 - 315)
    assert trace.watts_per_gpu.sum() / trace.rate_hz == pytest.approx(exact, rel=1e-3)


def test_pipeline_waits_are_bubble_and_filler_lifts_its_share():
    records = steps(1, group="pp")
    records[0]["phases"].append(["filler", 100.6, 101.0, 100.95, "wait", 0.2])  # GEMMs half the time
    trace = paint(intervals_from_timeline(records), H100, 100.0, 1)
    running = trace.run_part(trace.watts_per_gpu)
    assert np.allclose(running[60:100], 175 + 0.5 * (700 - 175))


def test_floor_shrinks_the_swing_and_costs_the_filled_energy():
    trace = paint(intervals_from_timeline(steps(5)), H100, 100.0, 1000)
    baseline, floor = mitigation_rows(trace, H100, [0.9], 0.0, (0.1, 20.0), 0.1)
    assert floor["trough_mw"] == pytest.approx(0.63)  # 0.9 x 700 W x 1000
    assert floor["swing_mw"] == pytest.approx(0.07)
    assert floor["swing_removed_mw"] == pytest.approx(0.385 - 0.07)
    extra = 5 * 0.4 * (630 - 315) * 1000 / 1e6 / 3600  # every wait filled up to 630 W
    assert floor["extra_energy_mwh"] == pytest.approx(extra)
    assert floor["extra_energy_fraction"] == pytest.approx(extra / baseline["energy_mwh"])
    below = mitigation_rows(trace, H100, [0.4], 0.0, (0.1, 20.0), 0.1)[1]  # 280 W < 315 W: nothing to fill
    assert below["extra_energy_mwh"] == pytest.approx(0.0) and below["swing_mw"] == pytest.approx(0.385)


def test_ramps_limit_the_start_and_stop():
    trace = paint(intervals_from_timeline(steps(5)), H100, 100.0, 1000)
    ramped = with_floor(trace, H100, 0.9, 1.0)
    before = ramped.watts_per_gpu[:trace.run_start]
    assert before[-1] == pytest.approx(0.9 * 700 * 0.99, rel=0.02) and before[-100] == pytest.approx(0.0, abs=1)
    report = power_report(trace, ramped.watts_per_gpu, (0.1, 20.0), 0.1)
    # over the 0.1 s window: the ramp's last 0.1 s (0.63 MW/s) plus the jump from the floor to computing
    assert report["max_ramp_up_mw_per_s"] == pytest.approx((0.63 * 0.1 + 0.07) / 0.1, rel=0.02)
    unramped = power_report(trace, with_floor(trace, H100, 0.9, 0.0).watts_per_gpu, (0.1, 20.0), 0.1)
    assert unramped["max_ramp_up_mw_per_s"] == pytest.approx(0.7 / 0.1)  # without ramps: 0 to computing at once


def test_checkpoint_pause_fades_and_climbs_back_with_ramps():
    intervals = [Interval("compute", 0.0, 1.0), Interval("checkpoint", 1.0, 5.0), Interval("compute", 5.0, 6.0)]
    trace = paint(intervals, H100, 100.0, 1)
    held = with_floor(trace, H100, 0.8, 0.0).watts_per_gpu
    faded = with_floor(trace, H100, 0.8, 1.0).watts_per_gpu
    at = lambda seconds: trace.run_start + int(seconds * 100)  # noqa: E731
    assert held[at(3.0)] == pytest.approx(560.0)  # held at the floor without ramps
    assert faded[at(1.5)] == pytest.approx(max(140.0, 0.5 * 560), rel=0.03)  # half-way down the fade
    assert faded[at(3.0)] == pytest.approx(140.0)  # faded out: the save's own level
    assert faded[at(4.5)] == pytest.approx(max(140.0, 0.5 * 560), rel=0.03)  # climbing back


def test_plan_step_adds_up_to_the_planner_step_time():
    times = {"pipeline_s": 1.0, "bubble_s": 0.2, "tp_comm_s": 0.1, "pp_p2p_s": 0.05, "dp_exposed_s": 0.29,
             "tp_partial_s": 0.01, "optimizer_s": 0.02}
    parts = plan_step(times, micro_batches=4)
    assert sum(seconds for _, seconds, _ in parts) == pytest.approx(1.0 + 0.29 + 0.01 + 0.02)
    assert ("communication", pytest.approx(0.3), 0.0) in parts  # the exposed DP reduction and the TP-partial sum
    assert parts[0] == ("bubble", 0.1, 0.0) and parts[-1] == ("optimizer", 0.02, 0.0)
    computing = [(seconds, share) for phase, seconds, share in parts if phase == "compute"]
    assert len(computing) == 4 and sum(seconds for seconds, _ in computing) == pytest.approx(0.65 + 0.1)
    assert computing[0][1] == pytest.approx(0.1 / 0.75)  # TP's share of each micro-batch's time
    mixed = paint(intervals_from_plan([("compute", 1.0, 0.25)], 1, 0, 0, 0, 0), H100, 10.0, 1)
    assert np.allclose(mixed.run_part(mixed.watts_per_gpu), 0.75 * 700 + 0.25 * 315)
    intervals = intervals_from_plan(parts, steps=10, save_every=5, checkpoint_s=2.0, eval_every=0, evaluation_s=0)
    saves = [interval for interval in intervals if interval.phase == "checkpoint"]
    assert len(saves) == 2 and saves[0].start == pytest.approx(5 * 1.32)
    trace = paint(intervals, H100, 200.0, 8)
    spec = spectrum(trace.run_part(), trace.rate_hz)
    assert spec.band_fraction(0.1, 20.0) > 0.5  # a 1.32 s step: its harmonics are in the critical band
