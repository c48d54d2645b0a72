"""bench/post_training.py: the worked replies, no held-out question in the SFT or pretraining data,
and the standard errors of the summary (the bench itself runs for minutes; these pieces do not)."""

from __future__ import annotations

import json
import math

import pytest

from bench import post_training
from meshlm.config import load_run_config
from meshlm.rl.environments import build_environment, final_number


def record(a: int, b: int) -> dict:
    return {"prompt": f"What is {a} + {b}?", "answer": a + b}


@pytest.mark.parametrize("a, b, reply", [
    (47, 38, "47 + 38 = 7+8=15 4+3+1=8 so 85"),
    (5, 38, "5 + 38 = 5+8=13 0+3+1=4 so 43"),
    (99, 99, "99 + 99 = 9+9=18 9+9+1=19 so 198"),
    (0, 0, "0 + 0 = 0+0=0 so 0"),
    (21, 3, "21 + 3 = 1+3=4 2+0=2 so 24"),
])
def test_worked_replies_write_each_column_with_its_carry(a, b, reply):
    assert post_training.worked(record(a, b)) == reply
    assert final_number(reply) == a + b  # the reward reads the last number
    assert post_training.fact(record(a, b)) == f"{a} + {b} = {a + b}"


def test_worked_refuses_other_operations():
    with pytest.raises(SystemExit, match="--operations +"):
        post_training.worked({"prompt": "What is 7 - 5?", "answer": 2})


def test_no_held_out_question_reaches_the_sft_or_pretraining_data(tmp_path):
    args = post_training.parse_args(["--task", "worked", "--digits", "2", "--operations", "+", "--held-out", "256",
                                     "--sft-examples", "3000"])
    facts, chats = post_training.write_data(args, tmp_path)
    config = load_run_config(None, post_training.common_overrides(args))
    environment = build_environment(config.rl, config.train.seed)
    held_out = {post_training.worked(r).split(" = ")[0] for r in environment.held_out}
    asked = [json.loads(line)["messages"] for line in chats.read_text().splitlines()]
    assert len(asked) == 3000
    assert not {messages[0]["content"] for messages in asked} & environment.held_out_prompts
    stated = {line.split(" = ")[0].removeprefix("What is ").split("?")[-1].strip()
              for document in facts.read_text().splitlines() for line in json.loads(document)["text"].split("\n")}
    assert len(stated) > 1000 and not stated & held_out


def test_the_summary_reports_standard_errors_and_the_gain():
    args = post_training.parse_args(["--task", "worked", "--operations", "+", "--held-out", "200"])
    evaluations = {name: {"accuracy": correct / 200, "correct": correct, "prompts": 200,
                          "standard_error": post_training.standard_error(correct / 200, 200)}
                   for name, correct in (("sft", 100), ("rl", 150))}
    report = post_training.summary(args, evaluations, [{"reward_mean": 0.5, "kl": 0.0}], {}, 1.0)
    assert report["standard_error"] == {"sft": round(math.sqrt(0.25 / 200), 4), "rl": round(math.sqrt(0.1875 / 200), 4)}
    assert report["rl_gain"] == 0.25
    assert report["rl_gain_standard_error"] == pytest.approx(math.sqrt(0.25 / 200 + 0.1875 / 200))
    assert report["rl_gain_beyond_2_standard_errors"] and report["each_stage_improves"]
