"""bench/low_precision.py's timed trainer: every step timed, one in the middle profiled instead.

The bench itself trains the demo model under each recipe for minutes; here a tiny run shows what
``--profile TOP`` adds to a run's record and that the profiled step stays out of the timings.
"""

import pytest

from bench.low_precision import TimedTrainer, parse_args
from tests.helpers.trainer_runs import load_parallel_training_helpers

helpers = load_parallel_training_helpers()


def test_one_step_in_the_middle_is_profiled_and_not_timed(tmp_path):
    blend = helpers.write_tiny_corpus(tmp_path / "corpus")
    config = helpers.run_config(blend, tmp_path / "run", "train.steps=4", "parallel.check_collectives=false")
    trainer = TimedTrainer(config, profile_top=3)
    losses = trainer.run().losses
    assert sorted(losses) == [1, 2, 3, 4]  # the profiled step trained like the others
    assert len(trainer.step_seconds) == len(trainer.step_cpu_seconds) == 3  # step 3 (of 4) went to the profiler
    profile = trainer.profile
    assert profile["measured"] == "self_cpu_time_total" and len(profile["top"]) == 3
    milliseconds = [operator["ms"] for operator in profile["top"]]
    assert milliseconds == sorted(milliseconds, reverse=True) and 0 < sum(milliseconds) <= profile["total_ms"]
    assert profile["regions_ms"]["optimizer"] > 0  # the step's optimizer update was inside the profile


def test_without_profile_top_every_step_is_timed(tmp_path):
    blend = helpers.write_tiny_corpus(tmp_path / "corpus")
    trainer = TimedTrainer(helpers.run_config(blend, tmp_path / "run", "train.steps=3",
                                              "parallel.check_collectives=false"))
    trainer.run()
    assert len(trainer.step_seconds) == 3 and trainer.profile is None


def test_a_negative_profile_is_refused_with_one_sentence(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--profile", "-1"])
    assert "--profile -1: give how many operators to list (0, the default, profiles nothing)" in capsys.readouterr().err
