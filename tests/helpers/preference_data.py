"""Preference data for the reward-model and DPO tests, over the counting corpus's word-level
tokenizer (``t0`` ... ``t62``; the chat markers are added by ``meshlm preprocess --preference``).

A *separable* pair set: each prompt is three random words, each reply four random words with a
marker word in the middle -- ``t61`` in the chosen reply, ``t60`` in the rejected one -- so a reward
model that learns to spot the marker ranks every pair right, and held-out pairs test exactly that.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshlm.data.preference import preprocess_preference

CHOSEN_MARKER, REJECTED_MARKER = "t61", "t60"


def separable_pairs(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(count):
        prompt = " ".join(f"t{word}" for word in rng.integers(0, 60, 3))
        words = [f"t{word}" for word in rng.integers(0, 60, 4)]
        reply = lambda marker: " ".join(words[:2] + [marker] + words[2:])  # noqa: E731
        pairs.append({"prompt": prompt, "chosen": reply(CHOSEN_MARKER), "rejected": reply(REJECTED_MARKER)})
    return pairs


def rated_replies(count: int, seed: int) -> list[dict]:
    """Replies rated on two attributes: 'length' = the reply's word count, 'marker' = 1 when it
    holds ``t61`` (else 0); a few lack the 'length' rating."""
    rng = np.random.default_rng(seed)
    examples = []
    for index in range(count):
        words = [f"t{word}" for word in rng.integers(0, 60, int(rng.integers(1, 5)))]
        marked = bool(rng.integers(0, 2))
        if marked:
            words.insert(len(words) // 2, CHOSEN_MARKER)
        scores = {"marker": float(marked)} if index % 7 == 3 else {"length": float(len(words)), "marker": float(marked)}
        examples.append({"messages": [{"role": "user", "content": f"t{int(rng.integers(0, 60))}"},
                                      {"role": "assistant", "content": " ".join(words)}], "scores": scores})
    return examples


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def write_store(folder: Path, records: list[dict], tokenizer: Path, name: str = "prefs") -> Path:
    """The preference store ``folder/name`` of ``records``; returns its prefix."""
    folder.mkdir(parents=True, exist_ok=True)
    preprocess_preference([write_jsonl(folder / f"{name}.jsonl", records)], tokenizer, folder / name,
                          max_vocab_size=128)
    return folder / name


__all__ = ["CHOSEN_MARKER", "REJECTED_MARKER", "rated_replies", "separable_pairs", "write_jsonl", "write_store"]
