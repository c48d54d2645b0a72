"""Reading documents out of text files, one at a time, never a whole file at once.

Pretraining corpora are often larger than memory, so every reader here is a generator: it
holds one line (``.jsonl``, ``.txt``) or one batch of rows (``.parquet``) at a time, and the
tokenizer trainer and the preprocessor pull documents through it. What a *document* is:

- ``.jsonl``: one JSON object per line; the document is the string under ``text_key``
  (``"text"`` by default). Blank lines are skipped.
- ``.txt``: with ``txt_documents="paragraph"`` (the default, ``--txt-documents paragraph``)
  documents are separated by one or more blank lines (a paragraph, a poem, a function). We
  chose blocks as the default because a block can be streamed whatever the file's size. With
  ``txt_documents="file"`` the whole file is one document (e.g. one source file, which has
  blank lines inside it); that document is held in memory whole, so give very large texts
  as ``.jsonl`` lines instead. Either way the trailing line break is dropped, and blank lines
  alone are no document.
- ``.parquet``: the string column ``text_key``, read in batches of rows with ``pyarrow``
  (an optional dependency: ``pip install pyarrow``).

Errors name the file and the line (or row), and for a missing key the keys that do exist. A
file that holds no document (empty, or blank lines only), or only empty ones, is refused by
name: it is almost always the wrong file or the wrong ``--text-key``, and tokenizing it would
silently add nothing.
Readers report how many bytes of the file they have consumed through ``on_bytes`` so a
progress bar can move while one large file is being read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

from meshlm.errors import DataError

SUPPORTED_SUFFIXES = (".jsonl", ".txt", ".parquet")
TXT_DOCUMENT_MODES = ("paragraph", "file")
"""How a ``.txt`` file is cut into documents: at blank lines, or not at all (see above)."""
PARQUET_BATCH_ROWS = 1024

ByteCounter = Callable[[int], None]


def expand_inputs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The input files named by ``paths``: files as given, directories searched recursively
    (sorted, so the order and hence the token store are reproducible)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
            if not found:
                raise DataError(f"{path}: no {', '.join(SUPPORTED_SUFFIXES)} files in this directory.")
            files.extend(found)
        elif not path.exists():
            raise DataError(f"{path}: no such input file or directory.")
        elif path.suffix not in SUPPORTED_SUFFIXES:
            raise DataError(f"{path}: unsupported input type {path.suffix!r}; "
                            f"use one of {', '.join(SUPPORTED_SUFFIXES)}.")
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
    if path.suffix == ".jsonl":
        return _refuse_if_empty(path, _read_jsonl(path, text_key, on_bytes), f"under {text_key!r}")
    if path.suffix == ".txt":
        read_txt = _read_txt_file if txt_documents == "file" else _read_txt_paragraphs
        return _refuse_if_empty(path, read_txt(path, on_bytes), "")
    if path.suffix == ".parquet":
        return _refuse_if_empty(path, _read_parquet(path, text_key, on_bytes), f"in column {text_key!r}")
    raise DataError(f"{path}: unsupported input type {path.suffix!r}; use one of {', '.join(SUPPORTED_SUFFIXES)}.")


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


def _open_lines(path: Path, on_bytes: ByteCounter) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) pairs; an I/O failure becomes a DataError naming the file."""
    try:
        with open(path, "rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                on_bytes(len(raw))
                yield line_number, raw
    except OSError as error:
        raise DataError(f"{path}: cannot read this file ({error.strerror or error}); "
                        "check that it exists and is readable.") from error


def _read_jsonl(path: Path, text_key: str, on_bytes: ByteCounter) -> Iterator[str]:
    for line_number, raw in _open_lines(path, on_bytes):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataError(f"{path}, line {line_number}: not valid JSON ({error}); "
                            "each line of a .jsonl file must be one JSON object.") from error
        if not isinstance(record, dict):
            raise DataError(f"{path}, line {line_number}: expected a JSON object with a {text_key!r} key, "
                            f"found a {type(record).__name__}.")
        if text_key not in record:
            raise DataError(f"{path}, line {line_number}: no key {text_key!r} (keys here: "
                            f"{', '.join(map(repr, record)) or 'none'}); pass --text-key with the right one.")
        text = record[text_key]
        if not isinstance(text, str):
            raise DataError(f"{path}, line {line_number}: {text_key!r} holds a {type(text).__name__}, "
                            "not a string.")
        yield text


def _text_lines(path: Path, on_bytes: ByteCounter) -> Iterator[str]:
    for line_number, raw in _open_lines(path, on_bytes):
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


def _import_parquet(path: Path):
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise DataError(f"{path}: reading .parquet files needs pyarrow; install it with "
                        "`pip install pyarrow`.") from error
    return parquet


def _read_parquet(path: Path, text_key: str, on_bytes: ByteCounter) -> Iterator[str]:
    parquet = _import_parquet(path)
    try:
        parquet_file = parquet.ParquetFile(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot read this file as Parquet ({error}).") from error
    columns = parquet_file.schema_arrow.names
    if text_key not in columns:
        raise DataError(f"{path}: no column {text_key!r} (columns here: {', '.join(map(repr, columns))}); "
                        "pass --text-key with the right one.")
    total_rows = max(parquet_file.metadata.num_rows, 1)
    file_size = path.stat().st_size
    row = 0
    try:
        for batch in parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key]):
            for text in batch.column(0).to_pylist():
                row += 1
                if not isinstance(text, str):
                    raise DataError(f"{path}, row {row}: column {text_key!r} holds "
                                    f"{'null' if text is None else type(text).__name__}, not a string.")
                yield text
            on_bytes(file_size * batch.num_rows // total_rows)
    except (OSError, ValueError) as error:
        if isinstance(error, DataError):
            raise
        raise DataError(f"{path}: cannot read this file as Parquet ({error}).") from error
