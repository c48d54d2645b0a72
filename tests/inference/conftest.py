"""Fixtures of the inference tests: a tiny saved model with a small BPE (``meshlm generate``), and
for the chat tests the small BPE with the chat markers and the think tags, as ``meshlm preprocess
--chat`` writes it, and the tokenizer loaded from it."""

import pytest

from meshlm.checkpoint.model_files import save_model
from meshlm.data.tokenizer import load_tokenizer
from tests.helpers.chat_tokenizers import write_reasoning_chat_tokenizer
from tests.helpers.generation_model import thinking_model, tiny_model, write_sentence_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """A 300-token BPE plus the template markers and the think tags, as `meshlm preprocess --chat` writes it."""
    return write_reasoning_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer_dir):
    return load_tokenizer(chat_tokenizer_dir / "tokenizer.json")


@pytest.fixture
def tokenizer_dir(tmp_path):
    return write_sentence_tokenizer(tmp_path / "tokenizer")


@pytest.fixture
def model_dir(tmp_path, tokenizer_dir):
    return save_model(tiny_model(), tmp_path / "model", tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory, chat_tokenizer_dir, tokenizer):
    """A saved model that always answers ``<think> cat dog</think> mat<|end|>`` (``thinking_model``)."""
    return save_model(thinking_model(tokenizer), tmp_path_factory.mktemp("thinking_model") / "model",
                      tokenizer_dir=chat_tokenizer_dir)
