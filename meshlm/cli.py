"""The ``meshlm`` command. Each sub-command lives in its own module with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches.

Errors a user can fix (bad config, missing file, corrupt checkpoint), and the findings of the
collectives' checks (``meshlm/parallel/collective_log.py``), print one clear line and exit with
status 2, without a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from meshlm.errors import CheckpointError, ConfigError, DataError
from meshlm.parallel.collective_log import CollectiveError, CollectiveMismatch

# name -> (module, one-line help)
COMMANDS = {
    "checkpoint": ("meshlm.checkpoint.cli", "inspect or consolidate a (sharded) training checkpoint"),
    "convert": ("meshlm.hf.cli", "convert between Hugging Face and meshlm checkpoints"),
    "generate": ("meshlm.inference.cli", "generate text from a meshlm model or checkpoint"),
    "train": ("meshlm.training.cli", "train (or resume) a model from a YAML config and dotted overrides"),
    "tokenizer": ("meshlm.data.tokenizer_training", "train a byte-level BPE tokenizer"),
    "preprocess": ("meshlm.data.preprocess", "tokenize text files into a token store (PREFIX.bin + PREFIX.idx)"),
    "data": ("meshlm.data.cli", "data utilities: build the demo corpus, inspect a token store"),
    "upcycle": ("meshlm.adapt.cli", "turn a dense model or checkpoint into an MoE model with the same outputs"),
    "demo": ("meshlm.demo", "build the demo corpus, train a small hybrid model, plot and sample from it"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="Train and use meshlm language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


USER_ERRORS = (ConfigError, CheckpointError, DataError, FileNotFoundError, CollectiveError)
"""Errors printed as one line, exit status 2, no traceback: the user's to fix, and the collective
checks' findings (a tensor off the run's device, ranks whose collectives disagree), whose one
sentence already names the operation, the group, the ranks and the step."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except USER_ERRORS as error:
        if not _repeated_on_another_rank(error):
            print(f"meshlm {args.command}: error: {error}", file=sys.stderr)
        return 2


def _repeated_on_another_rank(error: BaseException) -> bool:
    """Under torchrun a config error is found by every rank alike (before any collective), and so
    is a collective mismatch (every rank compares the same records); only global rank 0 prints
    them, so the user reads them once. Other errors may be one rank's own."""
    return isinstance(error, (ConfigError, CollectiveMismatch)) and int(os.environ.get("RANK", "0")) != 0


if __name__ == "__main__":
    raise SystemExit(main())
