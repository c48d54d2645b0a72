"""Fixtures for the data tests: tiny corpora and a tiny byte-level BPE tokenizer.

(Tests run in pytest's importlib mode, so helpers are handed out as fixtures, not imported.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshlm.data.tokenizer_training import train_tokenizer

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.",
    "Ünïcödé text, emoji 🙂 and tabs\tstay byte-exact.",
    "short",
]


def write_jsonl_file(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: text, "id": index}) + "\n" for index, text in enumerate(texts)))
    return path


def make_numbered_texts(count: int) -> list[str]:
    """``count`` distinct documents of varied length."""
    return [f"document {index}: " + " ".join(SAMPLE_TEXTS[index % len(SAMPLE_TEXTS)] for _ in range(1 + index % 3))
            for index in range(count)]


@pytest.fixture
def write_jsonl():
    return write_jsonl_file


@pytest.fixture
def numbered_texts():
    return make_numbered_texts


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer with 300 tokens trained on the sample texts."""
    directory = tmp_path_factory.mktemp("tokenizer")
    corpus = write_jsonl_file(directory / "corpus.jsonl", make_numbered_texts(200))
    return train_tokenizer([corpus], vocab_size=300, out=directory / "tokenizer.json")
