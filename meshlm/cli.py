"""The ``meshlm`` command. Each sub-command lives in its own module with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches.

Errors a user can fix (bad config, missing file, corrupt checkpoint), and the findings of the
collectives' checks (``meshlm/parallel/collective_log.py``), print one clear line and exit with
status 2, without a traceback; anything else is a bug and keeps its traceback. Warnings raised
from meshlm's own code print as one line too (``meshlm train: note: ...``).

Only the module of the command being run is imported, so ``meshlm --help`` answers without
loading torch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import warnings
from functools import partial
from pathlib import Path

from meshlm.errors import CheckpointError, ConfigError, DataError
from meshlm.parallel.collective_log import CollectiveError, CollectiveMismatch

# name -> (module, one-line help)
COMMANDS = {
    "checkpoint": ("meshlm.checkpoint.cli", "inspect or consolidate a (sharded) training checkpoint"),
    "convert": ("meshlm.hf.cli", "convert between Hugging Face and meshlm checkpoints"),
    "generate": ("meshlm.inference.cli", "generate text from a meshlm model or checkpoint"),
    "chat": ("meshlm.inference.chat_session", "chat with a fine-tuned model, turn by turn (/think, /no_think, /reset)"),
    "serve": ("meshlm.inference.serve_cli", "serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions)"),
    "train": ("meshlm.training.cli", "train (or resume) a model from a YAML config and dotted overrides"),
    "status": ("meshlm.training.status_cli", "where a run stands: finished, stopped or not, loss, speed, time left, checkpoints"),
    "plot": ("meshlm.training.plot_cli", "plot the metrics of one or more runs side by side (loss, grad norm, lr, tokens/s, ...)"),
    "tokenizer": ("meshlm.data.tokenizer_training", "train or extend a byte-level BPE tokenizer"),
    "preprocess": ("meshlm.data.preprocess", "tokenize text files into a token store (PREFIX.bin + PREFIX.idx)"),
    "data": ("meshlm.training.data_cli", "data utilities: build the demo corpus, inspect a token store, show a run's samples"),
    "upcycle": ("meshlm.adapt.cli", "turn a dense model or checkpoint into an MoE model with the same outputs"),
    "prune": ("meshlm.adapt.prune_cli", "prune a model to its most important units and blocks (Minitron)"),
    "merge-lora": ("meshlm.adapt.lora_cli", "fold a LoRA model's adapters into its weights (a plain model folder)"),
    "adapt-vocab": ("meshlm.adapt.vocab_cli", "resize a model's embedding and head to an extended tokenizer (new rows: mean of their pieces)"),
    "eval": ("meshlm.evaluation.cli", "perplexity, bits per byte and multiple-choice accuracy of a model or checkpoint"),
    "score": ("meshlm.evaluation.score_cli", "a reward model's scores of preference pairs or rated replies (pairwise accuracy, MSE)"),
    "plan": ("meshlm.planning.cli", "predict memory per GPU and step time of the parallel layouts of a run on N GPUs"),
    "power": ("meshlm.planning.power_cli", "a job's power trace: swing (MW), ramp rates, spectrum, and the cost of a power floor"),
    "rl": ("meshlm.rl.cli", "reinforcement learning with verifiable rewards (GRPO) from an SFT'ed model"),
    "demo": ("meshlm.demo", "build the demo corpus, train a small hybrid model, plot and sample from it"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``meshlm`` parser, with the arguments of ``command`` only: its module is the one imported,
    the others are listed by name and help line. So ``meshlm --help`` imports no command (nor
    torch) and answers at once, and ``meshlm train --help`` shows train's arguments."""
    parser = argparse.ArgumentParser(prog="meshlm", description="Train and use meshlm language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            module.add_arguments(command_parser)
            command_parser.set_defaults(_run=module.run)
            if name == "train":  # --plan: the planner is above training in the layer order, so it is handed in here
                command_parser.set_defaults(_run=partial(module.run, plan=plan_before_training))
    return parser


def plan_before_training(config) -> dict | None:
    """``meshlm train --plan``: print the planner's prediction for the configured layout (rank 0) and
    return it as plain data for the trainer (meshlm/planning/configured.py)."""
    from meshlm.planning.configured import print_configured_prediction

    return print_configured_prediction(config)


def chosen_command(argv: list[str]) -> str | None:
    """The sub-command ``argv`` names: its first word that is not an option (``meshlm`` itself has
    no options but --help), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


USER_ERRORS = (ConfigError, CheckpointError, DataError, FileNotFoundError, CollectiveError)
"""Errors printed as one line, exit status 2, no traceback: the user's to fix, and the collective
checks' findings (a tensor off the run's device, ranks whose collectives disagree), whose one
sentence already names the operation, the group, the ranks and the step."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(chosen_command(argv))
    parsers = command_parsers(parser, argv)
    # Said by the (sub-)command that got them, with its usage, not by bare ``meshlm``; options no
    # parser knows are looked for first, as they are the likely cause of a missing required
    # argument (``--promt TEXT``), which argparse would report instead.
    if unknown := unknown_long_options(parsers, argv):
        parsers[-1].error(unrecognized_message(parsers[-1], unknown))
    args, unrecognized = parser.parse_known_args(argv)
    if unrecognized:
        parsers[-1].error(unrecognized_message(parsers[-1], unrecognized))
    with warnings.catch_warnings():  # restores warnings.showwarning on the way out
        warnings.showwarning = partial(_show_notice, args.command, warnings.showwarning)
        try:
            return int(args._run(args) or 0)
        except USER_ERRORS as error:
            if not _repeated_on_another_rank(error):
                print(f"meshlm {args.command}: error: {error}", file=sys.stderr)
            return 2


def command_parsers(parser: argparse.ArgumentParser, argv: list[str]) -> list[argparse.ArgumentParser]:
    """The parsers of the (sub-)commands ``argv`` names, outermost first (``meshlm checkpoint
    inspect ...``: meshlm's, checkpoint's, inspect's), found by following argv's words through each
    level's sub-commands."""
    parsers = [parser]
    for word in argv:
        subcommands = next((action.choices for action in parsers[-1]._actions
                            if isinstance(action, argparse._SubParsersAction)), {})
        if word in subcommands:
            parsers.append(subcommands[word])
    return parsers


def unknown_long_options(parsers: list[argparse.ArgumentParser], argv: list[str]) -> list[str]:
    """The ``--name`` / ``--name=value`` words of ``argv`` (before a bare ``--``) that no parser on
    the command's path takes, whole or abbreviated (an abbreviation of several is argparse's to call
    ambiguous)."""
    known = [option for parser in parsers for action in parser._actions for option in action.option_strings
             if option.startswith("--")]
    unknown = []
    for word in argv:
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if word.startswith("--") and not any(option.startswith(name) for option in known):
            unknown.append(word)
    return unknown


def unrecognized_message(parser: argparse.ArgumentParser, unrecognized: list[str]) -> str:
    """argparse's "unrecognized arguments" with what the user probably meant: an option given for
    a positional argument (``meshlm train --config run.yaml``, as other trainers spell it: the
    config is given by position), or the command's options closest to a misspelled one."""
    message = f"unrecognized arguments: {' '.join(unrecognized)}."
    options = [option for action in parser._actions for option in action.option_strings]
    positionals = {action.dest.replace("_", "-"): action.metavar or action.dest
                   for action in parser._actions if not action.option_strings and action.dest != "help"}
    for word in unrecognized:
        if not word.startswith("--"):
            continue
        name = word.split("=", 1)[0]
        bare = name[2:].replace("_", "-").lower()
        positional = positionals.get(bare) or positionals.get(bare.removesuffix("-file"))
        if positional is not None:
            message += (f" {positional} is a positional argument: give it without {name}"
                        f" ({parser.prog} {positional} ...).")
        elif close := difflib.get_close_matches(name, options, n=3, cutoff=0.6):
            message += f" Did you mean {', '.join(close)} (not {name})?"
    return message


PACKAGE_DIR = Path(__file__).resolve().parent


def _show_notice(command: str, show_other, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning raised from meshlm's code (a resumed run's changed settings, ...) is a notice for
    the user: one line naming the command, ``meshlm train: note: ...``, not Python's
    ``file:line: UserWarning`` and source line. Other libraries' warnings keep Python's format."""
    if Path(filename).resolve().is_relative_to(PACKAGE_DIR):
        print(f"meshlm {command}: note: {message}", file=sys.stderr if file is None else file)
    else:
        show_other(message, category, filename, lineno, file, line)


def _repeated_on_another_rank(error: BaseException) -> bool:
    """Under torchrun a config error is found by every rank alike (before any collective), and so
    is a collective mismatch (every rank compares the same records); only global rank 0 prints
    them, so the user reads them once. Other errors may be one rank's own."""
    return isinstance(error, (ConfigError, CollectiveMismatch)) and int(os.environ.get("RANK", "0")) != 0


if __name__ == "__main__":
    raise SystemExit(main())
