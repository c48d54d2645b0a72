"""meshlm/rl/prompt_file.py: a prompt file's held-out split, its epoch-shuffled training stream, and
every bad record refused at start-up with its file and line."""

from __future__ import annotations

import gzip
import json

import pytest

from meshlm.config import RLConfig, load_run_config
from meshlm.errors import ConfigError
from meshlm.rl.environments import build_environment
from meshlm.rl.prompt_file import PromptFileEnvironment


def write_prompts(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


QUESTIONS = [{"prompt": f"What is {a} + {a + 1}?", "answer": 2 * a + 1, "level": a % 3} for a in range(40)]


def test_held_out_prompts_never_train_and_every_epoch_visits_each_training_prompt_once(tmp_path):
    duplicate = {**QUESTIONS[5], "level": "copy"}
    path = write_prompts(tmp_path / "q.jsonl", [*QUESTIONS, duplicate])
    environment = PromptFileEnvironment(path, seed=3, eval_prompts=8, prompts_per_step=4)
    again = PromptFileEnvironment(path, seed=3, eval_prompts=8, prompts_per_step=4)
    held_out = {record["prompt"] for record in environment.held_out}
    assert len(environment.held_out) == 8 and environment.held_out == again.held_out
    training = environment.training
    assert not held_out & {record["prompt"] for record in training}  # duplicates of held-out prompts left out
    assert len(training) == 41 - 8 - (QUESTIONS[5]["prompt"] in held_out)
    stream = [environment.train_record(index) for index in range(3 * len(training))]
    assert stream == [again.train_record(index) for index in range(3 * len(training))]  # a function of (seed, i)
    epochs = [stream[start:start + len(training)] for start in range(0, len(stream), len(training))]
    for epoch in epochs:
        assert sorted(map(json.dumps, epoch)) == sorted(map(json.dumps, training))
    assert epochs[0] != epochs[1] != epochs[2]  # a new order every epoch
    assert environment.train_record(5) == again.train_record(5)  # read back in any order, as a resume does
    other = PromptFileEnvironment(path, seed=4, eval_prompts=8, prompts_per_step=4)
    assert other.held_out != environment.held_out
    assert all("level" in record and "answer" in record for record in stream)  # fields reach the reward


def test_a_compressed_file_and_a_json_array_read_as_the_plain_file(tmp_path):
    plain = write_prompts(tmp_path / "q.jsonl", QUESTIONS)
    (tmp_path / "q.jsonl.gz").write_bytes(gzip.compress((tmp_path / "q.jsonl").read_bytes()))
    (tmp_path / "q.json").write_text(json.dumps(QUESTIONS))
    environments = [PromptFileEnvironment(str(path), 1, 4, 2) for path in (plain, tmp_path / "q.jsonl.gz",
                                                                            tmp_path / "q.json")]
    assert environments[0].held_out == environments[1].held_out == environments[2].held_out
    assert [environments[0].train_record(i) for i in range(50)] == [environments[2].train_record(i) for i in range(50)]


def test_the_default_reward_and_accuracy_judge_the_final_answer(tmp_path):
    environment = PromptFileEnvironment(write_prompts(tmp_path / "q.jsonl", QUESTIONS), 0, 4, 2)
    record = {"prompt": "What is 2 + 3?", "answer": 5}
    assert environment.reward(record["prompt"], "2 + 3 = 5", answer=5) == 1.0
    assert environment.reward(record["prompt"], "5 or 6", answer=5) == 0.0
    assert environment.is_correct(record, "it is 5") is True and environment.is_correct(record, "4") is False
    assert environment.is_correct({"prompt": "Write a haiku."}, "...") is None  # the reward function's to judge


@pytest.mark.parametrize("lines, needs_answers, message", [
    (['{"prompt": "a", "answer": 1}', "[1, 2]"], True, r"q\.jsonl, line 2: a JSON list, not an object"),
    (['{"question": "a", "answer": 1}'], True, r"q\.jsonl, line 1: needs a non-empty string under 'prompt', or "
                                              r"'messages' ending with a user turn \(keys here: 'question', "
                                              r"'answer'\)"),
    (['{"prompt": "  ", "answer": 1}'], True, r"line 1: needs a non-empty string under 'prompt'"),
    (['{"prompt": "a"}'], True, r"line 1: no 'answer'; without train.reward_fn .* or set train.reward_fn"),
    (['{"prompt": "a", "answer": [1, 2]}'], True, r"line 1: 'answer' \[1, 2\]; without train.reward_fn"),
    (['{"prompt": "a", "answer": 1}', "{oops"], True, r"q\.jsonl, line 2: not valid JSON .* each line must be one "
                                                       r"\{\"prompt\""),
    (['{"prompt": "a"}'] * 3, False, r"holds 3 prompts \(0 once rl.eval_prompts=2 and their duplicates are held "
                                      r"out\), too few .* lower rl.eval_prompts or add prompts"),
])
def test_bad_prompt_files_are_refused_naming_the_line(tmp_path, lines, needs_answers, message):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        PromptFileEnvironment(str(path), 0, eval_prompts=2, prompts_per_step=1, needs_answers=needs_answers)


def test_records_without_answers_are_fine_with_a_reward_function(tmp_path):
    path = write_prompts(tmp_path / "q.jsonl", [{"prompt": f"Write {index} sevens.", "count": index}
                                                  for index in range(10)])
    environment = build_environment(RLConfig(env="prompts", prompts=path, eval_prompts=2, prompts_per_step=2), 0,
                                    needs_answers=False)
    assert len(environment.held_out) == 2 and len(environment.training) == 8


@pytest.mark.parametrize("overrides, message", [
    (["rl.env=prompts"], "rl.env=prompts reads its prompts from a file: set rl.prompts=FILE.jsonl"),
    (["rl.prompts=q.jsonl"], "rl.prompts=q.jsonl is read only by rl.env=prompts, and rl.env=arithmetic"),
    (["rl.env=chess"], "rl.env='chess' is not a built-in environment \\(arithmetic, prompts\\)"),
])
def test_settings_that_cannot_go_together_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, overrides)


def test_a_missing_file_is_named():
    with pytest.raises(ConfigError, match=r"rl.prompts=nowhere.jsonl: no such file"):
        PromptFileEnvironment("nowhere.jsonl", 0, 2, 1)


def test_messages_and_system_turns_are_part_of_a_prompt(tmp_path):
    context = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"},
               {"role": "assistant", "content": "2"}, {"role": "user", "content": "And 2 + 2?"}]
    records = [{"messages": context, "answer": 4}, {"prompt": "And 2 + 2?", "answer": 4},
               {"prompt": "And 2 + 2?", "system": "Think.", "answer": 4}, *QUESTIONS[:10]]
    environment = PromptFileEnvironment(write_prompts(tmp_path / "q.jsonl", records), 0, eval_prompts=2,
                                        prompts_per_step=1)
    first, second, third = environment.records[:3]
    assert first["prompt"] == "And 2 + 2?" and first["messages"] == context  # the reward's prompt: the last user turn
    contexts = {json.dumps([r.get("messages"), r.get("system"), r["prompt"]]) for r in environment.records[:3]}
    assert len(contexts) == 3  # the same question in three contexts: three prompts, none a duplicate of another
    assert len(environment.training) + len(environment.held_out) == len(records)


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "answer": 1},
     "'messages' must be a list of .* ending with the user turn the policy answers"),
    ({"messages": "What is 1 + 1?", "answer": 2}, "'messages' must be a list"),
    ({"prompt": "a", "system": 3, "answer": 1}, "'system' must be a string"),
])
def test_bad_contexts_are_refused(tmp_path, record, message):
    with pytest.raises(ConfigError, match=message):
        PromptFileEnvironment(write_prompts(tmp_path / "q.jsonl", [record] * 4), 0, 1, 1)
