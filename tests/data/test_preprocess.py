import argparse
import json

import numpy as np
import pytest

from meshlm.cli import COMMANDS, USER_ERRORS
from meshlm.data import preprocess as preprocess_module
from meshlm.data.indexed import TokenStore
from meshlm.data.preprocess import document_batches, preprocess
from meshlm.data.tokenizer import Tokenizer, load_tokenizer
from meshlm.errors import DataError


def expected_documents(tokenizer, texts, append_eos):
    eos = [tokenizer.eos_token_id] if append_eos else []
    return [tokenizer.encode(text, add_special_tokens=False) + eos for text in texts]


@pytest.mark.parametrize("append_eos", [False, True])
def test_jsonl_store_holds_exactly_the_directly_encoded_documents(tmp_path, tokenizer_path, write_jsonl,
                                                                  numbered_texts, append_eos):
    texts = numbered_texts(40) + [""]
    result = preprocess([write_jsonl(tmp_path / "a.jsonl", texts)], tokenizer_path, tmp_path / "out",
                        append_eos=append_eos, show_progress=False)
    store = TokenStore(tmp_path / "out")
    expected = expected_documents(load_tokenizer(tokenizer_path), texts, append_eos)
    assert [store.document(index).tolist() for index in range(len(store))] == expected
    assert (result.num_documents, result.num_tokens) == (len(texts), sum(map(len, expected)))
    assert store.dtype == np.uint16 and store.vocab_size == load_tokenizer(tokenizer_path).vocab_size


def test_txt_and_parquet_inputs_in_file_order(tmp_path, tokenizer_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet
    (tmp_path / "a.txt").write_text("first block\nof text\n\nsecond block\n")
    parquet.write_table(pyarrow.table({"body": ["parquet one", "parquet two"]}), tmp_path / "b.parquet")
    preprocess([tmp_path / "a.txt", tmp_path / "b.parquet"], tokenizer_path, tmp_path / "out",
               text_key="body", show_progress=False)
    store = TokenStore(tmp_path / "out")
    texts = ["first block\nof text", "second block", "parquet one", "parquet two"]
    expected = expected_documents(load_tokenizer(tokenizer_path), texts, False)
    assert [store.document(index).tolist() for index in range(len(store))] == expected


def test_output_is_identical_for_one_and_two_workers(tmp_path, tokenizer_path, write_jsonl, numbered_texts,
                                                     monkeypatch):
    monkeypatch.setattr(preprocess_module, "BATCH_DOCUMENTS", 7)  # many small batches, so order matters
    inputs = [write_jsonl(tmp_path / f"{name}.jsonl", numbered_texts(count)) for name, count in (("a", 60), ("b", 33))]
    for workers in (1, 2):
        preprocess(inputs, tokenizer_path, tmp_path / f"w{workers}", workers=workers, append_eos=True,
                   show_progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1{suffix}").read_bytes() == (tmp_path / f"w2{suffix}").read_bytes()
    assert len(TokenStore(tmp_path / "w2")) == 93


def test_a_compressed_corpus_gives_the_plain_corpus_store_byte_for_byte(tmp_path, tokenizer_path, write_jsonl,
                                                                        numbered_texts, capsys):
    import gzip
    zstandard = pytest.importorskip("zstandard")
    plain = write_jsonl(tmp_path / "a.jsonl", numbered_texts(50))
    (tmp_path / "z").mkdir()
    (tmp_path / "z/a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    (tmp_path / "z/b.txt.gz").write_bytes(gzip.compress(b"one\n\ntwo\n"))
    (tmp_path / "b.txt").write_text("one\n\ntwo\n")
    preprocess([plain, tmp_path / "b.txt"], tokenizer_path, tmp_path / "plain", append_eos=True, show_progress=False)
    result = preprocess([tmp_path / "z"], tokenizer_path, tmp_path / "packed", workers=2, append_eos=True)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"plain{suffix}").read_bytes() == (tmp_path / f"packed{suffix}").read_bytes()
    assert result.num_documents == 52
    compressed_bytes = sum(path.stat().st_size for path in (tmp_path / "z").iterdir())
    assert compressed_bytes < 1000  # so tqdm writes the count unscaled
    assert f"{compressed_bytes}/{compressed_bytes} [" in capsys.readouterr().err  # the bar counts file bytes


def test_batches_never_cross_files_and_number_documents(tmp_path, write_jsonl):
    inputs = [write_jsonl(tmp_path / "a.jsonl", ["1", "2", "3"]), write_jsonl(tmp_path / "b.jsonl", ["4"])]
    batches = list(document_batches(inputs, "text", lambda count: None, max_documents=2))
    assert [(batch.source.split("/")[-1], batch.first_document, batch.texts) for batch in batches] == [
        ("a.jsonl", 1, ["1", "2"]), ("a.jsonl", 3, ["3"]), ("b.jsonl", 1, ["4"])]


def test_wrong_key_in_a_worker_names_the_file_and_line(tmp_path, tokenizer_path, write_jsonl):
    good = write_jsonl(tmp_path / "good.jsonl", ["fine"] * 3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"txt": "oops"}) + "\n")
    for workers in (1, 2):
        with pytest.raises(DataError, match=r"bad\.jsonl, line 2: no key 'text' \(keys here: 'txt'\)"):
            preprocess([good, bad], tokenizer_path, tmp_path / "out", workers=workers, show_progress=False)
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.bin.tmp").exists()


def test_token_ids_beyond_the_vocabulary_name_the_source(tmp_path, tokenizer_path, write_jsonl, monkeypatch):
    monkeypatch.setattr(Tokenizer, "vocab_size", property(lambda self: 10))  # a tokenizer that lies
    source = write_jsonl(tmp_path / "a.jsonl", ["many different tokens here"])
    with pytest.raises(DataError, match=r"out\.bin: token id \d+ from .*a\.jsonl \(documents 1-1\) is outside"):
        preprocess([source], tokenizer_path, tmp_path / "out", show_progress=False)


def test_unreadable_input_and_missing_eos_are_data_errors(tmp_path, tokenizer_path, write_jsonl):
    assert DataError in USER_ERRORS
    with pytest.raises(DataError, match=r"nothere\.jsonl: no such input"):
        preprocess([tmp_path / "nothere.jsonl"], tokenizer_path, tmp_path / "out", show_progress=False)
    no_eos_dir = tmp_path / "no_eos"
    no_eos_dir.mkdir()
    backend = load_tokenizer(tokenizer_path).backend
    backend.save(str(no_eos_dir / "tokenizer.json"))
    (no_eos_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-there|>"}))
    with pytest.raises(DataError, match="--append-eos needs an end-of-sequence token"):
        preprocess([write_jsonl(tmp_path / "a.jsonl", ["x"])], no_eos_dir, tmp_path / "out", append_eos=True)


def test_preprocess_command_with_plain_progress_line(tmp_path, tokenizer_path, write_jsonl, numbered_texts,
                                                      capsys, monkeypatch):
    assert COMMANDS["preprocess"][0] == "meshlm.data.preprocess"
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # tqdm is optional
    source = write_jsonl(tmp_path / "a.jsonl", numbered_texts(20))
    parser = argparse.ArgumentParser()
    preprocess_module.add_arguments(parser)
    args = parser.parse_args(["--input", str(source), "--tokenizer", str(tokenizer_path), "--out",
                              str(tmp_path / "out"), "--workers", "2", "--append-eos"])
    assert preprocess_module.run(args) == 0
    captured = capsys.readouterr()
    assert "20 documents" in captured.out and "\rpreprocess: 100.0%" in captured.err
    assert len(TokenStore(tmp_path / "out")) == 20


def test_the_store_records_its_tokenizer_relative_to_itself(tmp_path, tokenizer_path, write_jsonl):
    source = write_jsonl(tmp_path / "a.jsonl", ["one document", "two documents"])
    preprocess([source], tokenizer_path.parent, tmp_path / "stores" / "out", append_eos=True,
               show_progress=False)  # a tokenizer folder: the file in it is recorded
    store = TokenStore(tmp_path / "stores" / "out")
    assert store.recorded_tokenizer().resolve() == tokenizer_path.resolve()
    assert not store.metadata["tokenizer"].startswith("/")  # relative, like a blend file's paths
    assert {key: store.metadata[key] for key in ("tokenizer_vocab_size", "append_eos", "text_key", "txt_documents")} \
        == {"tokenizer_vocab_size": load_tokenizer(tokenizer_path).vocab_size, "append_eos": True,
            "text_key": "text", "txt_documents": "paragraph"}


@pytest.mark.parametrize("mode, expected", [(None, ["first\nblock", "second block"]),
                                            ("paragraph", ["first\nblock", "second block"]),
                                            ("file", ["first\nblock\n\nsecond block"])])
def test_txt_documents_flag_decides_where_txt_documents_end(tmp_path, tokenizer_path, mode, expected):
    (tmp_path / "a.txt").write_text("first\nblock\n\nsecond block\n")
    parser = argparse.ArgumentParser()
    preprocess_module.add_arguments(parser)
    assert "blank line" in parser.format_help()  # --help says what each mode does
    flags = [] if mode is None else ["--txt-documents", mode]
    args = parser.parse_args(["--input", str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer_path), "--out",
                              str(tmp_path / "out"), "--no-progress", *flags])
    assert preprocess_module.run(args) == 0
    store = TokenStore(tmp_path / "out")
    assert [store.document(index).tolist() for index in range(len(store))] == expected_documents(
        load_tokenizer(tokenizer_path), expected, False)
    assert store.metadata["txt_documents"] == (mode or "paragraph")


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_without_text_is_refused_and_leaves_no_output(tmp_path, tokenizer_path, write_jsonl, workers):
    good = write_jsonl(tmp_path / "good.jsonl", ["fine"] * 3)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    with pytest.raises(DataError, match=r"blank\.txt: no documents in this file"):
        preprocess([good, blank], tokenizer_path, tmp_path / "new" / "out", workers=workers, show_progress=False)
    assert not (tmp_path / "new").exists()  # no store, no temporary files, not even the folder
    (tmp_path / "zero.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"zero\.jsonl: the file is empty"):
        preprocess([good, tmp_path / "zero.jsonl"], tokenizer_path, tmp_path / "new" / "out", show_progress=False)
    assert not (tmp_path / "new").exists()
