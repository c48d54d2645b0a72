"""Compressed input files: ``.gz``, ``.bz2``, ``.xz`` and ``.zst`` around a text format, streamed.

Corpora are shipped compressed -- The Pile and SlimPajama as ``.jsonl.zst``, C4 as ``.json.gz``
-- and decompressing them to disk first would need several times their size in free space. So
every reader of text input (``readers.py``, ``jsonl.py``) opens files with ``open_stream``, which
decompresses on the fly as lines are read: a file ``corpus.jsonl.zst`` is read as the
``.jsonl`` it holds (``content_suffix``), one line at a time, whatever its size.

gzip, bzip2 and xz come with Python; zstandard is an optional dependency (``pip install
zstandard``, part of ``meshlm[formats]``). A ``.zst`` file may hold several frames one after the
other (as ``zstd`` writes concatenated files), as a ``.gz`` file may hold several members.

A damaged or truncated file is refused by name, with the tool that checks it (``gzip -t``): Python's
gzip, bz2 and lzma raise at a truncated end, and for ``.zst`` ``ZstdFrames`` checks that the last
frame was complete, because zstandard's own stream reader ends a truncated file silently -- a
corpus cut short by an interrupted download would otherwise be tokenized as if it were whole.

``open_stream`` also returns how many bytes *of the file* have been read so far, so a progress bar
measured in file bytes (``preprocess.Progress``) moves through a compressed file too.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import os
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from meshlm.errors import DataError

COMPRESSIONS = {".gz": ("gzip", "gzip -t"), ".bz2": ("bzip2", "bzip2 -t"), ".xz": ("xz", "xz -t"),
                ".zst": ("zstd", "zstd -t")}
"""Suffix -> (the format's name, the command that checks a file of it)."""
READ_CHUNK_BYTES = 1 << 20


def compression_of(path: str | os.PathLike) -> str | None:
    """The compression suffix of ``path`` ('.gz', '.bz2', '.xz', '.zst'), or None for a plain file."""
    suffix = Path(path).suffix.lower()
    return suffix if suffix in COMPRESSIONS else None


def content_suffix(path: str | os.PathLike) -> str:
    """The suffix of what ``path`` holds, in lower case: 'c4.json.gz' -> '.json', 'a.JSONL' -> '.jsonl',
    'a.gz' -> ''."""
    path = Path(path)
    return (Path(path.stem).suffix if compression_of(path) else path.suffix).lower()


class ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` stream of one or more frames; at its end an EOFError
    when the last frame is incomplete (a truncated file), which zstandard's stream_reader does
    not report."""

    def __init__(self, raw: BinaryIO):
        try:
            import zstandard
        except ImportError as error:
            raise DataError(f"{getattr(raw, 'name', 'input')}: reading .zst files needs zstandard; install it with "
                            "`pip install zstandard` (or meshlm[formats]).") from error
        self.zstandard, self.raw = zstandard, raw
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.frame_started, self.pending = False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            compressed = self.raw.read(READ_CHUNK_BYTES)
            if not compressed:
                if self.frame_started and not self.frame.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self.pending = self.decompress(compressed)
        count = min(len(buffer), len(self.pending))
        buffer[:count] = self.pending[:count]
        self.pending = self.pending[count:]
        return count

    def decompress(self, compressed: bytes) -> bytes:
        """``compressed`` through the frames, starting a new frame where one ends."""
        pieces = []
        while compressed:
            if self.frame.eof:
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
            self.frame_started = True
            pieces.append(self.frame.decompress(compressed))
            compressed = self.frame.unused_data if self.frame.eof else b""
        return b"".join(pieces)


DECOMPRESSORS: dict[str, Callable[[BinaryIO], BinaryIO]] = {
    ".gz": lambda raw: gzip.GzipFile(fileobj=raw), ".bz2": bz2.BZ2File, ".xz": lzma.LZMAFile,
    ".zst": lambda raw: io.BufferedReader(ZstdFrames(raw), READ_CHUNK_BYTES)}
"""Compression suffix -> a reader of the decompressed bytes of an open binary file."""


def decompression_errors() -> tuple[type[BaseException], ...]:
    """What the decompressors raise on damaged or truncated data."""
    errors: list[type[BaseException]] = [EOFError, gzip.BadGzipFile, lzma.LZMAError, OSError, ValueError]
    with contextlib.suppress(ImportError):
        import zstandard
        errors.append(zstandard.ZstdError)
    return tuple(errors)


@contextlib.contextmanager
def open_stream(path: str | os.PathLike) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """(a binary stream of ``path``'s content, decompressed; how many bytes of the file have been
    read so far). An OSError opening the file is the caller's to word."""
    compression = compression_of(path)
    with open(path, "rb") as raw:
        if compression is None:
            yield raw, raw.tell
            return
        with DECOMPRESSORS[compression](raw) as stream:
            yield stream, raw.tell


def read_lines(path: str | os.PathLike, on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, raw line) of ``path``'s content, decompressed; ``on_bytes`` is told how
    many bytes of the file each line took. A file that cannot be read or decompressed is a
    DataError naming it."""
    path = Path(path)
    on_bytes = on_bytes or (lambda count: None)
    compressed = compression_of(path) is not None
    try:
        with open_stream(path) as (stream, position):
            read_so_far = 0
            try:
                for line_number, raw in enumerate(stream, start=1):
                    if compressed:
                        now = position()
                        on_bytes(now - read_so_far)
                        read_so_far = now
                    else:
                        on_bytes(len(raw))
                    yield line_number, raw
            except DataError:
                raise
            except decompression_errors() as error:
                if not compressed:
                    raise
                raise decompression_failure(path, error) from error
    except OSError as error:
        raise DataError(f"{path}: cannot read this file ({error.strerror or error}); "
                        "check that it exists and is readable.") from error


def decompression_failure(path: str | os.PathLike, error: BaseException) -> DataError:
    """The one sentence for a compressed file that does not decompress."""
    name, check = COMPRESSIONS[compression_of(path)]
    detail = str(error) or type(error).__name__
    return DataError(f"{path}: cannot decompress this {name} file ({detail}); it is damaged or cut short, or not "
                     f"{name} despite its name -- check it with `{check} {Path(path).name}` and download it again.")


__all__ = ["COMPRESSIONS", "DECOMPRESSORS", "ZstdFrames", "compression_of", "content_suffix", "decompression_errors",
           "decompression_failure", "open_stream", "read_lines"]
