"""Reward functions the RL tests name with ``train.reward_fn=tests.rl.rewards:NAME``."""

from __future__ import annotations


def sevens(prompt: str, completion: str, **fields) -> float:
    """The share of the completion's characters that are '7': a dense signal a tiny model can climb."""
    return completion.count("7") / max(len(completion), 1)


def not_a_number(prompt: str, completion: str, **fields):
    return "high"


def infinite(prompt: str, completion: str, **fields) -> float:
    return float("inf")


NOT_CALLABLE = 3
