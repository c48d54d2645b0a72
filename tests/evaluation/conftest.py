"""Fixtures of the evaluation tests: one tiny saved model with its tokenizer, held-out text as a
text file and as a token store (built once per session), and the multiple-choice task file."""

import pytest

from meshlm.data.tokenizer import load_tokenizer
from tests.evaluation.reference import PARAGRAPHS, TASK_FILE, save_tiny_model, train_tokenizer, write_store


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    return tmp_path_factory.mktemp("evaluation")


@pytest.fixture(scope="session")
def tokenizer_dir(workspace):
    return train_tokenizer(workspace / "tokenizer")


@pytest.fixture(scope="session")
def model_dir(workspace, tokenizer_dir):
    return save_tiny_model(workspace / "model", tokenizer_dir)


@pytest.fixture(scope="session")
def text_file(workspace):
    path = workspace / "held_out.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def store_prefix(workspace, tokenizer_dir):
    """The paragraphs of ``text_file``, tokenized as `meshlm preprocess` does, in a token store."""
    tokenizer = load_tokenizer(tokenizer_dir)
    return write_store(workspace / "held_out", tokenizer.encode_batch(PARAGRAPHS, add_special_tokens=False))


@pytest.fixture(scope="session")
def task_file():
    return TASK_FILE
