"""JSON input files: JSON Lines (``.jsonl``, one value per non-blank line) and ``.json``, either
JSON Lines too (as C4's ``.json.gz`` files are) or one JSON array of records (as many small
fine-tuning sets are shipped); any of them may be compressed (``compression.py``).

``json_records`` parses a file's values one line at a time, naming the file and the line (or the
array item) of any error in one sentence; what each value must hold is the caller's to check. A
JSON array is parsed whole, so it is held in memory: give large corpora as JSON Lines.
``json_lines`` is the same over several files, for the readers of chat and preference data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator

from meshlm.data.compression import content_suffix, read_lines
from meshlm.errors import DataError

JSON_SUFFIXES = (".jsonl", ".json")


def json_records(path: str | os.PathLike, on_bytes: Callable[[int], None] | None = None,
                 line_hint: str = "each line must be one JSON value") -> Iterator[tuple[str, object]]:
    """("FILE, line N" or "FILE, item N", the parsed value) for each record of ``path``: every
    non-blank line, or every item of a ``.json`` file that is one JSON array. ``line_hint`` ends
    the sentence for a line that is not JSON."""
    path = Path(path)
    suffix = content_suffix(path)
    lines = read_lines(path, on_bytes)
    for number, raw in lines:
        if not raw.strip():
            continue
        if suffix == ".json" and raw.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):
            yield from array_items(path, raw + b"".join(line for _, line in lines))
            return
        try:
            value = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            detail = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
            hint = line_hint if suffix == ".jsonl" else \
                "a .json file must hold JSON Lines (one record per line) or one JSON array of records"
            raise DataError(f"{path}, line {number}: not valid JSON ({detail}); {hint}.") from error
        yield f"{path}, line {number}", value


def array_items(path: Path, content: bytes) -> Iterator[tuple[str, object]]:
    """The items of the JSON array ``content`` (all of ``path``; a UTF-8 byte-order mark is allowed)."""
    try:
        values = json.loads(content.lstrip().removeprefix(b"\xef\xbb\xbf"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        where = f", line {error.lineno}" if isinstance(error, json.JSONDecodeError) else ""
        detail = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
        raise DataError(f"{path}{where}: not valid JSON ({detail}); the file starts a JSON array, which must "
                        "hold the records and end the file.") from error
    for index, value in enumerate(values, start=1):
        yield f"{path}, item {index}", value


def json_lines(files: list[Path], what: str, line_format: str) -> Iterator[tuple[str, object]]:
    """("FILE, line N", the parsed value) for every record of the JSON ``files`` (``json_records``);
    ``what`` ("chat data") and ``line_format`` (the object each line holds) word the errors."""
    for path in files:
        if content_suffix(path) not in JSON_SUFFIXES:
            raise DataError(f"{path}: {what} must be .jsonl (or .json), one {line_format} object per line.")
        yield from json_records(path, line_hint=f"each line must be one {line_format} object")


__all__ = ["JSON_SUFFIXES", "array_items", "json_lines", "json_records"]
