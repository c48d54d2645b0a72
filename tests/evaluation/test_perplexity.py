"""``meshlm/evaluation/perplexity.py``: perplexity is exp of the model's own loss over the same
windows; bits per byte is that loss over the text's UTF-8 bytes; a token store and the text it
was made from give the same numbers."""

import json
import math

import numpy as np
import pytest

from meshlm.checkpoint.files import write_json_atomic
from meshlm.checkpoint.model_files import load_model
from meshlm.errors import DataError
from meshlm.evaluation.loading import load_for_evaluation
from meshlm.evaluation.perplexity import evaluate_perplexity, open_sources
from tests.evaluation.reference import PARAGRAPHS, forward_nll, save_tiny_model, write_store

SEQ_LEN = 16


@pytest.fixture(scope="module")
def evaluation(model_dir):
    return load_for_evaluation(model_dir, device="cpu")


def stream_of(prefix) -> list[int]:
    return np.fromfile(f"{prefix}.bin", dtype=np.uint16).astype(int).tolist()


@pytest.mark.parametrize("batch_size", [1, 3])
def test_perplexity_is_exp_of_the_forward_loss(evaluation, model_dir, store_prefix, batch_size):
    tokens = stream_of(store_prefix)
    assert (len(tokens) - 1) % SEQ_LEN, "the last window should be a short one"
    [result] = evaluate_perplexity(evaluation, open_sources([str(store_prefix)], None), SEQ_LEN, batch_size)
    nats, count = forward_nll(load_model(model_dir), tokens, SEQ_LEN)
    assert result.tokens == count == len(tokens) - 1
    assert result.loss == pytest.approx(nats / count, rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(nats / count), rel=1e-6)


def test_a_store_without_a_tokenizer_has_no_bits_per_byte(tmp_path, store_prefix):
    evaluation = load_for_evaluation(save_tiny_model(tmp_path / "bare", tokenizer_dir=None), device="cpu")
    assert evaluation.tokenizer is None
    [result] = evaluate_perplexity(evaluation, open_sources([str(store_prefix)], None), SEQ_LEN, 4)
    assert result.bytes is None and result.bits_per_byte is None and result.tokens > 0


def test_bits_per_byte_is_the_loss_over_the_texts_utf8_bytes(evaluation, text_file, store_prefix):
    from_text, from_store = evaluate_perplexity(
        evaluation, open_sources([str(text_file), str(store_prefix)], evaluation.tokenizer), SEQ_LEN, 4)
    text_bytes = sum(len(paragraph.encode("utf-8")) for paragraph in PARAGRAPHS)
    assert text_bytes > sum(len(paragraph) for paragraph in PARAGRAPHS)  # non-ASCII letters: bytes, not characters
    assert from_text.bytes == from_store.bytes == text_bytes  # the store's bytes come from decoding its tokens
    assert from_text.bits_per_byte == pytest.approx(from_text.loss * from_text.tokens / (text_bytes * math.log(2)),
                                                    rel=1e-12)
    assert (from_text.tokens, from_text.nats) == (from_store.tokens, pytest.approx(from_store.nats, rel=1e-12))
    total = from_text + from_store
    assert (total.tokens, total.bytes) == (2 * from_text.tokens, 2 * text_bytes)
    assert total.bits_per_byte == pytest.approx(from_text.bits_per_byte, rel=1e-12)


def test_append_eos_scores_the_end_of_text_tokens_too(evaluation, text_file):
    [plain] = evaluate_perplexity(evaluation, open_sources([str(text_file)], evaluation.tokenizer), SEQ_LEN, 4)
    [with_eos] = evaluate_perplexity(
        evaluation, open_sources([str(text_file)], evaluation.tokenizer, append_eos=True), SEQ_LEN, 4)
    assert with_eos.tokens == plain.tokens + len(PARAGRAPHS)
    assert with_eos.bytes == plain.bytes


def test_missing_data_names_the_path(evaluation, tmp_path):
    with pytest.raises(DataError, match=r"valid_missing: no such token store \(.*valid_missing.bin \+ .*\.idx\)"):
        open_sources([str(tmp_path / "valid_missing")], evaluation.tokenizer)


def test_text_without_a_tokenizer_asks_for_one(text_file):
    with pytest.raises(DataError, match="held_out.txt: text needs a tokenizer.*--tokenizer PATH"):
        open_sources([str(text_file)], None)


def test_token_ids_beyond_the_models_vocabulary_are_refused(evaluation, tmp_path):
    prefix = write_store(tmp_path / "wide", [[1, 2, 3], [400, 5]], vocab_size=1000)
    with pytest.raises(DataError, match=r"wide: token id 400 is outside the model's vocabulary \[0, 320\)"):
        evaluate_perplexity(evaluation, open_sources([str(prefix)], None), SEQ_LEN, 2)


def test_default_window_is_the_training_seq_len(tmp_path, tokenizer_dir):
    directory = save_tiny_model(tmp_path / "trained", tokenizer_dir)
    config = json.loads((directory / "config.json").read_text())
    write_json_atomic(directory / "config.json", {**config, "run": {"train": {"seq_len": 48}}})
    assert load_for_evaluation(directory, device="cpu").default_seq_len == 48
    assert load_for_evaluation(save_tiny_model(tmp_path / "plain", None), device="cpu").default_seq_len == 1024
