"""Fixtures of the chat tests: the small BPE with the chat markers and the think tags, as
``meshlm preprocess --chat`` writes it, and the tokenizer loaded from it."""

import pytest

from meshlm.data.tokenizer import load_tokenizer
from tests.helpers.chat_tokenizers import write_reasoning_chat_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """A 300-token BPE plus the template markers and the think tags, as `meshlm preprocess --chat` writes it."""
    return write_reasoning_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer_dir):
    return load_tokenizer(chat_tokenizer_dir / "tokenizer.json")
