"""``meshlm tokenizer encode | decode``: how a tokenizer cuts a text, and what ids read as.

    meshlm tokenizer encode data/demo/tokenizer.json --text "To be, or not to be"
    meshlm tokenizer encode runs/sft/checkpoints/step_200 --file prompt.txt --json
    meshlm tokenizer decode data/demo/tokenizer.json 412,88,1033

The quick check behind many data questions: does a domain word get one token or six, did the
chat markers stay single special tokens, what does the id in this error message stand for.
TOKENIZER is a tokenizer file or a folder holding one -- a model folder or a ``step_N``
checkpoint (``find_tokenizer_file``), in any format meshlm reads (Hugging Face, SentencePiece,
tiktoken). ``encode`` prints each token's position, id and piece (the text that token alone
decodes to, special tokens included; a piece that is part of a multi-byte character shows as
``\\ufffd``), then the counts; ``--json`` prints ``{"ids", "pieces", "tokens", "characters"}``.
Special tokens written in the text (``<|user|>``) are encoded as the special tokens they name, as
the chat template's rendering is.
"""

from __future__ import annotations

import json
from pathlib import Path

from meshlm.data.readers import read_whole_text
from meshlm.data.tokenizer import find_tokenizer_file, load_tokenizer
from meshlm.errors import ConfigError


def add_inspect_arguments(actions) -> None:
    encode = actions.add_parser("encode", help="print the tokens a text is cut into (ids and pieces)",
                                description="Print how a tokenizer cuts a text: each token's id and piece.")
    encode.add_argument("tokenizer", metavar="TOKENIZER", help="tokenizer file, or a model or checkpoint folder")
    source = encode.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to encode")
    source.add_argument("--file", help="encode this UTF-8 file's whole text (- reads standard input)")
    encode.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    decode = actions.add_parser("decode", help="print the text token ids stand for",
                                description="Print the text that comma-separated token ids decode to.")
    decode.add_argument("tokenizer", metavar="TOKENIZER", help="tokenizer file, or a model or checkpoint folder")
    decode.add_argument("ids", metavar="ID,ID,...", help="comma-separated token ids")


def open_tokenizer(path: str):
    try:
        return load_tokenizer(find_tokenizer_file(path))
    except FileNotFoundError as error:
        hint = (" A run directory keeps its tokenizer in each checkpoint: give runs/NAME/checkpoints/step_N."
                if (Path(path) / "checkpoints").is_dir() else "")
        raise ConfigError(f"{str(error).rstrip('.')}.{hint}") from None


def run_encode(args) -> int:
    tokenizer = open_tokenizer(args.tokenizer)
    text = args.text if args.text is not None else read_whole_text(args.file, "--file", "the text")
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([token], skip_special_tokens=False) for token in ids]
    if args.json:
        print(json.dumps({"ids": ids, "pieces": pieces, "tokens": len(ids), "characters": len(text)}))
        return 0
    width = len(str(max(ids, default=0)))
    for position, (token, piece) in enumerate(zip(ids, pieces)):
        print(f"{position:>6}  {token:>{width}}  {piece!r}")
    ratio = f" ({len(text) / len(ids):.2f} characters per token)" if ids else ""
    print(f"{len(ids)} tokens, {len(text)} characters{ratio}")
    return 0


def run_decode(args) -> int:
    tokenizer = open_tokenizer(args.tokenizer)
    try:
        ids = [int(part) for part in args.ids.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{args.ids!r} is not a comma-separated list of integer token ids.") from None
    outside = [token for token in ids if not 0 <= token < tokenizer.vocab_size]
    if outside:
        raise ConfigError(f"ids {outside} are outside this tokenizer's {tokenizer.vocab_size} ids (0 to "
                          f"{tokenizer.vocab_size - 1}).")
    print(tokenizer.decode(ids, skip_special_tokens=False))
    return 0


__all__ = ["add_inspect_arguments", "run_decode", "run_encode"]
