"""bench/local_sgd.py's bookkeeping: the common warm-up timed alike, medians over repeats, the
time to a target loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.local_sgd import (NO_LINK, apply_device_defaults, link_share, main, median_run, same_warmup_time, seconds_to,
                             speedup)


def test_common_warmup_is_rescaled_and_later_steps_keep_their_durations():
    curve = {0: (0.0, 6.0), 16: (20.0, 5.5), 32: (40.0, 5.0), 48: (52.0, 4.8), 64: (60.0, 4.7)}
    aligned = same_warmup_time(curve, 32, 30.0)
    assert aligned[0] == (0.0, 6.0)
    assert aligned[16] == pytest.approx((15.0, 5.5))  # the shared phase scaled by 30 / 40
    assert aligned[32] == pytest.approx((30.0, 5.0))
    assert aligned[48] == pytest.approx((42.0, 4.8))  # 12 s after the warm-up, as measured
    assert aligned[64] == pytest.approx((50.0, 4.7))
    assert same_warmup_time(curve, 0, None) is curve  # no common phase: unchanged


def test_median_run_takes_median_seconds_and_refuses_different_losses():
    runs = [{"curve": {0: (0.0, 6.0), 8: (seconds, 5.0)}, "train_seconds": seconds, "dp_bytes": 10}
            for seconds in (9.0, 12.0, 10.0)]
    median = median_run(runs)
    assert median["curve"][8] == (10.0, 5.0) and median["train_seconds"] == 10.0
    assert median["train_seconds_each"] == [9.0, 12.0, 10.0] and median["dp_bytes"] == 10
    runs[1]["curve"][8] = (12.0, 5.1)
    with pytest.raises(RuntimeError, match="not reproducible"):
        median_run(runs)


def test_seconds_to_target_interpolates_between_evaluations():
    curve = {0: (0.0, 6.0), 8: (10.0, 5.0), 16: (20.0, 4.0)}
    assert seconds_to(curve, 4.5) == pytest.approx(15.0)
    assert seconds_to(curve, 6.5) == pytest.approx(0.0)
    assert seconds_to(curve, 3.0) is None


def test_speedup_is_ddp_seconds_over_the_runs_and_none_where_either_misses_the_target():
    ddp = {0: (0.0, 6.0), 8: (10.0, 5.0), 16: (20.0, 4.0)}
    trailing_then_cheaper = {0: (0.0, 6.0), 8: (6.0, 5.5), 16: (12.0, 4.5), 24: (18.0, 3.9)}
    assert speedup(ddp, trailing_then_cheaper, 5.0) == pytest.approx(10.0 / 9.0, abs=1e-3)  # 6 + 6 * 0.5 / 1.0
    assert speedup(ddp, trailing_then_cheaper, 4.0) == pytest.approx(20.0 / (12.0 + 6.0 * 0.5 / 0.6), abs=1e-3)
    assert speedup(ddp, trailing_then_cheaper, 3.95) is None  # DDP never gets there
    assert speedup(ddp, {0: (0.0, 6.0), 8: (5.0, 5.2)}, 5.0) is None  # the run never gets there


def test_repeats_below_one_are_refused_before_any_run(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--repeats", "0"])
    assert stopped.value.code == 2
    assert "--repeats 0: run the plan at least once" in capsys.readouterr().err


def test_steps_batch_and_micro_batch_default_by_device_and_are_kept_when_given():
    def defaults(device, **given):
        return apply_device_defaults(SimpleNamespace(**{"device": device, "steps": None, "global_batch": None,
                                                        "micro_batch": None, **given}))
    cpu, cuda, given = defaults("cpu"), defaults("cuda"), defaults("cuda", steps=32, micro_batch=8)
    assert (cpu.steps, cpu.global_batch, cpu.micro_batch) == (64, 64, 4)
    assert (cuda.steps, cuda.global_batch, cuda.micro_batch) == (128, 128, 32)  # a replica's batch in one pass
    assert (given.steps, given.global_batch, given.micro_batch) == (32, 128, 8)


@pytest.mark.parametrize("argv, message", [
    (["--global-batch", "24"], "--global-batch 24: use a multiple of 16 (4 replicas x micro-batches of 4)"),
    (["--device", "cuda", "--global-batch", "64"], "--global-batch 64: use a multiple of 128"),
    (["--micro-batch", "0"], "--micro-batch 0: give each forward at least one sequence"),
])
def test_a_batch_that_does_not_split_into_micro_batches_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_validation_keeps_sixteen_sequences_or_one_micro_batch():
    from pathlib import Path

    from bench.local_sgd import run_overrides

    def eval_batches(micro_batch):
        args = SimpleNamespace(model="hybrid", micro_batch=micro_batch, global_batch=128, link="1Gbps,5ms",
                               device="cpu")
        overrides = run_overrides(args, Path("run"), steps=8, eval_every=8)
        assert f"train.micro_batch_size={micro_batch}" in overrides
        return next(item for item in overrides if item.startswith("train.eval_batches="))

    assert eval_batches(4) == "train.eval_batches=4"  # the CPU figures' 16 sequences
    assert eval_batches(32) == "train.eval_batches=1"


def test_link_share_is_the_part_of_ddp_time_the_link_run_adds():
    runs = {"ddp": {"train_seconds": 80.0}, NO_LINK: {"train_seconds": 76.0}, "diloco H=8": {"train_seconds": 70.0}}
    assert link_share(runs) == pytest.approx(0.05)  # at most 1 / 0.95 = 1.05x faster at DDP's computation
    del runs[NO_LINK]
    assert link_share(runs) is None


def test_an_overlap_interval_below_two_is_refused_before_any_run(capsys):
    with pytest.raises(SystemExit):
        main(["--overlap-at", "1"])
    assert "--overlap-at [1]: give sync intervals H of at least 2." in capsys.readouterr().err


def test_the_moe_model_all_reduces_ten_times_the_bytes_for_the_same_flops_a_token():
    from pathlib import Path

    from bench.local_sgd import DEMO_CONFIG, MODELS, run_overrides
    from meshlm.adapt.cli import parameter_count
    from meshlm.config import load_run_config
    from meshlm.models.flops import model_flops_per_sequence

    def model(name):
        args = SimpleNamespace(model=name, micro_batch=4, global_batch=64, link="1Gbps,5ms", device="cpu")
        return load_run_config(DEMO_CONFIG, run_overrides(args, Path("run"), steps=8, eval_every=8)).model

    hybrid, moe = model("hybrid"), model("moe")
    assert set(MODELS) == {"hybrid", "moe"}
    assert (hybrid.block_kinds.count("E"), moe.block_kinds.count("E"), moe.moe_num_experts) == (1, 4, 64)
    assert parameter_count(hybrid) == pytest.approx(1.3e6, rel=0.05)
    assert parameter_count(moe) == pytest.approx(13.5e6, rel=0.05)
    # The same FLOPs a token but for four 64-way routers (2.4% more): only the bytes a DDP step all-reduces grow.
    assert model_flops_per_sequence(moe, 128) == pytest.approx(model_flops_per_sequence(hybrid, 128), rel=0.03)
