"""Multiple-choice tasks (HellaSwag, ARC, MMLU, ...) scored by log-likelihood.

A task file is JSON lines, one question a line (a ``.json`` file may hold one JSON array of them
instead, and either may be compressed: ``meshlm/data/jsonl.py``):

    {"context": "The chef cracked the eggs", "choices": ["into a bowl.", "into the sky."], "answer": 0}

(``query`` is accepted for ``context`` and ``gold`` for ``answer``, the spellings of
lm-evaluation-harness's processed datasets). The model is never asked to write an answer: each
choice is scored by the summed log-probability of its tokens after the context,

    score(c) = sum_t log p(c_t | context, c_<t),

the choice appended to the context after one space (lm-evaluation-harness's default target
delimiter) and tokenized as that harness does (``scoring.encode_pair``). The prediction is the
highest score (``acc``), or the highest score per character of the choice (``acc_norm``: a
longer answer has more tokens to pay for, HellaSwag's normalisation, as lm-evaluation-harness
computes it). Each accuracy comes with its standard error over questions, sqrt(p(1-p)/(n-1))
in the sample form lm-evaluation-harness reports, so a task run there and here gives the same
numbers on the same items.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.data.jsonl import json_records
from meshlm.errors import DataError
from meshlm.evaluation.loading import EvaluationModel
from meshlm.evaluation.scoring import TARGET_DELIMITER, encode_pair, prefix_token, score_continuations

TASK_LINE_FORMAT = '{"context": "...", "choices": ["...", "..."], "answer": INDEX}'


@dataclass
class Question:
    context: str
    choices: list[str]
    answer: int
    """Index of the right choice."""


@dataclass
class TaskResult:
    name: str
    questions: int
    acc: float
    acc_stderr: float | None
    acc_norm: float
    acc_norm_stderr: float | None
    loglikelihoods: list[list[float]]
    """Each question's choice scores, in file order."""

    def to_dict(self, with_scores: bool = False) -> dict:
        summary = {"task": self.name, "questions": self.questions, "acc": self.acc, "acc_stderr": self.acc_stderr,
                   "acc_norm": self.acc_norm, "acc_norm_stderr": self.acc_norm_stderr}
        return {**summary, "loglikelihoods": self.loglikelihoods} if with_scores else summary


def read_task(path: str | Path) -> list[Question]:
    """The questions of a JSON-lines task file, each checked; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such task file; pass a JSON-lines file with one {TASK_LINE_FORMAT} per line.")
    questions = [parse_question(record, where)
                 for where, record in json_records(path, line_hint=f"each line is one {TASK_LINE_FORMAT}")]
    if not questions:
        raise DataError(f"{path}: holds no questions; write one {TASK_LINE_FORMAT} per line.")
    return questions


def parse_question(record: object, where: str) -> Question:
    """``record`` (one parsed line, found at ``where``) as a checked Question."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object; each line is one {TASK_LINE_FORMAT}.")
    context = record.get("context", record.get("query"))
    if not isinstance(context, str):
        raise DataError(f"{where}: needs a string under 'context' (or 'query'); found keys {sorted(record)}.")
    choices = record.get("choices")
    if (not isinstance(choices, list) or len(choices) < 2
            or not all(isinstance(choice, str) and choice for choice in choices)):
        raise DataError(f"{where}: 'choices' must be a list of at least two non-empty strings, got {choices!r}.")
    answer = record.get("answer", record.get("gold"))
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise DataError(f"{where}: 'answer' (or 'gold') must be the index of the right choice, got {answer!r}.")
    if not 0 <= answer < len(choices):
        raise DataError(f"{where}: answer index {answer} is out of range for {len(choices)} choices "
                        f"(valid: 0 to {len(choices) - 1}).")
    return Question(context, choices, answer)


def mean_and_stderr(correct: np.ndarray) -> tuple[float, float | None]:
    """Mean and its standard error, sample stddev / sqrt(n) (None for a single question)."""
    mean = float(correct.mean())
    if len(correct) < 2:
        return mean, None
    return mean, math.sqrt(float(((correct - mean) ** 2).sum()) / (len(correct) - 1)) / math.sqrt(len(correct))


def evaluate_task(evaluation: EvaluationModel, questions: list[Question], seq_len: int, batch_size: int,
                  name: str = "task") -> TaskResult:
    """Score every choice of every question (split over the data-parallel ranks) and count."""
    tokenizer = evaluation.tokenizer
    if tokenizer is None:
        raise DataError(f"{evaluation.directory}: no tokenizer found beside the model, and multiple-choice "
                        "questions are text; pass --tokenizer PATH.")
    requests = [encode_pair(tokenizer, question.context, TARGET_DELIMITER + choice, prefix_token(tokenizer))
                for question in questions for choice in question.choices]
    rank, world = evaluation.work_rank
    scores, _ = score_continuations(evaluation.model, requests, seq_len, batch_size, evaluation.work_group,
                                    rank, world)
    per_question, first = [], 0
    for question in questions:
        per_question.append(scores[first:first + len(question.choices)])
        first += len(question.choices)
    answers = np.array([question.answer for question in questions])
    predicted = np.array([np.argmax(score) for score in per_question])
    predicted_norm = np.array([np.argmax(score / np.array([len(choice) for choice in question.choices], dtype=float))
                               for score, question in zip(per_question, questions)])
    acc, acc_stderr = mean_and_stderr((predicted == answers).astype(float))
    acc_norm, acc_norm_stderr = mean_and_stderr((predicted_norm == answers).astype(float))
    return TaskResult(name, len(questions), acc, acc_stderr, acc_norm, acc_norm_stderr,
                      [score.tolist() for score in per_question])


__all__ = ["Question", "TaskResult", "evaluate_task", "mean_and_stderr", "parse_question", "read_task"]
