"""Extending a BPE tokenizer with domain tokens, keeping every old id.

    meshlm tokenizer extend data/demo/tokenizer.json --input python.jsonl --add 2048 --out ext/tokenizer.json

ChipNeMo (Liu et al. 2023, "ChipNeMo: Domain-Adapted LLMs for Chip Design") adapts a general
model to a domain in three steps: extend the tokenizer with domain tokens, continue pretraining
on domain data (DAPT), then fine-tune. A general tokenizer cuts domain words into many pieces
(``isinstance`` may be 3 tokens); a tokenizer with domain tokens encodes the same text in fewer
tokens, so the model sees more text per step and per context window. The old tokenizer's ids
must keep their meaning, since the model's embedding rows are indexed by them: new tokens get
ids after the whole base vocabulary (special tokens included) and nothing else moves.

**How the tokens are chosen: BPE continued from the base segmentation.** Byte-pair encoding
(Sennrich et al. 2016) encodes a word by applying its merge list in order. Merges appended
*after* every base merge act only once the base merges are done, so the extended tokenizer
encodes any word as the base tokenizer does and then merges some adjacent base pieces further.
So we learn the new merges on the domain text *as the base tokenizer cuts it*: every base piece
becomes one symbol (a private-use character, so the Rust ``tokenizers`` BPE trainer can do the
counting), the pre-tokenized words of the domain text become words of these symbols, and the
trainer's merges, in order, are the new merges. Each BPE merge is the adjacent pair seen most
often at that point, and merging one occurrence saves one token, so the N new tokens are chosen
greedily by **tokens saved on the domain text** (occurrences x (base pieces - 1), counted as
the merges happen); a long token needs its shorter prefix-pieces as tokens too, and they count
toward N (they are frequent themselves: that is why BPE built them first).

Two properties follow, and ``tests/data/test_tokenizer_extension.py`` checks both: replacing
each new token of an encoding by the base pieces it was merged from gives exactly the base
tokenizer's encoding (so text whose words hold none of the new merges -- most general text --
encodes to the same ids as before); and a domain word the trainer merged encodes with the new
tokens. A merge whose result is already a token (two merge paths to one string) is dropped, so
each new token has one merge and one list of base pieces (``base_pieces``); so is every later
merge that builds on a dropped one.

Only Hugging Face ``tokenizer.json`` files whose model is BPE are extended (GPT-2, Llama 3,
Qwen and ``meshlm tokenizer train`` tokenizers); SentencePiece and tiktoken files are refused
with the format named. ``tokenizer_config.json`` / ``special_tokens_map.json`` beside the base
are copied beside the new file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from meshlm.data.readers import expand_inputs, read_all_documents
from meshlm.data.tokenizer import SPECIAL_TOKEN_CONFIG_FILES, find_tokenizer_file, tokenizer_format
from meshlm.errors import DataError

SYMBOL_BASE = 0xF0000
"""Base token id i is the symbol chr(SYMBOL_BASE + i) while the trainer runs: Unicode's
supplementary private-use planes (15 and 16) hold 131,068 such characters."""
MAX_BASE_VOCAB = 0x10FFFD - SYMBOL_BASE
WORD_BREAK = " "
BYTE_FALLBACK_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
EXTRA_MERGES = 1.25
"""The trainer is asked for this many times N merges (plus 64): a few are dropped (see above)."""


@dataclass
class Extension:
    """What ``extend_tokenizer`` wrote."""

    out: Path
    base_vocab_size: int
    new_tokens: dict[int, str] = field(default_factory=dict)
    """{new id: token string (the tokenizer.json spelling, e.g. 'Ġisinstance')}."""
    requested: int = 0

    @property
    def vocab_size(self) -> int:
        return self.base_vocab_size + len(self.new_tokens)


def extend_tokenizer(base: str | os.PathLike, inputs: Iterable[str | os.PathLike], num_new_tokens: int,
                     out: str | os.PathLike, text_key: str = "text", min_frequency: int = 2) -> Extension:
    """Add up to ``num_new_tokens`` domain tokens, learned on the documents of ``inputs``, to the
    BPE tokenizer ``base``; write the result to ``out`` (see the module docstring)."""
    if num_new_tokens < 1:
        raise DataError(f"--add {num_new_tokens}: the number of new tokens must be at least 1.")
    base_file = find_tokenizer_file(base)
    payload = read_bpe_payload(base_file)
    out = Path(out)
    if out.is_dir() or not out.suffix:  # a folder to write tokenizer.json into
        out = out / "tokenizer.json"
    if out.resolve() == base_file.resolve():
        raise DataError(f"--out {out} is the base tokenizer itself; write the extended tokenizer to a new file.")
    backend = tokenizers.Tokenizer.from_file(str(base_file))
    files = expand_inputs(inputs)
    words = segmented_words(backend, read_all_documents(files, text_key))
    if not words.strip():
        raise DataError(f"--input {' '.join(map(str, files))}: the domain text has no words to learn tokens from; "
                        "pass files holding domain text.")
    merges = domain_merges(words, num_new_tokens, min_frequency)
    extension = append_merges(payload, backend, merges, num_new_tokens, out)
    write_extended(payload, base_file, out)
    return extension


def read_bpe_payload(file: Path) -> dict:
    """The JSON of a tokenizer.json whose model is a byte- or character-level BPE; else DataError."""
    format_name = tokenizer_format(file)
    if format_name != "huggingface":
        raise DataError(f"{file}: a {format_name} tokenizer; `meshlm tokenizer extend` extends Hugging Face "
                        "tokenizer.json files with a BPE model only (convert it to tokenizer.json first).")
    try:
        payload = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{file}: not a readable tokenizer.json ({error}).") from error
    model = payload.get("model") if isinstance(payload, dict) else None
    kind = model.get("type") if isinstance(model, dict) else None
    if kind != "BPE" or not isinstance(model.get("vocab"), dict) or not isinstance(model.get("merges"), list):
        raise DataError(f"{file}: its model is {kind or 'not a tokenizer model'}, not BPE; `meshlm tokenizer "
                        "extend` extends BPE tokenizer.json files only (GPT-2, Llama 3, Qwen, `meshlm tokenizer train`).")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise DataError(f"{file}: a BPE with a continuing_subword_prefix or end_of_word_suffix (WordPiece-style "
                        "spelling), which `meshlm tokenizer extend` does not support; use a byte-level BPE.")
    base_size = id_count(payload)
    if base_size > MAX_BASE_VOCAB:
        raise DataError(f"{file}: {base_size} ids, more than the {MAX_BASE_VOCAB} `meshlm tokenizer extend` can "
                        "relabel while training; extend a smaller tokenizer.")
    return payload


def id_count(payload: dict) -> int:
    """1 + the largest id of a tokenizer.json's model vocabulary and added tokens."""
    added = [token["id"] for token in payload.get("added_tokens") or []]
    return 1 + max([*payload["model"]["vocab"].values(), *added])


def segmented_words(backend: tokenizers.Tokenizer, documents: Iterator[str]) -> str:
    """The domain text as the base tokenizer cuts it: each pre-tokenized word a run of symbols
    (one per base piece), words separated by spaces. Special, unknown and byte-fallback pieces
    end a word (nothing may be merged with them)."""
    breaking = set(backend.get_added_tokens_decoder())
    cache: dict[str, str] = {}

    def symbols(word: str) -> str:
        if word not in cache:
            pieces = backend.model.tokenize(word)
            cache[word] = "".join(WORD_BREAK if piece.id in breaking or BYTE_FALLBACK_PIECE.fullmatch(piece.value)
                                  else chr(SYMBOL_BASE + piece.id) for piece in pieces)
        return cache[word]

    lines = []
    for text in documents:
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        words = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        lines.append(WORD_BREAK.join(symbols(word) for word, _ in words))
    return "\n".join(lines)


def domain_merges(words: str, num_new_tokens: int, min_frequency: int) -> list[tuple[str, str]]:
    """The merges, in order, of a BPE trained on ``words`` (runs of base-piece symbols)."""
    alphabet = set(words) - {WORD_BREAK, "\n"}
    trainer_model = tokenizers.Tokenizer(models.BPE())
    trainer_model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wanted = int(num_new_tokens * EXTRA_MERGES) + 64
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + wanted, min_frequency=min_frequency,
                                  show_progress=False)
    trainer_model.train_from_iterator(words.split("\n"), trainer=trainer)
    merges = json.loads(trainer_model.to_str())["model"]["merges"]
    return [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in merges]


def append_merges(payload: dict, backend: tokenizers.Tokenizer, merges: list[tuple[str, str]], num_new_tokens: int,
                  out: Path) -> Extension:
    """Translate the trainer's merges back to base-token spellings and append them to ``payload``'s
    model, each with a new id after the base vocabulary, until ``num_new_tokens`` are added."""
    model = payload["model"]
    vocab: dict[str, int] = model["vocab"]
    taken = set(vocab) | {token["content"] for token in payload.get("added_tokens") or []}
    base_size = id_count(payload)
    extension = Extension(out=out, base_vocab_size=base_size, requested=num_new_tokens)
    spelled: dict[str, str | None] = {}  # trainer token -> its spelling, None when dropped

    def spelling(symbols: str) -> str | None:
        if len(symbols) == 1:
            return backend.id_to_token(ord(symbols) - SYMBOL_BASE)
        return spelled.get(symbols)

    strings_as_pairs = bool(model["merges"]) and isinstance(model["merges"][0], str)
    for left, right in merges:
        if len(extension.new_tokens) == num_new_tokens:
            break
        parts = spelling(left), spelling(right)
        token = None if None in parts else parts[0] + parts[1]
        if token is None or token in taken or (strings_as_pairs and " " in token):
            spelled[left + right] = None
            continue
        spelled[left + right] = token
        new_id = base_size + len(extension.new_tokens)
        vocab[token] = new_id
        taken.add(token)
        model["merges"].append(f"{parts[0]} {parts[1]}" if strings_as_pairs else list(parts))
        extension.new_tokens[new_id] = token
    return extension


def write_extended(payload: dict, base_file: Path, out: Path) -> None:
    """Write ``out`` (checked by loading it) and copy the base's special-token configs beside it."""
    text = json.dumps(payload, ensure_ascii=False, indent=2)
    try:
        tokenizers.Tokenizer.from_str(text)
    except Exception as error:  # the Rust library raises a bare Exception for every parse error
        raise DataError(f"{base_file}: the extended tokenizer does not load ({error}); this tokenizer.json "
                        "cannot be extended by appending merges.") from error
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(out.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, out)
    if out.parent.resolve() != base_file.parent.resolve():
        for name in SPECIAL_TOKEN_CONFIG_FILES:
            if (base_file.parent / name).is_file():
                temporary = out.parent / (name + ".tmp")
                shutil.copyfile(base_file.parent / name, temporary)
                os.replace(temporary, out.parent / name)


def base_pieces(base: tokenizers.Tokenizer, extended: tokenizers.Tokenizer) -> dict[int, list[int]]:
    """{id of each token of ``extended`` not in ``base``: the base ids it stands for}: the base
    pieces its merges join (so replacing every new token of an encoding by its pieces gives the
    base encoding), or, for a token without a merge (an added token), the base encoding of its text."""
    old = base.get_vocab(with_added_tokens=True)
    model = json.loads(extended.to_str())["model"]
    merged_from: dict[str, tuple[str, str]] = {}
    if model.get("type") == "BPE":
        for merge in model["merges"]:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            merged_from.setdefault(left + right, (left, right))

    def expand(token: str) -> list[int]:  # a merge's parts are shorter than its result: no cycles
        if token in old:
            return [old[token]]
        if token in merged_from:
            left, right = merged_from[token]
            return expand(left) + expand(right)
        return base.encode(extended.decode([extended.token_to_id(token)], skip_special_tokens=False),
                           add_special_tokens=False).ids

    return {token_id: expand(token) for token, token_id in extended.get_vocab(with_added_tokens=True).items()
            if token not in old}


def check_extends(base: tokenizers.Tokenizer, extended: tokenizers.Tokenizer, base_name: str,
                  extended_name: str) -> None:
    """DataError unless ``extended`` gives every token of ``base`` the same id."""
    new_vocab = extended.get_vocab(with_added_tokens=True)
    for token, token_id in sorted(base.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1]):
        if new_vocab.get(token) != token_id:
            raise DataError(f"{extended_name} does not keep the ids of {base_name} ({token!r} is id {token_id} "
                            f"there and {new_vocab.get(token)} here); build it with `meshlm tokenizer extend "
                            f"{base_name} ...`.")


# --- command line: `meshlm tokenizer extend` (registered by meshlm/data/tokenizer_training.py) --------------
def add_extend_arguments(actions) -> None:
    extend = actions.add_parser("extend", help="add domain tokens to a BPE tokenizer.json, keeping every old id",
                                description="Learn N domain tokens on --input (BPE merges continued from BASE's "
                                            "segmentation) and append them after BASE's vocabulary.")
    extend.add_argument("base", metavar="BASE", help="tokenizer.json (or a folder holding one) to extend")
    extend.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="domain text: .jsonl, .json, .txt, .parquet or .arrow files, or directories "
                             "(text files may be compressed: .gz, .bz2, .xz, .zst)")
    extend.add_argument("--add", type=int, required=True, metavar="N", help="number of new tokens")
    extend.add_argument("--out", required=True, metavar="NEW",
                        help="tokenizer.json to write, or a folder for it (the base's tokenizer_config.json "
                             "is copied beside it)")
    extend.add_argument("--text-key", default="text", help="JSON key / Parquet column of the text")
    extend.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen this often")


def run_extend(args) -> int:
    extension = extend_tokenizer(args.base, args.input, args.add, args.out, args.text_key, args.min_frequency)
    written = tokenizers.Tokenizer.from_file(str(extension.out))
    examples = ", ".join(repr(written.decode([token_id])) for token_id in list(extension.new_tokens)[:8])
    short = "" if len(extension.new_tokens) == extension.requested else \
        f" (of {extension.requested} asked: no other pair occurs --min-frequency times)"
    print(f"wrote {extension.out}: {extension.base_vocab_size} base ids kept, {len(extension.new_tokens)} new "
          f"tokens{short}, ids {extension.base_vocab_size}..{extension.vocab_size - 1}; first: {examples}")
    print(f"adapt a model to it with: meshlm adapt-vocab CKPT --tokenizer {extension.out} OUT")
    return 0


__all__ = ["Extension", "add_extend_arguments", "base_pieces", "check_extends", "extend_tokenizer", "run_extend"]
