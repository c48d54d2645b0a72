import argparse
import json

import pytest

from meshlm.cli import COMMANDS
from meshlm.data import tokenizer_training
from meshlm.data.tokenizer import load_tokenizer
from meshlm.data.tokenizer_training import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, train_tokenizer
from meshlm.errors import DataError


def test_trained_tokenizer_has_the_special_tokens_and_round_trips(tmp_path, write_jsonl, numbered_texts):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", numbered_texts(100))
    out = train_tokenizer([corpus], vocab_size=320, out=tmp_path / "tok" / "tokenizer.json")
    tokenizer = load_tokenizer(out)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert tokenizer.backend.token_to_id(BOS_TOKEN) == 0 and tokenizer.backend.token_to_id(PAD_TOKEN) == 2
    assert 259 < tokenizer.vocab_size <= 320  # bytes + specials + some merges
    text = "Shall I compare thee? Ünïcödé 🙂"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < len(text.encode())  # merges were learned
    assert tokenizer.decode(ids) == text  # byte-level: any text survives
    config = json.loads((out.parent / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)


def test_txt_and_parquet_inputs_train_too(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet
    (tmp_path / "a.txt").write_text("zyzzyva zyzzyva\n\nzyzzyva quokka\n")
    parquet.write_table(pyarrow.table({"text": ["quokka quokka zyzzyva"] * 5}), tmp_path / "b.parquet")
    tokenizer = load_tokenizer(train_tokenizer([tmp_path / "a.txt", tmp_path / "b.parquet"], 270,
                                               tmp_path / "tokenizer.json", min_frequency=1))
    assert len(tokenizer.encode("zyzzyva", add_special_tokens=False)) < len("zyzzyva")


def test_too_small_vocabulary_is_a_data_error(tmp_path, write_jsonl):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", ["hello"])
    with pytest.raises(DataError, match="--vocab-size 100 is too small.*at least 259"):
        train_tokenizer([corpus], vocab_size=100, out=tmp_path / "tokenizer.json")


def test_tokenizer_train_command(tmp_path, write_jsonl, numbered_texts, capsys):
    assert COMMANDS["tokenizer"][0] == "meshlm.data.tokenizer_training"
    corpus = write_jsonl(tmp_path / "corpus.jsonl", numbered_texts(50))
    parser = argparse.ArgumentParser()
    tokenizer_training.add_arguments(parser)
    args = parser.parse_args(["train", "--input", str(corpus), "--vocab-size", "300",
                              "--out", str(tmp_path / "t" / "tokenizer.json")])
    assert tokenizer_training.run(args) == 0
    assert load_tokenizer(tmp_path / "t").eos_token_id == 1
    assert "tokenizer.json" in capsys.readouterr().out


def test_an_input_without_text_is_refused_and_nothing_is_written(tmp_path, write_jsonl):
    good = write_jsonl(tmp_path / "good.jsonl", ["some text"] * 5)
    empty_texts = write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(DataError, match=r"empty\.jsonl: all 2 documents are empty strings under 'text'"):
        train_tokenizer([good, empty_texts], vocab_size=300, out=tmp_path / "out" / "tokenizer.json")
    (tmp_path / "zero.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"zero\.txt: the file is empty \(0 bytes\)"):
        train_tokenizer([good, tmp_path / "zero.txt"], vocab_size=300, out=tmp_path / "out" / "tokenizer.json")
    assert not (tmp_path / "out").exists()
