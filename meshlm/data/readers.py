"""Reading documents out of text files, one at a time, never a whole file at once.

Pretraining corpora are often larger than memory, so every reader here is a generator: it
holds one line (``.jsonl``, ``.txt``) or one batch of rows (``.parquet``) at a time, and the
tokenizer trainer and the preprocessor pull documents through it. What a *document* is:

- ``.jsonl``: one JSON object per line; the document is the string under ``text_key``
  (``"text"`` by default). Blank lines are skipped.
- ``.txt``: documents are separated by one or more blank lines (a paragraph, a poem, a
  function). We chose blocks over "one file, one document" because a block can be streamed
  whatever the file's size; put each document in its own ``.jsonl`` line when blocks do
  not fit your text (e.g. source code, which has blank lines inside a document).
- ``.parquet``: the string column ``text_key``, read in batches of rows with ``pyarrow``
  (an optional dependency: ``pip install pyarrow``).

Errors name the file and the line (or row), and for a missing key the keys that do exist.
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
    return files


def read_documents(path: str | os.PathLike, text_key: str = "text",
                   on_bytes: ByteCounter | None = None) -> Iterator[str]:
    """Yield the documents of one file, in file order (see the module docstring)."""
    path = Path(path)
    on_bytes = on_bytes or (lambda count: None)
    if path.suffix == ".jsonl":
        return _read_jsonl(path, text_key, on_bytes)
    if path.suffix == ".txt":
        return _read_txt(path, on_bytes)
    if path.suffix == ".parquet":
        return _read_parquet(path, text_key, on_bytes)
    raise DataError(f"{path}: unsupported input type {path.suffix!r}; use one of {', '.join(SUPPORTED_SUFFIXES)}.")


def read_all_documents(paths: Iterable[Path], text_key: str = "text",
                       on_bytes: ByteCounter | None = None) -> Iterator[str]:
    """The documents of several files, one file after the other."""
    for path in paths:
        yield from read_documents(path, text_key, on_bytes)


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


def _read_txt(path: Path, on_bytes: ByteCounter) -> Iterator[str]:
    block: list[str] = []
    for line_number, raw in _open_lines(path, on_bytes):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"{path}, line {line_number}: not UTF-8 text ({error}); "
                            "re-encode the file as UTF-8.") from error
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
