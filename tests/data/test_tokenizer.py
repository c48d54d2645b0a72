import json

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import DataError

SENTENCES = ["the cat sat on the mat.", "a dog sat on a log.", "the cat and the dog are friends.",
             "on the mat the cat sleeps; on the log the dog waits."] * 4


def write_tiny_tokenizer(directory, special_tokens=("<|endoftext|>", "<pad>")):
    """Train a byte-level BPE on a few sentences and save it as directory/tokenizer.json."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(SENTENCES, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    return backend


def test_loads_from_a_directory_or_the_file_and_round_trips(tmp_path):
    backend = write_tiny_tokenizer(tmp_path)
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        tokenizer = load_tokenizer(path)
        ids = tokenizer.encode("the cat sat on the log.")
        assert ids == backend.encode("the cat sat on the log.").ids
        assert len(ids) < len("the cat sat on the log.")  # merges were learned and applied
        assert tokenizer.decode(ids) == "the cat sat on the log."
        assert tokenizer.encode_batch(["a dog", "the mat"]) == [tokenizer.encode("a dog"), tokenizer.encode("the mat")]
        assert tokenizer.vocab_size == backend.get_vocab_size()


def test_special_tokens_found_among_common_spellings(tmp_path):
    backend = write_tiny_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.eos_token_id == backend.token_to_id("<|endoftext|>")
    assert tokenizer.bos_token_id == backend.token_to_id("<|endoftext|>")  # GPT-2 uses one token for both
    assert tokenizer.pad_token_id == backend.token_to_id("<pad>")
    assert tokenizer.decode(tokenizer.encode("a dog") + [tokenizer.eos_token_id]) == "a dog"


def test_special_tokens_without_any_known_spelling_are_none(tmp_path):
    write_tiny_tokenizer(tmp_path, special_tokens=("<|stop|>",))
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (None, None, None)


def test_tokenizer_config_beside_the_file_names_the_special_tokens(tmp_path):
    backend = write_tiny_tokenizer(tmp_path, special_tokens=("<|stop|>", "<|start|>", "<pad>"))
    config = {"eos_token": "<|stop|>", "bos_token": {"content": "<|start|>", "lstrip": False}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    assert tokenizer.eos_token_id == backend.token_to_id("<|stop|>")
    assert tokenizer.bos_token_id == backend.token_to_id("<|start|>")
    assert tokenizer.pad_token_id == backend.token_to_id("<pad>")  # not configured: common spelling


def test_missing_tokenizer_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        load_tokenizer(tmp_path / "no_such_dir")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_corrupt_files_name_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": "half a file')
    with pytest.raises(DataError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("not json")
    with pytest.raises(DataError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
