"""meshlm/training/plan_check.py: one measured-vs-predicted record, after the warm-up steps."""

from __future__ import annotations

import pytest
import torch

from meshlm.training.plan_check import PlanCheck, describe

PREDICTED = {"memory_bytes_per_gpu": 2 ** 20, "step_time_s": 0.5, "layout": "tp=1", "gpu": "cpu"}


def test_reported_once_after_the_warm_up_with_the_median_of_the_rest():
    check = PlanCheck(PREDICTED, torch.device("cpu"))
    for seconds in (9.0, 8.0):  # warm-up: left out
        check.add(seconds)
        assert check.record(len(check.step_seconds), final=False) is None
    for seconds in (1.0, 3.0, 2.0):
        check.add(seconds)
    record = check.record(5, final=False)
    assert record["event"] == "plan_check" and record["measured_step_time_s"] == 2.0
    assert record["step_time_ratio"] == 4.0 and record["timed_steps"] == 3 and not record["warmup_included"]
    assert record["measured_memory_bytes"] is not None and record["memory_ratio"] is not None
    assert "plan check at step 5: step time 2 s measured (median of 3), 0.5 s predicted (x4.00)" in describe(record)
    assert check.record(6, final=True) is None


def test_a_short_run_reports_at_its_last_step_with_the_warm_up():
    check = PlanCheck(PREDICTED, torch.device("cpu"))
    check.add(3.0)
    assert check.record(1, final=True)["warmup_included"]


def test_a_prediction_without_its_numbers_is_refused():
    with pytest.raises(ValueError, match="lacks step_time_s"):
        PlanCheck({"memory_bytes_per_gpu": 1}, torch.device("cpu"))
