"""Loading a tokenizer: text <-> token ids, plus the ids of the special tokens.

A model only ever sees integer ids; the tokenizer it was trained with fixes what each id
means. meshlm reads tokenizers saved in the Hugging Face ``tokenizers`` format, a single
``tokenizer.json`` holding the normalizer, pre-tokenizer, model (usually byte-level BPE,
Sennrich et al. 2016, "Neural Machine Translation of Rare Words with Subword Units"), the
post-processor and the added special tokens. Model directories and training checkpoints
carry this file beside ``config.json``, so ``load_tokenizer(model_dir)`` just works.

The special tokens generation needs (``bos``/``eos``/``pad``) are read from a
``tokenizer_config.json`` (or ``special_tokens_map.json``) next to the file when one exists,
as Hugging Face writes them; otherwise they are looked up among the usual spellings
(``<|endoftext|>``, ``<s>``, ``</s>``, ...).

Other formats (SentencePiece ``tokenizer.model``, tiktoken) enter at ``TOKENIZER_FILE_NAMES``
and ``load_tokenizer``'s choice of reader; everything past loading sees the same ``Tokenizer``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import tokenizers

from meshlm.data.errors import DataError

TOKENIZER_FILE_NAMES = ("tokenizer.json",)
"""Files ``load_tokenizer`` looks for inside a directory, in order of preference."""
SPECIAL_TOKEN_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
COMMON_SPELLINGS = {
    "bos": ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>", "<|endoftext|>"),
    "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|padding|>"),
}
"""Spellings tried, in order, when no config file names a special token."""


class Tokenizer:
    """A loaded tokenizer: ``encode``/``decode`` and the special token ids (None if absent)."""

    def __init__(self, backend: tokenizers.Tokenizer, source: Path, special_tokens: dict[str, str | None]):
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

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.source)!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_id}, pad={self.pad_token_id})")


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


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer at ``path``: a tokenizer file, or a directory holding one."""
    file = find_tokenizer_file(path)
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


def configured_special_tokens(directory: Path) -> dict[str, str | None]:
    """bos/eos/pad token strings named by Hugging Face config files in ``directory``, if any."""
    found: dict[str, str | None] = {}
    for name in SPECIAL_TOKEN_CONFIG_FILES:
        config_path = directory / name
        if not config_path.is_file():
            continue
        try:
            payload = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise DataError(f"{config_path}: not valid JSON ({error}).") from error
        if not isinstance(payload, dict):
            raise DataError(f"{config_path}: expected a JSON object with bos_token/eos_token/pad_token.")
        for role in COMMON_SPELLINGS:
            value = payload.get(f"{role}_token")
            if isinstance(value, dict):  # older files store {"content": "<s>", "lstrip": ...}
                value = value.get("content")
            if isinstance(value, str) and found.get(role) is None:
                found[role] = value
    return found
