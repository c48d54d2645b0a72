"""train.power_floor: the filler runs only while a collective is pending, and changes no number.

Two real gloo ranks (dp2, a simulated slow link so each gradient all-reduce waits long enough to
be filled; and pp2, whose stages wait on each other) train the tiny model with and without the
floor: the losses must be identical, and
rank 0's power_timeline.jsonl must show filler bursts, each starting inside a wait window and
starting its last GEMM before that window closed. The ramps' bursts lie inside the ramp and
checkpoint intervals. The filler itself is also driven by hand-opened windows.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.parallel.communication_waits import CommunicationWaits
from meshlm.training.metrics import read_metrics
from meshlm.training.phase_timeline import TIMELINE_FILE
from meshlm.training.power_floor import PHASE_POWER_FRACTION, PowerFloor, filler_duty
from meshlm.training.trainer import Trainer
from tests.helpers.counting_corpus import write_corpus
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer_runs import load_parallel_training_helpers

LINK = "parallel.simulate_link=20Mbps,20ms"  # each step's gradient all-reduce waits ~25 ms


def train_losses(blend: str, root: str, runs: list[tuple[str, list[str]]]) -> dict:
    """In each spawned rank: train each (name, overrides) run; its losses by step."""
    helpers = load_parallel_training_helpers()
    torch.set_num_threads(1)
    losses = {}
    for name, overrides in runs:
        config = helpers.run_config(Path(blend), Path(root) / name, "train.steps=4", *overrides)
        losses[name] = Trainer(config).run().losses
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("power-floor")
    blend = write_corpus(root / "corpus")
    dp2 = ["parallel.dp=2", LINK]
    runs = [("plain", dp2), ("floor", [*dp2, "train.power_floor=0.9"]),
            ("ramps", [*dp2, "train.power_floor=0.9", "train.power_ramp_seconds=0.2", "train.save_every=2"]),
            ("pp2", ["parallel.pp=2"]), ("pp2 floor", ["parallel.pp=2", "train.power_floor=0.9"])]
    results = run_distributed(train_losses, 2, str(blend), str(root), runs, timeout_s=300)
    return root, results


def waits_and_bursts(records: list[dict]):
    """Every wait window and every filler burst of a timeline, whatever line holds it (a line holds
    the phases that ended since the one before)."""
    phases = [phase for record in records for phase in record.get("phases", [])]
    waits = [phase for phase in phases if phase[0] not in ("filler", "optimizer")]
    return waits, [phase for phase in phases if phase[0] == "filler"]


def inside_a_wait(burst: list, waits: list) -> bool:
    """The burst started, and started its last GEMM, inside one wait window."""
    _, start, end, last_gemm_start, _, busy = burst
    assert 0 < busy <= end - start + 5e-6  # times are written to the microsecond
    return start <= last_gemm_start <= end and any(wait[1] <= start and last_gemm_start <= wait[2] for wait in waits)


def test_the_floor_changes_no_loss(runs):
    _, results = runs
    for rank in range(2):
        assert results[rank]["floor"] == results[rank]["plain"]  # identical, not close
        assert results[rank]["ramps"] == results[rank]["plain"]
        assert results[rank]["pp2 floor"] == results[rank]["pp2"]


def test_pipeline_waits_are_filled_too(runs):
    """pp2: the stages wait on each other's messages (the bubble); the filler fills those waits."""
    root, _ = runs
    waits, bursts = waits_and_bursts(read_metrics(root / "pp2 floor" / TIMELINE_FILE))
    assert any(wait[0] == "pp" for wait in waits)
    in_pipeline_waits = [burst for burst in bursts if inside_a_wait(burst, [wait for wait in waits if wait[0] == "pp"])]
    assert in_pipeline_waits, "the filler never ran while a stage waited"
    assert all(inside_a_wait(burst, waits) for burst in bursts if burst[4] == "wait")


def test_filler_bursts_lie_inside_pending_collective_windows(runs):
    root, _ = runs
    records = read_metrics(root / "floor" / TIMELINE_FILE)
    steps = [record for record in records if "step" in record and "start" in record and "pause" not in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4]
    waits, bursts = waits_and_bursts(records)
    assert any(wait[0] == "dp_cp" and wait[2] - wait[1] > 0.015 for wait in waits)  # the slow gradient all-reduce
    assert sum(burst[4] == "wait" for burst in bursts) >= 4, "the filler never ran"
    for burst in bursts:
        if burst[4] == "wait":
            assert inside_a_wait(burst, waits), f"filler burst {burst} started outside every wait window"
        else:  # without ramps, only the final checkpoint save is held at the floor
            assert burst[4] == "checkpoint"
    plain_waits, plain_bursts = waits_and_bursts(read_metrics(root / "plain" / TIMELINE_FILE))
    assert plain_waits and not plain_bursts  # no floor, no filler


def test_ramps_fill_only_ramps_checkpoints_and_waits(runs):
    root, _ = runs
    records = read_metrics(root / "ramps" / TIMELINE_FILE)
    ramps = {record["ramp"]: record for record in records if "ramp" in record}
    assert set(ramps) == {"start", "end"}
    for record in ramps.values():
        assert record["end"] - record["start"] >= 0.2
    checkpoints = [record for record in records if record.get("pause") == "checkpoint"]
    assert [record["step"] for record in checkpoints] == [2, 4]
    held = {"ramp": list(ramps.values()), "checkpoint": checkpoints}
    waits, bursts = waits_and_bursts(records)
    assert {burst[4] for burst in bursts} == {"wait", "ramp", "checkpoint"}
    for burst in bursts:
        if burst[4] == "wait":
            assert inside_a_wait(burst, waits)
        else:  # started inside its ramp or its save
            assert any(record["start"] <= burst[1] and burst[3] <= record["end"] for record in held[burst[4]]), burst


def test_filler_follows_hand_opened_windows():
    waits = CommunicationWaits()
    floor = PowerFloor(0.9, 0.0, torch.device("cpu"), waits)
    floor.start()
    try:
        time.sleep(0.05)
        assert floor.drain_bursts() == []  # no window, no work
        opened = []
        for group in ("dp", "pp"):
            with waits.waiting(group):
                opened.append((time.perf_counter(), group))
                time.sleep(0.06)
            time.sleep(0.03)
        windows = waits.drain()
        time.sleep(0.02)
        bursts = floor.drain_bursts()
    finally:
        floor.close()
    assert [window[0] for window in windows] == ["dp", "pp"]
    assert len(bursts) >= 2 and all(burst.gemms >= 1 for burst in bursts)
    for burst in bursts:
        assert any(start <= burst.start and burst.last_gemm_start <= end for _, start, end in windows)
    for group in ("dp", "pp"):  # GEMMs about the duty's share of each window (0.82 and 0.87): not all, not none
        window = next(window for window in windows if window[0] == group)
        inside = [burst for burst in bursts if window[1] <= burst.start <= window[2]]
        busy = sum(burst.busy for burst in inside) / (window[2] - window[1])
        duty = filler_duty(0.9, PHASE_POWER_FRACTION["bubble" if group == "pp" else "communication"])
        assert 0.4 * duty <= busy <= 1.0, (group, busy, duty)


def test_no_filler_when_waiting_already_draws_the_floor():
    waits = CommunicationWaits()
    floor = PowerFloor(PHASE_POWER_FRACTION["communication"], 0.0, torch.device("cpu"), waits)
    floor.start()
    try:
        with waits.waiting("dp"):
            time.sleep(0.05)
        time.sleep(0.02)
    finally:
        floor.close()
    assert floor.drain_bursts() == []


def test_filler_duty():
    assert filler_duty(0.45, 0.45) == 0.0
    assert filler_duty(0.3, 0.45) == 0.0
    assert filler_duty(0.725, 0.45) == pytest.approx(0.5)  # 0.45 + 0.5 * 0.55 = 0.725
    assert filler_duty(1.0, 0.2) == 1.0


def test_pause_holds_then_climbs_back():
    """A save longer than the ramp fades the floor to 0, then climbs back before returning."""
    waits = CommunicationWaits()
    floor = PowerFloor(0.9, 0.1, torch.device("cpu"), waits)
    floor._allocate()
    floor._thread = threading.Thread(target=floor._run, daemon=True)
    floor._thread.start()
    try:
        began = time.perf_counter()
        with floor.pause("checkpoint"):
            time.sleep(0.15)
        elapsed = time.perf_counter() - began
    finally:
        floor.close()
    assert elapsed >= 0.15 + 0.1 - 0.01  # faded to 0 after 0.1 s, so 0.1 s to climb back
    bursts = floor.drain_bursts()
    assert bursts and {burst.why for burst in bursts} == {"checkpoint"}


@pytest.mark.parametrize("override, field", [("train.power_floor=1.0", "train.power_floor"),
                                             ("train.power_floor=-0.1", "train.power_floor"),
                                             ("train.power_ramp_seconds=-1", "train.power_ramp_seconds"),
                                             ("train.power_ramp_seconds=2", "train.power_ramp_seconds")])
def test_bad_power_floor_settings_are_refused(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_run_config(None, [override]).validate()
