"""meshlm/rl/environments.py: the arithmetic questions, their scoring and the held-out split."""

from __future__ import annotations

import pytest

from meshlm.config import RLConfig
from meshlm.errors import ConfigError
from meshlm.rl.environments import ArithmeticEnvironment, arithmetic_reward, build_environment, final_number


@pytest.mark.parametrize("text, number", [("42", 42), ("The answer is 42.", 42), ("17 + 25 = 42", 42),
                                          ("-7", -7), ("it is 3, no, 5", 5), ("no digits", None), ("", None)])
def test_final_number(text, number):
    assert final_number(text) == number


def test_arithmetic_reward_is_one_for_the_right_final_number_only():
    assert arithmetic_reward("What is 17 + 25?", "42", answer=42) == 1.0
    assert arithmetic_reward("What is 17 + 25?", "17 + 25 = 42", answer=42) == 1.0
    assert arithmetic_reward("What is 17 + 25?", "42 or 43", answer=42) == 0.0
    assert arithmetic_reward("What is 3 - 9?", "-6", answer=-6) == 1.0
    assert arithmetic_reward("What is 3 - 9?", "6", answer=-6) == 0.0
    assert arithmetic_reward("What is 3 - 9?", "", answer=-6) == 0.0


def test_questions_are_seeded_answered_right_and_never_held_out():
    environment = ArithmeticEnvironment(seed=7, digits=2, operations="+-*", eval_prompts=32)
    again = ArithmeticEnvironment(seed=7, digits=2, operations="+-*", eval_prompts=32)
    records = [environment.train_record(index) for index in range(500)]
    assert records == [again.train_record(index) for index in range(500)]
    assert environment.held_out == again.held_out and len(environment.held_out) == 32
    held_out = {record["prompt"] for record in environment.held_out}
    assert not held_out & {record["prompt"] for record in records}
    for record in records + environment.held_out:
        a, operation, b = record["prompt"].removeprefix("What is ").removesuffix("?").split(" ")
        assert record["answer"] == eval(f"{a} {operation} {b}")  # noqa: S307 -- our own digits
        assert 0 <= int(a) < 100 and 0 <= int(b) < 100
    assert {record["prompt"].split(" ")[3] for record in records} == {"+", "-", "*"}
    other_seed = ArithmeticEnvironment(seed=8, digits=2, operations="+-*", eval_prompts=32)
    assert other_seed.train_record(0) != environment.train_record(0) or other_seed.held_out != environment.held_out
    assert environment.is_correct(records[0], f"= {records[0]['answer']}")


def test_too_few_questions_to_hold_out_is_refused():
    with pytest.raises(ConfigError, match="rl.eval_prompts=64"):
        ArithmeticEnvironment(seed=0, digits=1, operations="+", eval_prompts=64)


def test_unknown_environment_is_refused():
    with pytest.raises(ConfigError, match="rl.env='chess' is not a built-in environment"):
        build_environment(RLConfig(env="chess"), seed=0)
