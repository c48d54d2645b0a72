"""Judging a reply against a reference answer: the default reward of a prompt file (``rl.env=prompts``).

A prompt file's record carries the answer it expects (``{"prompt": "...", "answer": 42}``), and a
verifiable reward needs a rule that reads the reply's *final* answer and compares it -- strictly,
so that a reply listing several candidates earns nothing (DeepSeek-R1 2025, §2.2.2: rule-based
accuracy rewards, the final answer in a specified format). The rule here:

- **A numeric answer** (a number, or a string that reads as one: ``"1,024"``, ``"-3.5"``): the last
  number written in the reply, thousands separators allowed, equals it (integers exactly, others to
  a relative 1e-6). "17 + 25 = 42" is right for 42; "42 or 43" is not.
- **Any other answer** (``"Paris"``, ``"B"``, ``"x^2"``): the reply's final answer is the content of
  its last ``\\boxed{...}`` if it has one, else its last non-blank line with a leading "Answer:",
  "Final answer:" or "The answer is" taken off; both sides are compared with case, surrounding
  spaces, quotes and a final full stop ignored, and runs of spaces read as one.

Both are functions of the reply text alone. A task that needs anything else -- unit tests for
code, a tolerance, several accepted answers -- sets ``train.reward_fn`` (``reward_functions.py``).
"""

from __future__ import annotations

import math
import re

NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
"""A number as replies write it: digits with an optional fraction, commas only between groups of three."""
ANSWER_PREFIX = re.compile(r"^(?:final answer|the answer is|answer)\s*[:=]?\s*", re.IGNORECASE)
BOXED = "\\boxed{"


def parse_number(text: str) -> float | int | None:
    """``text`` as a number when the whole of it is one ("1,024" -> 1024, "2.5" -> 2.5), else None."""
    text = text.strip()
    if not NUMBER.fullmatch(text):
        return None
    value = float(text.replace(",", ""))
    return int(value) if value.is_integer() and "." not in text else value


def last_number(reply: str) -> float | int | None:
    """The last number written in ``reply`` (a leading '-' counts), or None when there is none."""
    found = NUMBER.findall(reply)
    return parse_number(found[-1]) if found else None


def last_boxed(reply: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``reply`` (braces inside it balanced), or None."""
    start = reply.rfind(BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(BOXED)
    for position in range(begin, len(reply)):
        depth += {"{": 1, "}": -1}.get(reply[position], 0)
        if depth == 0:
            return reply[begin:position]
    return None


def final_answer(reply: str) -> str:
    """The reply's final answer as text: its last boxed content, else its last non-blank line
    without an "Answer:"-style prefix (module docstring)."""
    boxed = last_boxed(reply)
    if boxed is not None:
        return boxed
    lines = [line for line in reply.splitlines() if line.strip()]
    return ANSWER_PREFIX.sub("", lines[-1].strip()) if lines else ""


def normalize(text: str) -> str:
    """``text`` with case, surrounding spaces and quotes, a final full stop and repeated spaces ignored."""
    text = " ".join(text.split()).strip("\"'`").rstrip(".").strip()
    return text.casefold()


def numeric_answer(answer: object) -> float | int | None:
    """``answer`` as a number when it is one, or a string that reads as one; else None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return answer
    return parse_number(answer) if isinstance(answer, str) else None


def answer_matches(reply: str, answer: object) -> bool:
    """Whether ``reply``'s final answer is ``answer`` (module docstring)."""
    expected = numeric_answer(answer)
    if expected is not None:
        found = last_number(reply)
        if found is None:
            return False
        if isinstance(expected, int) and isinstance(found, int):
            return found == expected
        return math.isclose(found, expected, rel_tol=1e-6, abs_tol=1e-12)
    return normalize(final_answer(reply)) == normalize(str(answer))


def answer_reward(prompt: str, completion: str, answer: object, **fields) -> float:
    """1.0 when the completion's final answer is the record's ``answer``, else 0.0 (a prompt file's reward)."""
    return float(answer_matches(completion, answer))


__all__ = ["answer_matches", "answer_reward", "final_answer", "last_boxed", "last_number", "normalize",
           "numeric_answer", "parse_number"]
