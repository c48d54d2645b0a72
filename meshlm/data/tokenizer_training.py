"""Training a byte-level BPE tokenizer on our own text.

Byte-pair encoding (Sennrich et al. 2016, "Neural Machine Translation of Rare Words with
Subword Units") starts from single symbols and repeatedly merges the most frequent adjacent
pair into a new symbol until the vocabulary has the requested size. The *byte-level* variant
(Radford et al. 2019, GPT-2) starts from the 256 byte values instead of characters, so any
string, in any language or encoding, can be tokenized with no unknown token; a pre-tokenizer
first splits text into word-like pieces so merges never cross a word and a space.

We use the Hugging Face ``tokenizers`` library for the work (it is written in Rust and
streams its input), and add three special tokens with fixed ids 0, 1, 2: ``<|bos|>`` (begin
of sequence), ``<|eos|>`` (end of a document: the preprocessor appends it with
``--append-eos``) and ``<|pad|>``. The result is a ``tokenizer.json`` and, beside it, a
``tokenizer_config.json`` naming the three tokens the way Hugging Face does, so both
``meshlm.data.tokenizer.load_tokenizer`` and ``transformers.AutoTokenizer`` can read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshlm.data.readers import expand_inputs, read_all_documents
from meshlm.errors import DataError

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BYTE_ALPHABET_SIZE = 256
CONFIG_FILE = "tokenizer_config.json"


def train_tokenizer(inputs: Iterable[str | os.PathLike], vocab_size: int, out: str | os.PathLike,
                    text_key: str = "text", min_frequency: int = 2) -> Path:
    """Train a byte-level BPE tokenizer on the documents of ``inputs``; write ``out``
    (``tokenizer.json``) and ``tokenizer_config.json`` beside it. Returns ``out``."""
    smallest = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise DataError(f"--vocab-size {vocab_size} is too small: a byte-level BPE vocabulary holds the "
                        f"{BYTE_ALPHABET_SIZE} bytes and {len(SPECIAL_TOKENS)} special tokens, so use at "
                        f"least {smallest}.")
    files = expand_inputs(inputs)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(read_all_documents(files, text_key), trainer=trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(out.name + ".tmp")
    tokenizer.save(str(temporary))
    os.replace(temporary, out)
    write_tokenizer_config(out.parent)
    return out


def write_tokenizer_config(directory: Path) -> Path:
    """``tokenizer_config.json`` naming the special tokens (Hugging Face's keys)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    path = directory / CONFIG_FILE
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(temporary, path)
    return path


# --- command line: `meshlm tokenizer train` (and `extend`: tokenizer_extension.py; `encode`/`decode`:
# tokenizer_inspect.py) ---------------------------------------------------------------------------
def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="tokenizer_action", metavar="ACTION")
    actions.required = True
    train = actions.add_parser("train", help="train a byte-level BPE tokenizer on text files",
                               description="Train a byte-level BPE tokenizer with <|bos|>, <|eos|>, <|pad|>.")
    train.add_argument("--input", nargs="+", required=True, metavar="FILE",
                       help=".jsonl, .json, .txt (documents separated by blank lines), .parquet or .arrow files, or "
                            "directories; text files may be compressed (.gz, .bz2, .xz, .zst)")
    train.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, special tokens included")
    train.add_argument("--out", required=True, help="tokenizer.json to write (tokenizer_config.json goes beside it)")
    train.add_argument("--text-key", default="text", help="JSON key / Parquet column of the text")
    train.add_argument("--min-frequency", type=int, default=2, help="merge only pairs seen this often")
    from meshlm.data.tokenizer_extension import add_extend_arguments

    add_extend_arguments(actions)  # `meshlm tokenizer extend`
    from meshlm.data.tokenizer_inspect import add_inspect_arguments

    add_inspect_arguments(actions)  # `meshlm tokenizer encode | decode`


def run(args) -> int:
    if args.tokenizer_action == "extend":
        from meshlm.data.tokenizer_extension import run_extend

        return run_extend(args)
    if args.tokenizer_action in ("encode", "decode"):
        from meshlm.data.tokenizer_inspect import run_decode, run_encode

        return run_encode(args) if args.tokenizer_action == "encode" else run_decode(args)
    out = train_tokenizer(args.input, args.vocab_size, args.out, args.text_key, args.min_frequency)
    vocab_size = Tokenizer.from_file(str(out)).get_vocab_size(with_added_tokens=True)
    print(f"wrote {out} ({vocab_size} tokens) and {out.parent / CONFIG_FILE}")
    return 0
