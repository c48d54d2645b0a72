"""Reading documents out of text files, one at a time, never a whole file at once.

Pretraining corpora are often larger than memory, so every reader here is a generator: it
holds one line (``.jsonl``, ``.txt``) or one batch of rows (``.parquet``, ``.arrow``) at a time, and the
tokenizer trainer and the preprocessor pull documents through it. What a *document* is:

- ``.jsonl``: one JSON object per line; the document is the string under ``text_key``
  (``"text"`` by default). Blank lines are skipped.
- ``.json``: JSON Lines as well (C4 ships ``.json.gz`` files of them), or one JSON array of
  objects, which is read whole (``jsonl.py``).
- ``.txt``: with ``txt_documents="paragraph"`` (the default, ``--txt-documents paragraph``)
  documents are separated by one or more blank lines (a paragraph, a poem, a function). We
  chose blocks as the default because a block can be streamed whatever the file's size. With
  ``txt_documents="file"`` the whole file is one document (e.g. one source file, which has
  blank lines inside it); that document is held in memory whole, so give very large texts
  as ``.jsonl`` lines instead. Either way the trailing line break is dropped, and blank lines
  alone are no document.
- ``.parquet`` and ``.arrow`` (Hugging Face ``datasets``' ``save_to_disk`` and cache files): the
  string column ``text_key``, read in batches of rows with ``pyarrow`` (an optional dependency:
  ``pip install pyarrow``; ``columnar.py``).

``.jsonl``, ``.json`` and ``.txt`` files may be compressed -- ``corpus.jsonl.zst``,
``c4-train.00000-of-01024.json.gz``, ``notes.txt.xz`` -- and are decompressed as they are read
(``compression.py``). A directory given as input is searched for all of these, except plain
``.json`` files: configs, blends and tokenizers are ``.json`` files that often sit beside the
data, so a plain ``.json`` file is read only when named.

Errors name the file and the line (or row), and for a missing key the keys that do exist. A
file that holds no document (empty, or blank lines only), or only empty ones, is refused by
name: it is almost always the wrong file or the wrong ``--text-key``, and tokenizing it would
silently add nothing.
Readers report how many bytes of the file they have consumed through ``on_bytes`` so a
progress bar can move while one large file is being read.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

from meshlm.data.columnar import FORMAT_NAMES, read_column
from meshlm.data.compression import COMPRESSIONS, compression_of, content_suffix, read_lines
from meshlm.data.jsonl import JSON_SUFFIXES, json_records
from meshlm.errors import ConfigError, DataError

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".arrow")
"""What an input file may hold; the text ones may also be compressed (COMPRESSIONS)."""
COLUMNAR_SUFFIXES = (".parquet", ".arrow")
SUPPORTED_TYPES = ".jsonl, .json, .txt, .parquet or .arrow, the first three also compressed (.gz, .bz2, .xz, .zst)"
TXT_DOCUMENT_MODES = ("paragraph", "file")
"""How a ``.txt`` file is cut into documents: at blank lines, or not at all (see above)."""

ByteCounter = Callable[[int], None]


def is_supported(path: Path) -> bool:
    """Whether ``path``'s name says it holds documents this module reads (module docstring)."""
    suffix = content_suffix(path)
    if compression_of(path):
        return suffix in SUPPORTED_SUFFIXES and suffix not in COLUMNAR_SUFFIXES
    return suffix in SUPPORTED_SUFFIXES


def unsupported(path: Path) -> DataError:
    if compression_of(path) and content_suffix(path) in COLUMNAR_SUFFIXES:
        return DataError(f"{path}: a {FORMAT_NAMES[content_suffix(path)]} file is read in place, batch by batch, "
                         "and cannot be read compressed; decompress it "
                         f"(`{COMPRESSIONS[compression_of(path)][1].split()[0]} -d`) first.")
    named = "".join(path.suffixes[-2:]) if compression_of(path) else path.suffix or "(none)"
    return DataError(f"{path}: unsupported input type {named!r}; use {SUPPORTED_TYPES}.")


def expand_inputs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The input files named by ``paths``: files as given, directories searched recursively
    (sorted, so the order and hence the token store are reproducible) for the supported types,
    plain ``.json`` files left out (module docstring)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and is_supported(p) and p.suffix.lower() != ".json")
            if not found:
                raise DataError(f"{path}: no input files in this directory (files of {SUPPORTED_TYPES}; "
                                "a plain .json file is read only when named).")
            files.extend(found)
        elif not path.exists():
            raise DataError(f"{path}: no such input file or directory.")
        elif not is_supported(path):
            raise unsupported(path)
        else:
            files.append(path)
    if not files:
        raise DataError("no input files given; pass --input FILE [FILE ...].")
    for path in files:  # refused here, before any output is started
        if path.stat().st_size == 0:
            raise DataError(f"{path}: the file is empty (0 bytes), so it holds no documents; "
                            "delete it or leave it out of --input.")
    return files


def read_documents(path: str | os.PathLike, text_key: str = "text", on_bytes: ByteCounter | None = None,
                   txt_documents: str = "paragraph") -> Iterator[str]:
    """Yield the documents of one file, in file order (see the module docstring)."""
    path = Path(path)
    on_bytes = on_bytes or (lambda count: None)
    check_txt_documents(txt_documents)
    if not is_supported(path):
        raise unsupported(path)
    suffix = content_suffix(path)
    if suffix in JSON_SUFFIXES:
        return _refuse_if_empty(path, _read_json(path, text_key, on_bytes), f"under {text_key!r}")
    if suffix == ".txt":
        read_txt = _read_txt_file if txt_documents == "file" else _read_txt_paragraphs
        return _refuse_if_empty(path, read_txt(path, on_bytes), "")
    return _refuse_if_empty(path, read_column(path, text_key, on_bytes), f"in column {text_key!r}")


def read_whole_text(path: str, option: str, what: str) -> str:
    """The whole UTF-8 text of the file ``path`` a command-line ``option`` names (``-``: standard
    input), newlines kept; ``what`` it holds ("the prompt") words the one sentence of a ConfigError
    when it cannot be read."""
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{option} {path}: no such file; give the path of a text file holding {what}.") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{option} {path}: not UTF-8 text (byte {error.start}); save {what} as UTF-8.") from None
    except OSError as error:
        raise ConfigError(f"{option} {path}: cannot read it ({error.strerror}).") from None


def check_txt_documents(txt_documents: str) -> None:
    if txt_documents not in TXT_DOCUMENT_MODES:
        raise DataError(f"--txt-documents {txt_documents!r} is not a way to split .txt files; "
                        f"use one of {', '.join(TXT_DOCUMENT_MODES)}.")


def read_all_documents(paths: Iterable[Path], text_key: str = "text", on_bytes: ByteCounter | None = None,
                       txt_documents: str = "paragraph") -> Iterator[str]:
    """The documents of several files, one file after the other."""
    for path in paths:
        yield from read_documents(path, text_key, on_bytes, txt_documents)


def _refuse_if_empty(path: Path, documents: Iterator[str], where: str) -> Iterator[str]:
    """``documents``, passed through; at their end, a DataError if there was no text at all."""
    count, any_text = 0, False
    for text in documents:
        count += 1
        any_text = any_text or bool(text)
        yield text
    if count == 0:
        raise DataError(f"{path}: no documents in this file (it holds only blank lines, or no rows); "
                        "delete it or leave it out of --input.")
    if not any_text:
        what = "its one document is an empty string" if count == 1 else f"all {count} documents are empty strings"
        raise DataError(f"{path}: {what}{' ' + where if where else ''}, so there is nothing to tokenize; "
                        "check --text-key, or leave the file out of --input.")


def _read_json(path: Path, text_key: str, on_bytes: ByteCounter) -> Iterator[str]:
    for where, record in json_records(path, on_bytes, "each line of a .jsonl file must be one JSON object"):
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object with a {text_key!r} key, "
                            f"found a {type(record).__name__}.")
        if text_key not in record:
            raise DataError(f"{where}: no key {text_key!r} (keys here: "
                            f"{', '.join(map(repr, record)) or 'none'}); pass --text-key with the right one.")
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{where}: {text_key!r} holds a {type(text).__name__}, not a string.")
        yield text


def _text_lines(path: Path, on_bytes: ByteCounter) -> Iterator[str]:
    for line_number, raw in read_lines(path, on_bytes):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"{path}, line {line_number}: not UTF-8 text ({error}); "
                            "re-encode the file as UTF-8.") from error
        yield line


def _read_txt_file(path: Path, on_bytes: ByteCounter) -> Iterator[str]:
    text = "".join(_text_lines(path, on_bytes))
    if text.strip():
        yield text.rstrip("\r\n")


def _read_txt_paragraphs(path: Path, on_bytes: ByteCounter) -> Iterator[str]:
    block: list[str] = []
    for line in _text_lines(path, on_bytes):
        if line.strip():
            block.append(line)
        elif block:
            yield "".join(block).rstrip("\r\n")
            block = []
    if block:
        yield "".join(block).rstrip("\r\n")
