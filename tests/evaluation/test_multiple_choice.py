"""``meshlm/evaluation/multiple_choice.py``: each choice's score is its log-likelihood after the
context from one plain forward; the prediction is the best score (per character for
acc_norm); task files with a mistake are refused naming the line."""

import json
import math

import numpy as np
import pytest

from meshlm.checkpoint.model_files import load_model
from meshlm.errors import ConfigError, DataError
from meshlm.evaluation.loading import load_for_evaluation
from meshlm.evaluation.multiple_choice import evaluate_task, read_task
from tests.evaluation.reference import QUESTIONS, choice_loglikelihood

SEQ_LEN = 32


@pytest.fixture(scope="module")
def evaluation(model_dir):
    return load_for_evaluation(model_dir, device="cpu")


def sample_stderr(correct: np.ndarray) -> float:
    return float(np.std(correct, ddof=1) / math.sqrt(len(correct)))


@pytest.mark.parametrize("batch_size", [1, 5])
def test_the_choice_with_the_highest_loglikelihood_is_picked(evaluation, model_dir, task_file, batch_size):
    result = evaluate_task(evaluation, read_task(task_file), SEQ_LEN, batch_size)
    model, tokenizer = load_model(model_dir), evaluation.tokenizer
    expected = [[choice_loglikelihood(model, tokenizer, question["context"], choice) for choice in question["choices"]]
                for question in QUESTIONS]
    for scores, reference in zip(result.loglikelihoods, expected):
        assert scores == pytest.approx(reference, rel=1e-5, abs=1e-5)
    answers = np.array([question["answer"] for question in QUESTIONS])
    correct = np.array([np.argmax(scores) for scores in expected]) == answers
    per_character = [np.array(scores) / [len(choice) for choice in question["choices"]]
                     for scores, question in zip(expected, QUESTIONS)]
    correct_norm = np.array([np.argmax(scores) for scores in per_character]) == answers
    assert 0 < correct.sum() < len(QUESTIONS)  # the check means something: some right, some wrong
    assert result.questions == len(QUESTIONS)
    assert result.acc == correct.mean() and result.acc_norm == correct_norm.mean()
    assert result.acc_stderr == pytest.approx(sample_stderr(correct.astype(float)), rel=1e-12)
    assert result.acc_norm_stderr == pytest.approx(sample_stderr(correct_norm.astype(float)), rel=1e-12)


def test_query_and_gold_spellings_and_blank_lines(tmp_path):
    path = tmp_path / "spellings.jsonl"
    path.write_text('{"query": "the cat", "choices": ["sat", "ran"], "gold": 1}\n\n'
                    '{"context": "a dog", "choices": ["x", "y", "z"], "answer": 2}\n')
    first, second = read_task(path)
    assert (first.context, first.choices, first.answer) == ("the cat", ["sat", "ran"], 1)
    assert (second.context, second.answer) == ("a dog", 2)


def test_a_gzipped_task_file_and_a_json_array_read_as_the_plain_file(tmp_path):
    import gzip
    questions = [{"context": "the cat", "choices": ["sat", "ran"], "answer": 1},
                 {"context": "a dog", "choices": ["x", "y", "z"], "answer": 2}]
    plain = tmp_path / "task.jsonl"
    plain.write_text("".join(json.dumps(question) + "\n" for question in questions))
    (tmp_path / "task.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "task.json").write_text(json.dumps(questions))
    expected = read_task(plain)
    assert [question.answer for question in expected] == [1, 2]
    assert read_task(tmp_path / "task.jsonl.gz") == expected == read_task(tmp_path / "task.json")


@pytest.mark.parametrize("lines, message", [
    (['{"context": "a", "choices": ["b", "c"], "answer": 0}', '{"context": "a", "choices": ["b", "c"], "answer": 0'],
     r"bad.jsonl, line 2: not valid JSON \(.*\); each line is one \{\"context\""),
    (['{"context": "a", "choices": ["b", "c"], "answer": 2}'],
     r"bad.jsonl, line 1: answer index 2 is out of range for 2 choices \(valid: 0 to 1\)\."),
    (['{"context": "a", "choices": ["b"], "answer": 0}'],
     r"bad.jsonl, line 1: 'choices' must be a list of at least two non-empty strings"),
    (['{"prompt": "a", "choices": ["b", "c"], "answer": 0}'],
     r"bad.jsonl, line 1: needs a string under 'context' \(or 'query'\); found keys \['answer', 'choices', 'prompt'\]"),
    (['{"context": "a", "choices": ["b", "c"], "answer": "b"}'],
     r"bad.jsonl, line 1: 'answer' \(or 'gold'\) must be the index of the right choice, got 'b'"),
    (['', '  '], r"bad.jsonl: holds no questions"),
])
def test_task_file_mistakes_name_the_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        read_task(path)


def test_missing_task_file(tmp_path):
    with pytest.raises(DataError, match=r"nowhere.jsonl: no such task file; pass a JSON-lines file"):
        read_task(tmp_path / "nowhere.jsonl")


def test_an_answer_longer_than_the_window_is_refused(evaluation, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"context": "the cat", "choices": ["sat on the mat " * 4, "ran"], "answer": 0}) + "\n")
    with pytest.raises(ConfigError, match=r"an answer of \d+ tokens does not fit in a window of --seq-len 8 tokens"):
        evaluate_task(evaluation, read_task(path), 8, 2)
