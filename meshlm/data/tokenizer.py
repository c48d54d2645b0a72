"""Loading a tokenizer: text <-> token ids, plus the ids of the special tokens.

A model only ever sees integer ids; the tokenizer it was trained with fixes what each id
means. meshlm reads three file formats, and everything past loading sees the same
``Tokenizer`` interface (``encode``, ``encode_batch``, ``decode``, ``vocab_size``, and
``bos_token_id``/``eos_token_id``/``pad_token_id``, None when absent; ``token_bytes`` for the
raw bytes one token stands for, ``text_tokens`` for every id's, special tokens left out):

- **Hugging Face ``tokenizers``** (``tokenizer.json``): one file holding the normalizer,
  pre-tokenizer, model (usually byte-level BPE, Sennrich et al. 2016, "Neural Machine
  Translation of Rare Words with Subword Units"), post-processor and added special tokens.
  This is what ``meshlm tokenizer train`` writes and what model directories carry.
- **SentencePiece** (``tokenizer.model``, Kudo & Richardson 2018, "SentencePiece: A simple and
  language independent subword tokenizer"): a protobuf holding the pieces and their scores,
  as Llama 1/2, Mistral and T5 ship them. Optional dependency: ``pip install sentencepiece``.
- **tiktoken** (``*.tiktoken``, or a ``tokenizer.model`` that is text): one ``BASE64 RANK``
  line per mergeable token, as OpenAI's encodings and Llama 3 ship them. The file does not
  hold the pre-tokenizer regex or the special tokens; the regex is ``tiktoken_pattern`` in
  ``tokenizer_config.json`` (default: the GPT-4 / Llama 3 pattern) and the special tokens are
  its ``added_tokens_decoder`` ids plus any named bos/eos/pad token, numbered after the last
  rank. Optional dependency: ``pip install tiktoken``.

The special tokens (``bos``/``eos``/``pad``) are read from a ``tokenizer_config.json`` (or
``special_tokens_map.json``) next to the file when one exists, as Hugging Face writes them;
otherwise from the SentencePiece model itself, or among the usual spellings
(``<|endoftext|>``, ``<s>``, ``</s>``, ...). ``encode(text)`` adds what the file was built to
add: the ``tokenizer.json`` post-processor; for SentencePiece a BOS unless
``add_bos_token`` is false (Llama's convention); for tiktoken nothing unless
``add_bos_token``/``add_eos_token`` are true.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from pathlib import Path

import tokenizers

from meshlm.errors import DataError

TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken")
"""Files ``load_tokenizer`` looks for inside a directory, in order of preference."""
SPECIAL_TOKEN_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
COMMON_SPELLINGS = {
    "bos": ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "<|endoftext|>"),
    "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|padding|>"),
}
"""Spellings tried, in order, when no config file names a special token."""
DEFAULT_TIKTOKEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Pre-tokenizer regex of GPT-4's cl100k and Llama 3: words, up to 3 digits, punctuation runs, spaces."""
TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/=]+ \d+")
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""SentencePiece's (and its Hugging Face conversions') byte-fallback pieces: one raw byte each."""


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet read backwards: the printable character that stands for each
    byte in a token's spelling (Radford et al. 2019's ``bytes_to_unicode``) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    shifted = [byte for byte in range(256) if byte not in printable]
    characters = {byte: chr(byte) for byte in printable} | {byte: chr(256 + n) for n, byte in enumerate(shifted)}
    return {character: byte for byte, character in characters.items()}


BYTE_LEVEL_ALPHABET = byte_level_alphabet()


def piece_bytes(piece: str, byte_level: bool) -> bytes:
    """The bytes a vocabulary entry spells: a byte-fallback piece's byte, a byte-level BPE token's
    bytes (``byte_level``), else its text with SentencePiece's word marker as a space."""
    byte = BYTE_PIECE.fullmatch(piece)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    if byte_level and all(character in BYTE_LEVEL_ALPHABET for character in piece):
        return bytes(BYTE_LEVEL_ALPHABET[character] for character in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


class Tokenizer:
    """A loaded Hugging Face tokenizer; the other formats subclass it with the same interface."""

    def __init__(self, backend, source: Path, special_tokens: dict[str, str | None]):
        self.backend = backend
        self.source = source
        self.bos_token_id = self._id_of(special_tokens.get("bos"))
        self.eos_token_id = self._id_of(special_tokens.get("eos"))
        self.pad_token_id = self._id_of(special_tokens.get("pad"))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the file's own post-processor
        adds whatever it was built to add (e.g. a BOS token for Llama-style tokenizers)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, run in parallel by the Rust library."""
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token ``token_id`` stands for: with byte-level BPE a token may hold part of
        a UTF-8 character, which ``decode`` of it alone would show as U+FFFD."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is outside this tokenizer's vocabulary of {self.vocab_size}")
        special = self.backend.get_added_tokens_decoder().get(int(token_id))
        return piece.encode("utf-8") if special is not None else piece_bytes(piece, self._byte_level)

    def text_tokens(self) -> list[bytes | None]:
        """Every id's bytes (``token_bytes``), None for a special token -- one the tokenizer marks as
        control rather than text, such as an end of turn (what constrained decoding may not draw as text)."""
        added = self.backend.get_added_tokens_decoder()
        byte_level = self._byte_level
        spelt: list[bytes | None] = [None] * self.vocab_size
        for piece, token in self.backend.get_vocab(with_added_tokens=True).items():
            entry = added.get(token)
            if token < len(spelt) and not (entry is not None and entry.special):
                spelt[token] = piece.encode("utf-8") if entry is not None else piece_bytes(piece, byte_level)
        return spelt

    @property
    def _byte_level(self) -> bool:
        """Whether the file's decoder is byte-level (GPT-2's alphabet), read from it once."""
        if not hasattr(self, "_byte_level_decoder"):
            decoder = json.loads(self.backend.to_str()).get("decoder") or {}
            kinds = [decoder.get("type")] + [step.get("type") for step in decoder.get("decoders") or []]
            self._byte_level_decoder = "ByteLevel" in kinds
        return self._byte_level_decoder

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.source)!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id}, pad={self.pad_token_id})")


class AddsSpecialTokensByFlag(Tokenizer):
    """Base of the formats without a post-processor: ``encode`` adds BOS/EOS by two flags."""

    def __init__(self, backend, source: Path, special_tokens: dict[str, str | None], add_bos: bool, add_eos: bool):
        super().__init__(backend, source, special_tokens)
        self.add_bos, self.add_eos = add_bos, add_eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def _with_special(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if not add_special_tokens:
            return ids
        bos = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        eos = [self.eos_token_id] if self.add_eos and self.eos_token_id is not None else []
        return bos + ids + eos


class SentencePieceTokenizer(AddsSpecialTokensByFlag):
    """A SentencePiece model (``backend`` is a ``sentencepiece.SentencePieceProcessor``)."""

    @property
    def vocab_size(self) -> int:
        return self.backend.get_piece_size()

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self._with_special(ids, add_special_tokens) for ids in self.backend.encode(list(texts))]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """SentencePiece drops control pieces when decoding; keep them as text unless skipped."""
        pieces, run = [], []
        for token in map(int, ids):
            if self.backend.is_control(token):
                pieces.append(self.backend.decode(run))
                run = []
                if not skip_special_tokens:
                    pieces.append(self.backend.id_to_piece(token))
            else:
                run.append(token)
        return "".join(pieces) + self.backend.decode(run)

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.piece_to_id(token)  # unknown pieces map to the unk id
        return token_id if self.backend.id_to_piece(token_id) == token else None

    def token_bytes(self, token_id: int) -> bytes:
        return piece_bytes(self.backend.id_to_piece(int(token_id)), byte_level=False)

    def text_tokens(self) -> list[bytes | None]:
        backend = self.backend
        return [None if backend.is_control(token) or backend.is_unknown(token) else self.token_bytes(token)
                for token in range(self.vocab_size)]


class TiktokenTokenizer(AddsSpecialTokensByFlag):
    """A tiktoken BPE (``backend`` is a ``tiktoken.Encoding``); special tokens in text are kept
    as their ids, as the Hugging Face tokenizers do."""

    @property
    def vocab_size(self) -> int:
        return self.backend.n_vocab

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        encoded = self.backend.encode_batch(list(texts), allowed_special="all")
        return [self._with_special(ids, add_special_tokens) for ids in encoded]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        special = ({self.backend.encode_single_token(token) for token in self.backend.special_tokens_set}
                   if skip_special_tokens else set())
        return self.backend.decode([int(token) for token in ids if int(token) not in special])

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        try:
            return self.backend.encode_single_token(token)
        except KeyError:
            return None

    def token_bytes(self, token_id: int) -> bytes:
        return self.backend.decode_single_token_bytes(int(token_id))

    def text_tokens(self) -> list[bytes | None]:
        special = {self.backend.encode_single_token(token) for token in self.backend.special_tokens_set}
        spelt: list[bytes | None] = []
        for token in range(self.vocab_size):
            try:
                spelt.append(None if token in special else self.backend.decode_single_token_bytes(token))
            except KeyError:  # a gap in the ranks
                spelt.append(None)
        return spelt


def find_tokenizer_file(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a file, else the tokenizer file inside the directory ``path``."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for name in TOKENIZER_FILE_NAMES:
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path}: no tokenizer file in this directory (looked for "
                                f"{', '.join(TOKENIZER_FILE_NAMES)}); pass the tokenizer's path explicitly.")
    raise FileNotFoundError(f"{path}: no such tokenizer file or directory.")


def tokenizer_format(file: Path) -> str:
    """"sentencepiece", "tiktoken" or "huggingface", by suffix (and content, for ``.model``)."""
    if file.suffix == ".tiktoken":
        return "tiktoken"
    if file.suffix == ".model":
        with open(file, "rb") as handle:
            first_line = handle.readline(256).strip()
        return "tiktoken" if TIKTOKEN_LINE.fullmatch(first_line) else "sentencepiece"
    return "huggingface"


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer at ``path``: a tokenizer file, or a directory holding one."""
    file = find_tokenizer_file(path)
    loaders = {"huggingface": load_huggingface, "sentencepiece": load_sentencepiece, "tiktoken": load_tiktoken}
    return loaders[tokenizer_format(file)](file)


def load_huggingface(file: Path) -> Tokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # the Rust library raises a bare Exception for every parse error
        raise DataError(f"{file}: not a readable Hugging Face tokenizers file ({error}); "
                        "re-save it with tokenizers' Tokenizer.save().") from error
    special_tokens = configured_special_tokens(file.parent)
    for role, spellings in COMMON_SPELLINGS.items():
        if special_tokens.get(role) is None:
            special_tokens[role] = next((s for s in spellings if backend.token_to_id(s) is not None), None)
    return Tokenizer(backend, file, special_tokens)


def load_sentencepiece(file: Path) -> SentencePieceTokenizer:
    try:
        import sentencepiece
    except ImportError as error:
        raise DataError(f"{file}: reading a SentencePiece model needs the sentencepiece package; "
                        "install it with `pip install sentencepiece`.") from error
    try:
        backend = sentencepiece.SentencePieceProcessor(model_file=str(file))
    except (OSError, RuntimeError) as error:
        raise DataError(f"{file}: not a readable SentencePiece model ({error}).") from error
    special_tokens = configured_special_tokens(file.parent)
    own_ids = {"bos": backend.bos_id(), "eos": backend.eos_id(), "pad": backend.pad_id()}
    for role, token_id in own_ids.items():
        if special_tokens.get(role) is None and token_id >= 0:
            special_tokens[role] = backend.id_to_piece(token_id)
    config = tokenizer_config(file.parent)
    return SentencePieceTokenizer(backend, file, special_tokens, add_bos=config.get("add_bos_token", True) is True,
                                  add_eos=config.get("add_eos_token", False) is True)


def load_tiktoken(file: Path) -> TiktokenTokenizer:
    try:
        import tiktoken
    except ImportError as error:
        raise DataError(f"{file}: reading a tiktoken file needs the tiktoken package; "
                        "install it with `pip install tiktoken`.") from error
    ranks = read_tiktoken_ranks(file)
    config = tokenizer_config(file.parent)
    added = config.get("added_tokens_decoder")  # Hugging Face's {"128000": {"content": "<|begin_of_text|>"}}
    special_ids = {entry["content"]: int(token_id) for token_id, entry in (added or {}).items()
                   if isinstance(added, dict) and isinstance(entry, dict) and isinstance(entry.get("content"), str)}
    named = configured_special_tokens(file.parent)
    for token in (named.get(role) for role in COMMON_SPELLINGS):
        if token is not None and token not in special_ids and token.encode() not in ranks:
            special_ids[token] = max([len(ranks) - 1, *ranks.values(), *special_ids.values()]) + 1
    try:
        backend = tiktoken.Encoding(file.stem, pat_str=config.get("tiktoken_pattern", DEFAULT_TIKTOKEN_PATTERN),
                                    mergeable_ranks=ranks, special_tokens=special_ids)
    except ValueError as error:
        raise DataError(f"{file}: tiktoken rejected this vocabulary ({error}).") from error
    return TiktokenTokenizer(backend, file, named, add_bos=config.get("add_bos_token") is True,
                             add_eos=config.get("add_eos_token") is True)


def read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """The ``BASE64TOKEN RANK`` lines of a tiktoken file as {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(file.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as error:
            raise DataError(f"{file}, line {line_number}: expected 'BASE64TOKEN RANK' ({error}); "
                            "this is not a tiktoken BPE file.") from error
    return ranks


def read_config_file(config_path: Path) -> dict | None:
    """A Hugging Face tokenizer config file as a dict, or None when it is not there."""
    if not config_path.is_file():
        return None
    try:
        payload = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{config_path}: not valid JSON ({error}).") from error
    if not isinstance(payload, dict):
        raise DataError(f"{config_path}: expected a JSON object with bos_token/eos_token/pad_token.")
    return payload


def tokenizer_config(directory: Path) -> dict:
    """``tokenizer_config.json`` in ``directory`` ({} when absent)."""
    return read_config_file(directory / SPECIAL_TOKEN_CONFIG_FILES[0]) or {}


def configured_special_tokens(directory: Path) -> dict[str, str | None]:
    """bos/eos/pad token strings named by Hugging Face config files in ``directory``, if any."""
    found: dict[str, str | None] = {}
    for name in SPECIAL_TOKEN_CONFIG_FILES:
        payload = read_config_file(directory / name) or {}
        for role in COMMON_SPELLINGS:
            value = payload.get(f"{role}_token")
            if isinstance(value, dict):  # older files store {"content": "<s>", "lstrip": ...}
                value = value.get("content")
            if isinstance(value, str) and found.get(role) is None:
                found[role] = value
    return found
