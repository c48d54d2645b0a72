"""The token store: ``PREFIX.bin`` (all tokens) + ``PREFIX.idx`` (where each document starts).

Training reads random windows of a corpus that can be far larger than memory, so the corpus
is tokenized once and kept as one flat array of token ids on disk, memory-mapped on read: the
operating system pages in only what a sample touches. This is the layout of Megatron-LM's
``MMapIndexedDataset`` (Shoeybi et al. 2019), simplified to what a decoder-only LM needs.

``PREFIX.bin`` is the raw tokens of every document, back to back, in the dtype the
vocabulary needs (``uint16`` when every id fits below 65536, else ``uint32``); it has no
header, so it can be memory-mapped as one array.

``PREFIX.idx`` is a 40-byte little-endian header followed by the document offsets::

    magic        8 bytes   b"MESHLMTK"
    version      uint32    1
    dtype code   uint32    1 = uint16, 2 = uint32
    vocab size   uint64    ids in the .bin are all below this
    documents    uint64    D
    tokens       uint64    T (the .bin holds exactly T tokens)
    offsets      int64[D + 1]   document d is tokens[offsets[d]:offsets[d + 1]]

``PREFIX.meta.json`` (optional; stores written before it existed have none) says how the
store was made, so that training can find the tokenizer from the data alone::

    {"tokenizer": "../tokenizer.json",   # relative to the store's folder
     "tokenizer_vocab_size": 4096, "append_eos": true, "text_key": "text",
     "txt_documents": "paragraph", "num_documents": D, "num_tokens": T}

``PREFIX.mask.bin`` (chat stores only, ``meshlm preprocess --chat``) is the *loss mask*: one
``uint8`` per token of the .bin, 1 where the token is one the loss trains on (an assistant's
reply) and 0 elsewhere, under the same offsets; the metadata then says ``"chat": true``.
``TokenStore.loss_mask`` is it, memory-mapped, or None for a store without one.

``TokenStoreWriter`` streams documents in (the .bin grows by appending, the offsets are
appended to the .idx as each document ends), writes all files under temporary names and
renames them only when everything is on disk, so a crash never leaves a store that looks
complete; the sidecar repeats D and T, so one left from an earlier store of the same prefix is
recognised.
``TokenStore`` checks the magic, version and both file sizes against the header before it
maps anything, and names the file when they disagree.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from meshlm.errors import DataError

MAGIC = b"MESHLMTK"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
DTYPES = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}
DTYPE_CODES = {dtype: code for code, dtype in DTYPES.items()}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id below ``vocab_size``."""
    return DTYPES[1] if vocab_size <= 2**16 else DTYPES[2]


def store_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(``PREFIX.bin``, ``PREFIX.idx``)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


def mask_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.mask.bin``: the loss mask of a chat store (see the module docstring)."""
    return Path(str(prefix) + ".mask.bin")


def metadata_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.meta.json``: how the store was made (see the module docstring)."""
    return Path(str(prefix) + ".meta.json")


class TokenStoreWriter:
    """Append documents (arrays of token ids) to a new token store at ``prefix``.

    Use as a context manager: the store appears under its real name when the block ends
    without an error; on an error the temporary files are removed (and the folders this
    writer created, when they are still empty). ``metadata`` goes to ``PREFIX.meta.json``;
    without it, a sidecar left from an earlier store of this prefix is removed. With
    ``loss_mask`` every document comes with its mask, written to ``PREFIX.mask.bin``; without
    it, a mask left from an earlier store of this prefix is removed.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, metadata: dict | None = None,
                 loss_mask: bool = False):
        self.bin_path, self.idx_path = store_paths(prefix)
        self.metadata_path, self.metadata = metadata_path(prefix), metadata
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self.num_documents = 0
        self.num_tokens = 0
        folder = self.bin_path.parent
        self._created_folders = [path for path in (folder, *folder.parents) if not path.exists()]  # deepest first
        folder.mkdir(parents=True, exist_ok=True)
        self._bin_temp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._idx_temp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._bin = open(self._bin_temp, "wb")
        self._idx = open(self._idx_temp, "wb")
        self._idx.write(b"\0" * HEADER.size)  # the real header is written by close()
        self._idx.write(np.zeros(1, np.int64).tobytes())
        self.mask_path = mask_path(prefix)
        self._mask_temp = self.mask_path.with_name(self.mask_path.name + ".tmp")
        self._mask = open(self._mask_temp, "wb") if loss_mask else None

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, source: str = "",
                      loss_mask: np.ndarray | None = None) -> None:
        """Append ``len(lengths)`` documents whose tokens are ``tokens``, back to back (and their
        ``loss_mask``, 0/1 per token, when this writer was made with ``loss_mask=True``)."""
        tokens = np.asarray(tokens)
        if (self._mask is None) != (loss_mask is None) or (loss_mask is not None and len(loss_mask) != tokens.size):
            raise ValueError(f"{self.bin_path}: a loss mask of one entry per token goes with every document "
                             "exactly when the writer was made with loss_mask=True.")
        if loss_mask is not None:
            self._mask.write(np.asarray(loss_mask).astype(np.uint8).tobytes())
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens.max() if tokens.max() >= self.vocab_size else tokens.min())
            raise DataError(f"{self.bin_path}: token id {bad}{' from ' + source if source else ''} is outside "
                            f"the vocabulary [0, {self.vocab_size}); the tokenizer and its vocabulary size disagree.")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        ends = self.num_tokens + np.cumsum(np.asarray(lengths, dtype=np.int64))
        self._idx.write(ends.astype(np.int64).tobytes())
        self.num_tokens += int(tokens.size)
        self.num_documents += len(lengths)

    def add_document(self, tokens, source: str = "", loss_mask=None) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([tokens.size]), source, loss_mask)

    def close(self) -> None:
        """Write the header and move both files to their real names."""
        self._bin.close()
        self._idx.seek(0)
        self._idx.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], self.vocab_size,
                                    self.num_documents, self.num_tokens))
        self._idx.close()
        if self.metadata is None:
            self.metadata_path.unlink(missing_ok=True)
        else:
            payload = {**self.metadata, "num_documents": self.num_documents, "num_tokens": self.num_tokens}
            temporary = self.metadata_path.with_name(self.metadata_path.name + ".tmp")
            temporary.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
            os.replace(temporary, self.metadata_path)
        if self._mask is None:
            self.mask_path.unlink(missing_ok=True)
        else:
            self._mask.close()
            os.replace(self._mask_temp, self.mask_path)
        os.replace(self._bin_temp, self.bin_path)
        os.replace(self._idx_temp, self.idx_path)

    def abort(self) -> None:
        for handle, temporary in ((self._bin, self._bin_temp), (self._idx, self._idx_temp)):
            handle.close()
            temporary.unlink(missing_ok=True)
        if self._mask is not None:
            self._mask.close()
            self._mask_temp.unlink(missing_ok=True)
        for folder in self._created_folders:
            try:
                folder.rmdir()  # only when empty: another writer may have put files there meanwhile
            except OSError:
                break

    def __enter__(self) -> "TokenStoreWriter":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is None:
            self.close()
        else:
            self.abort()


class TokenStore:
    """A token store on disk, memory-mapped: documents by index, tokens by global position."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = store_paths(prefix)
        header = read_header(self.idx_path)
        self.dtype, self.vocab_size, self.num_documents, self.num_tokens = header
        self.header_bytes = self.idx_path.read_bytes()[:HEADER.size]
        expected_idx = HEADER.size + 8 * (self.num_documents + 1)
        check_size(self.idx_path, expected_idx, f"{self.num_documents} documents")
        check_size(self.bin_path, self.num_tokens * self.dtype.itemsize, f"{self.num_tokens} tokens")
        self.offsets = np.memmap(self.idx_path, dtype=np.int64, mode="r", offset=HEADER.size,
                                 shape=(self.num_documents + 1,))
        if self.offsets[0] != 0 or self.offsets[-1] != self.num_tokens:
            raise DataError(f"{self.idx_path}: document offsets run from {self.offsets[0]} to "
                            f"{self.offsets[-1]}, not 0 to {self.num_tokens}; the index is corrupt, "
                            "re-run `meshlm preprocess`.")
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.zeros(0, self.dtype))
        self.loss_mask = None
        """1 where the loss trains on the token (``PREFIX.mask.bin``, chat stores), or None."""
        if mask_path(prefix).is_file():
            check_size(mask_path(prefix), self.num_tokens, f"{self.num_tokens} tokens")
            self.loss_mask = (np.memmap(mask_path(prefix), dtype=np.uint8, mode="r") if self.num_tokens
                              else np.zeros(0, np.uint8))

    @property
    def document_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index`` (a read-only view into the memory map)."""
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]

    def __len__(self) -> int:
        return self.num_documents

    @property
    def metadata(self) -> dict:
        """``PREFIX.meta.json`` as a dict, ``{}`` for a store that has none."""
        path = metadata_path(self.prefix)
        try:
            payload = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as error:
            raise DataError(f"{path}: cannot read the token store's metadata ({error}); delete the file "
                            "(the store stays readable) or re-run `meshlm preprocess`.") from error
        if not isinstance(payload, dict):
            raise DataError(f"{path}: expected a JSON object, found a {type(payload).__name__}; delete the file "
                            "(the store stays readable) or re-run `meshlm preprocess`.")
        counts = (payload.get("num_documents"), payload.get("num_tokens"))
        if counts != (self.num_documents, self.num_tokens):
            raise DataError(f"{path}: describes {counts[0]} documents and {counts[1]} tokens, but "
                            f"{self.idx_path} holds {self.num_documents} and {self.num_tokens}; the metadata is "
                            "from another store, so delete it or re-run `meshlm preprocess`.")
        return payload

    def recorded_tokenizer(self) -> Path | None:
        """The tokenizer file the store was made with, as its metadata names it (None if unknown)."""
        tokenizer = self.metadata.get("tokenizer")
        return None if tokenizer is None else metadata_path(self.prefix).parent / tokenizer

    def fingerprint(self) -> str:
        """What identifies this store's contents for cache names: sizes, mtimes and header."""
        parts = [self.header_bytes.hex()]
        for path in (self.bin_path, self.idx_path):
            stat = path.stat()
            parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
        return "|".join(parts)


def read_header(idx_path: Path) -> tuple[np.dtype, int, int, int]:
    """(dtype, vocab size, documents, tokens) from an ``.idx`` header, checked."""
    try:
        with open(idx_path, "rb") as handle:
            raw = handle.read(HEADER.size)
    except OSError as error:
        raise DataError(f"{idx_path}: cannot read the token index ({error.strerror or error}); "
                        "run `meshlm preprocess` to create it.") from error
    if len(raw) < HEADER.size:
        raise DataError(f"{idx_path}: only {len(raw)} bytes, shorter than the {HEADER.size}-byte header; "
                        "the file is truncated, re-run `meshlm preprocess`.")
    magic, version, dtype_code, vocab_size, num_documents, num_tokens = HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(f"{idx_path}: not a meshlm token index (magic {magic!r}, expected {MAGIC!r}); "
                        "create it with `meshlm preprocess`.")
    if version != VERSION:
        raise DataError(f"{idx_path}: token index version {version}, this meshlm reads version {VERSION}; "
                        "re-run `meshlm preprocess` with this version.")
    if dtype_code not in DTYPES:
        raise DataError(f"{idx_path}: unknown token dtype code {dtype_code}; the header is corrupt, "
                        "re-run `meshlm preprocess`.")
    return DTYPES[dtype_code], vocab_size, num_documents, num_tokens


def check_size(path: Path, expected: int, what: str) -> None:
    try:
        actual = path.stat().st_size
    except OSError as error:
        raise DataError(f"{path}: cannot read it ({error.strerror or error}); "
                        "run `meshlm preprocess` to create the token store.") from error
    if actual != expected:
        raise DataError(f"{path}: {actual} bytes, but the header says {what} ({expected} bytes); "
                        "the file is truncated or corrupt, re-run `meshlm preprocess`.")
