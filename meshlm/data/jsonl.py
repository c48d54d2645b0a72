"""JSONL input files (chat conversations, preference pairs): one JSON value per non-blank line.

``json_lines`` checks the suffix and parses each line, naming the file and line of any error in
one sentence; what each line must hold is the caller's to check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from meshlm.errors import DataError


def json_lines(files: list[Path], what: str, line_format: str) -> Iterator[tuple[str, object]]:
    """("FILE, line N", the parsed value) for every non-blank line of the ``.jsonl`` ``files``;
    ``what`` ("chat data") and ``line_format`` (the object each line holds) word the errors."""
    for path in files:
        if path.suffix != ".jsonl":
            raise DataError(f"{path}: {what} must be .jsonl, one {line_format} object per line.")
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path}, line {number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{where}: not valid JSON ({error.msg}).") from error


__all__ = ["json_lines"]
