"""Columnar input files: a string column of Parquet or Arrow files, read in batches of rows.

- ``.parquet``: the format of the Hugging Face Hub's datasets (and most data lakes).
- ``.arrow``: Arrow IPC files, stream or file format -- what Hugging Face ``datasets`` writes with
  ``save_to_disk`` (a directory of ``data-*.arrow`` next to JSON metadata, which a directory
  search skips) and keeps in its cache. Arrow files hold uncompressed record batches, so they are
  memory-mapped and read batch by batch.

Both need ``pyarrow`` (``pip install pyarrow``, part of ``meshlm[formats]``). The document of a
row is the string in column ``text_key``; a missing column names the columns there, and a null or
non-string cell names its row. Progress (``on_bytes``) moves by each batch's share of the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from meshlm.errors import DataError

PARQUET_BATCH_ROWS = 1024
FORMAT_NAMES = {".parquet": "Parquet", ".arrow": "Arrow"}


def import_pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401 -- loads the submodules used below
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:
        raise DataError(f"{path}: reading {path.suffix} files needs pyarrow; install it with "
                        "`pip install pyarrow`.") from error
    return pyarrow


def open_batches(path: Path, text_key: str) -> tuple[Iterator, int, list[str]]:
    """(batches of the ``text_key`` column, total rows or 0 when unknown, the file's columns)."""
    pyarrow = import_pyarrow(path)
    if path.suffix.lower() == ".parquet":
        parquet_file = pyarrow.parquet.ParquetFile(path)
        columns = parquet_file.schema_arrow.names
        batches = (parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_key])
                   if text_key in columns else iter(()))
        return batches, parquet_file.metadata.num_rows, columns
    source = pyarrow.memory_map(str(path))
    try:
        reader = pyarrow.ipc.open_stream(source)  # what datasets' save_to_disk writes
        return iter(reader), 0, reader.schema.names
    except pyarrow.ArrowInvalid:
        source.seek(0)
        reader = pyarrow.ipc.open_file(source)
        batches = [reader.get_batch(index) for index in range(reader.num_record_batches)]  # mapped, not copied
        return iter(batches), sum(batch.num_rows for batch in batches), reader.schema.names


def read_column(path: Path, text_key: str, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """The strings of column ``text_key`` of the Parquet or Arrow file ``path``, in row order."""
    name = FORMAT_NAMES[path.suffix.lower()]
    try:
        batches, total_rows, columns = open_batches(path, text_key)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        if isinstance(error, DataError):
            raise
        raise DataError(f"{path}: cannot read this file as {name} ({error}).") from error
    if text_key not in columns:
        raise DataError(f"{path}: no column {text_key!r} (columns here: {', '.join(map(repr, columns))}); "
                        "pass --text-key with the right one.")
    file_size, row = path.stat().st_size, 0
    try:
        for batch in batches:
            column = batch.column(batch.schema.get_field_index(text_key))
            for text in column.to_pylist():
                row += 1
                if not isinstance(text, str):
                    raise DataError(f"{path}, row {row}: column {text_key!r} holds "
                                    f"{'null' if text is None else type(text).__name__}, not a string.")
                yield text
            on_bytes(file_size * batch.num_rows // max(total_rows, 1) if total_rows else 0)
    except (OSError, ValueError) as error:
        if isinstance(error, DataError):
            raise
        raise DataError(f"{path}: cannot read this file as {name} ({error}).") from error
    if not total_rows:
        on_bytes(file_size)  # a stream does not say its row count up front: the whole file at its end


__all__ = ["FORMAT_NAMES", "PARQUET_BATCH_ROWS", "import_pyarrow", "open_batches", "read_column"]
