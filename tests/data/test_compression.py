"""``meshlm/data/compression.py``: compressed text inputs read as the file they hold, a damaged or
truncated one refused by name, and the progress counted in bytes of the file."""

import bz2
import gzip
import json
import lzma
import sys

import pytest

from meshlm.data.compression import content_suffix, read_lines
from meshlm.data.readers import expand_inputs, read_documents
from meshlm.errors import DataError

zstandard = pytest.importorskip("zstandard")

COMPRESSORS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
               ".zst": lambda data: zstandard.ZstdCompressor().compress(data)}
CHECKS = {".gz": "gzip -t", ".bz2": "bzip2 -t", ".xz": "xz -t", ".zst": "zstd -t"}


def jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


TEXTS = [f"document {index} " + "words " * (index % 50) for index in range(3000)]


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_a_compressed_jsonl_yields_the_plain_files_documents_and_counts_file_bytes(tmp_path, suffix):
    path = tmp_path / f"corpus.jsonl{suffix}"
    path.write_bytes(COMPRESSORS[suffix](jsonl_bytes(TEXTS)))
    seen = []
    assert list(read_documents(path, on_bytes=seen.append)) == TEXTS
    assert sum(seen) == path.stat().st_size and min(seen) >= 0


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_txt_paragraphs_are_read_through_the_compression(tmp_path, suffix):
    path = tmp_path / f"notes.TXT{suffix.upper()}"  # suffixes in any case
    path.write_bytes(COMPRESSORS[suffix]("one\nstill one\n\ntwo\n".encode()))
    assert list(read_documents(path)) == ["one\nstill one", "two"]


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_concatenated_gzip_members_and_zstd_frames_are_read_whole(tmp_path, suffix):
    path = tmp_path / f"joined.jsonl{suffix}"
    path.write_bytes(COMPRESSORS[suffix](jsonl_bytes(TEXTS[:10])) + COMPRESSORS[suffix](jsonl_bytes(TEXTS[10:20])))
    assert list(read_documents(path)) == TEXTS[:20]


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_a_truncated_file_is_refused_naming_it_and_the_check(tmp_path, suffix):
    """zstandard's own stream reader ends a cut .zst silently; ours must not."""
    whole = COMPRESSORS[suffix](jsonl_bytes(TEXTS))
    path = tmp_path / f"cut.jsonl{suffix}"
    path.write_bytes(whole[:len(whole) * 2 // 3])
    with pytest.raises(DataError) as caught:
        list(read_documents(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: cannot decompress") and f"`{CHECKS[suffix]} cut.jsonl{suffix}`" in message


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
def test_a_file_that_is_not_what_its_name_says_is_refused(tmp_path, suffix):
    path = tmp_path / f"plain.jsonl{suffix}"
    path.write_bytes(jsonl_bytes(["not compressed at all"]) * 100)
    with pytest.raises(DataError, match=rf"plain\.jsonl\{suffix}: cannot decompress this \w+ file"):
        list(read_documents(path))


def test_a_missing_zstandard_gives_an_install_hint(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(COMPRESSORS[".zst"](jsonl_bytes(["x"])))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import now raises ImportError
    with pytest.raises(DataError, match=r"a\.jsonl\.zst: reading \.zst files needs zstandard; .*pip install zstandard"):
        list(read_documents(path))


def test_content_suffix_and_line_numbers(tmp_path):
    assert [content_suffix(name) for name in ("c4.json.gz", "a.JSONL", "a.gz", "b.txt")] == [".json", ".jsonl", "",
                                                                                                ".txt"]
    path = tmp_path / "lines.txt.xz"
    path.write_bytes(lzma.compress(b"a\n\nb"))
    assert list(read_lines(path)) == [(1, b"a\n"), (2, b"\n"), (3, b"b")]


def test_directories_find_compressed_inputs_but_not_plain_json_and_parquet_gz_is_refused(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("a.jsonl.zst", "b.json.gz", "c.txt.bz2", "tokenizer.json", "d.parquet.gz", "e.tar.gz"):
        (folder / name).write_bytes(b"x")
    assert expand_inputs([folder]) == [folder / "a.jsonl.zst", folder / "b.json.gz", folder / "c.txt.bz2"]
    with pytest.raises(DataError, match=r"d\.parquet\.gz: a Parquet file is read in place.*`gzip -d`"):
        expand_inputs([folder / "d.parquet.gz"])
    with pytest.raises(DataError, match=r"e\.tar\.gz: unsupported input type '\.tar\.gz'; use \.jsonl, \.json"):
        expand_inputs([folder / "e.tar.gz"])
    assert expand_inputs([folder / "tokenizer.json"]) == [folder / "tokenizer.json"]  # named: read
