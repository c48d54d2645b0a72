"""meshlm/rl/reward_functions.py: loading train.reward_fn, and the one-sentence errors."""

from __future__ import annotations

import pytest

from meshlm.config import load_run_config
from meshlm.errors import ConfigError
from meshlm.rl.reward_functions import load_reward_fn, score
from tests.rl import rewards

RECORD = {"prompt": "What is 3 + 4?", "answer": 7}


def test_a_reward_function_loads_and_gets_the_record_fields():
    function = load_reward_fn("tests.rl.rewards:sevens")
    assert function is rewards.sevens
    assert score(function, "f", RECORD, "77x7") == 0.75
    seen = {}

    def spy(prompt, completion, **fields):
        seen.update(prompt=prompt, completion=completion, **fields)
        return True  # a bool counts as 1.0

    assert score(spy, "spy", RECORD, "7") == 1.0
    assert seen == {"prompt": "What is 3 + 4?", "completion": "7", "answer": 7}


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_here:f", "module 'no_such_module_here' does not import"),
    ("tests.rl.rewards:missing", "has no function 'missing'"),
    ("tests.rl.rewards:NOT_CALLABLE", "has no function 'NOT_CALLABLE'"),
])
def test_a_reward_function_that_does_not_load_is_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_reward_fn(spec)


@pytest.mark.parametrize("name", ["not_a_number", "infinite"])
def test_a_reward_that_is_not_a_finite_number_is_refused(name):
    function = load_reward_fn(f"tests.rl.rewards:{name}")
    with pytest.raises(ConfigError, match=r"must return a finite number"):
        score(function, f"train.reward_fn=tests.rl.rewards:{name}", RECORD, "7")


@pytest.mark.parametrize("override, message", [
    ("train.reward_fn=rewards.sevens", "must look like module:function"),
    ("rl.group_size=1", "rl.group_size=1 must be >= 2"),
    ("rl.clip_epsilon=1.5", r"rl.clip_epsilon=1.5 must lie in \(0, 1\)"),
    ("rl.kl_coeff=-0.1", "rl.kl_coeff=-0.1 must be >= 0"),
    ("rl.loss_averaging=batch", "rl.loss_averaging='batch' is not one of sequence, token"),
    ("rl.operations=+/", "rl.operations='\\+/' must be some of"),
    ("rl.temperature=0", "rl.temperature=0.0 must be > 0"),
    ("rl.epochs=0", "rl.epochs=0 must be a positive integer"),
])
def test_bad_rl_settings_are_refused_in_one_sentence(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, [override])
