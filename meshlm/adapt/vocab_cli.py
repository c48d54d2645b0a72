"""``meshlm adapt-vocab``: a model or checkpoint -> a model folder for an extended tokenizer.

    meshlm tokenizer extend data/demo/tokenizer.json --input python.jsonl --add 2048 --out ext/tokenizer.json
    meshlm adapt-vocab runs/demo --tokenizer ext/tokenizer.json models/demo-python

CKPT is a model folder, a training checkpoint's step folder or a run directory (its newest
checkpoint; ``meshlm/checkpoint/locate.py``). The base tokenizer is the one in CKPT (checkpoints
carry the run's tokenizer) unless ``--base-tokenizer`` names it; the new tokenizer must keep all
of its ids. OUT gets ``config.json`` (the new vocab_size), ``model.safetensors`` and the new
tokenizer's files, written to a temporary folder beside it and renamed into place, so OUT is
either complete or absent; the model is read and written one tensor at a time. The embedding
(and untied output head) gets a row per new token, the mean of its base pieces' rows; every old
row is kept, so the old tokens' logits are unchanged (meshlm/adapt/vocab.py). The command prints
the domain-adaptive pretraining steps: tokenize domain and general text with the new tokenizer
and continue training from OUT on a blend of the two.
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path

import tokenizers

from meshlm.checkpoint.files import copy_tokenizer, folder_written_atomically
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.materialize import read_tensor
from meshlm.checkpoint.model_files import (check_stored_tensors, read_model_config, source_file, weights_source,
                                           write_model_folder)
from meshlm.config import format_override
from meshlm.data.tokenizer import find_tokenizer_file, load_tokenizer, tokenizer_format
from meshlm.data.tokenizer_extension import base_pieces, check_extends
from meshlm.errors import CheckpointError, DataError
from meshlm.models.lora import require_no_adapters


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="meshlm model folder, training checkpoint or run directory")
    parser.add_argument("--tokenizer", required=True, metavar="NEW",
                        help="the extended tokenizer.json (from `meshlm tokenizer extend`), or its folder")
    parser.add_argument("out", metavar="OUT", help="model folder to write (must not exist)")
    parser.add_argument("--base-tokenizer", default=None, metavar="BASE",
                        help="the model's own tokenizer (default: the one in CKPT)")
    parser.add_argument("--pad-to-multiple", type=int, default=None, metavar="M",
                        help="when the vocabulary grows, round it up to a multiple of M (default: 128 if the "
                             "model's vocab_size is a multiple of 128, else 1)")


def run(args: argparse.Namespace) -> int:
    from meshlm.adapt.vocab import vocab_plan

    out = Path(args.out)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new OUT folder or remove it.")
    if args.pad_to_multiple is not None and args.pad_to_multiple < 1:
        raise CheckpointError(f"--pad-to-multiple {args.pad_to_multiple}: use a positive multiple (1 for none).")
    source_dir = resolve_model_dir(args.checkpoint)
    require_no_adapters(read_model_config(source_dir), source_dir, "adapt-vocab")
    base_file = base_tokenizer_file(source_dir, args.base_tokenizer)
    new_file = huggingface_file(args.tokenizer, "--tokenizer")
    base, new = backend_of(base_file), backend_of(new_file)
    check_extends(base, new, str(base_file), str(new_file))
    pieces = base_pieces(base, new)
    base_size = base.get_vocab_size(with_added_tokens=True)
    config = read_model_config(source_dir)
    source = weights_source(source_dir)
    check_stored_tensors(config, source.layout, str(source_file(source_dir)))
    adapted, plan = vocab_plan(config, source.layout, partial(read_tensor, source), pieces, base_size,
                               args.pad_to_multiple)
    with folder_written_atomically(out) as temporary:  # the model folder with the new tokenizer
        write_model_folder(temporary, adapted, plan)
        copy_tokenizer(new_file, temporary)
    grown = adapted.vocab_size - config.vocab_size
    rows = f"grown by {grown} rows" if grown else "spare rows reused, vocab_size kept"
    print(f"wrote {out}: {len(pieces)} new tokens (ids {base_size}..{base_size + len(pieces) - 1}) on a model of "
          f"vocab_size {config.vocab_size} -> {adapted.vocab_size} ({rows}); each new row is the mean of its base "
          "pieces' rows, every old row is unchanged, so the old tokens' logits are too")
    print_dapt_commands(out, adapted.vocab_size)
    return 0


def base_tokenizer_file(source_dir: Path, chosen: str | None) -> Path:
    """``--base-tokenizer``, else the tokenizer.json inside the model folder."""
    if chosen is not None:
        return huggingface_file(chosen, "--base-tokenizer")
    try:
        file = find_tokenizer_file(source_dir)
    except FileNotFoundError as error:
        raise CheckpointError(f"{source_dir} holds no tokenizer file, and the new rows are built from the base "
                              "tokenizer's pieces; pass the model's tokenizer as --base-tokenizer.") from error
    return huggingface_file(file, f"the tokenizer of {source_dir}")


def huggingface_file(path: str | os.PathLike, what: str) -> Path:
    file = find_tokenizer_file(path)
    if tokenizer_format(file) != "huggingface":
        raise DataError(f"{what}: {file} is a {tokenizer_format(file)} tokenizer; `meshlm adapt-vocab` works with "
                        "Hugging Face tokenizer.json files extended by `meshlm tokenizer extend`.")
    return file


def backend_of(file: Path) -> tokenizers.Tokenizer:
    return load_tokenizer(file).backend  # DataError naming the file when it does not parse



def print_dapt_commands(out: Path, vocab_size: int) -> None:
    """The domain-adaptive pretraining steps (ChipNeMo): retokenize, then train on a domain/general blend."""
    tokenizer = out / "tokenizer.json"
    settings = " ".join([f"train.init_from={out}", format_override("model.vocab_size", vocab_size),
                         f"data.tokenizer={tokenizer}", "data.blend=null",
                         format_override("data.prefixes", ["data/dapt/domain", "data/dapt/general"]),
                         format_override("data.weights", [0.9, 0.1])])
    print("domain-adaptive pretraining: tokenize domain and general text with the new tokenizer,")
    for kind in ("domain", "general"):
        print(f"  meshlm preprocess --input {kind.upper()}_FILES --tokenizer {tokenizer} "
              f"--out data/dapt/{kind} --append-eos")
    print("then continue training on a blend of them (or a blend file whose tokenizer is the new one, data.blend=FILE):")
    print(f"  meshlm train CONFIG {settings}")


__all__ = ["add_arguments", "base_tokenizer_file", "print_dapt_commands", "run"]
