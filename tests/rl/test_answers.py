"""meshlm/rl/answers.py: a reply's final answer against the record's, numbers as numbers, text normalized."""

from __future__ import annotations

import pytest

from meshlm.rl.answers import answer_matches, answer_reward, final_answer, last_boxed, parse_number


@pytest.mark.parametrize("reply, answer, right", [
    ("17 + 25 = 42", 42, True),
    ("42 or 43", 42, False),                      # the last number is the answer: listing candidates earns nothing
    ("She sold 1,024 clips.", 1024, True),
    ("She sold 1024 clips.", "1,024", True),      # a string that reads as a number is compared as one
    ("It drops by -3.5 degrees", -3.5, True),
    ("2.0", 2, True),
    ("2.5", 2, False),
    ("The answer is 7.", "7", True),
    ("no number here", 42, False),
    ("", 0, False),
    ("The capital of France is a city.\nAnswer: Paris.", "paris", True),
    ("so \\boxed{x^{2}} and then \\boxed{x^{3}}", "x^{3}", True),   # the last box, braces balanced
    ("Paris or Lyon", "Paris", False),
    ("   PARIS  ", "Paris", True),
    ("The answer is B", "B", True),
    ("Final answer: \"blue   whale\"", "Blue whale", True),
    ("B\nbut maybe C", "B", False),
])
def test_the_final_answer_is_compared_strictly(reply, answer, right):
    assert answer_matches(reply, answer) is right
    assert answer_reward("a prompt", reply, answer=answer, source="ignored") == float(right)


def test_the_pieces():
    assert parse_number("1,024") == 1024 and parse_number("1,02") is None and parse_number("-0.5") == -0.5
    assert isinstance(parse_number("3"), int) and isinstance(parse_number("3.0"), float)
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c" and last_boxed("\\boxed{open") is None and last_boxed("x") is None
    assert final_answer("work\n\nThe answer is: 12 apples\n\n") == "12 apples" and final_answer("") == ""
