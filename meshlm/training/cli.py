"""``meshlm train``: train (or resume) a model from a YAML config plus dotted overrides.

    meshlm train configs/tiny.yaml
    meshlm train configs/hybrid-tiny.yaml train.steps=2000 optim.lr=1e-3 train.run_dir=runs/h
    python -m meshlm train configs/tiny.yaml          (the same)
    meshlm train --list-keys                          every key, its default and what it means
    meshlm train configs/tiny.yaml --plan             first print `meshlm plan`'s prediction for this
                                                      layout; the trainer logs measured beside it

    torchrun --nproc_per_node 4 -m meshlm train configs/tiny.yaml parallel.tp=2 parallel.dp=2 parallel.sp=true
                                  tensor (+ sequence) parallel over pairs of ranks, data parallel
                                  over the pairs; the same loss curve as one process (see
                                  meshlm/parallel/ and meshlm/training/trainer.py)

Re-running the same command continues from the newest checkpoint in ``train.run_dir``. A bad
config (unknown key, wrong type, invalid value) exits with status 2 and one sentence saying
what to change; unknown keys come with the closest known names. A collective that fails because
a peer process died or hung exits with status 3 and names the collective and its group; with
``torchrun --max-restarts N`` the job then restarts from the newest complete checkpoint. Too many
non-finite steps in a row with train.on_nonfinite=stop exit with status 1
(see meshlm/training/fault_tolerance.py); so does a step that runs out of memory, after one
sentence with the numbers and the settings that lower them (meshlm/training/out_of_memory.py).
SIGTERM, SIGINT (Ctrl-C) or train.time_limit_minutes save a checkpoint at the end of the current
step and exit with status 0, after one line saying where to resume (see
meshlm/training/stop_requests.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import textwrap

from meshlm.errors import ConfigError


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="the run's YAML config")
    parser.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                        help="override config values, e.g. train.steps=200 model.pattern='M*-E'")
    parser.add_argument("--list-keys", action="store_true", help="print every config key with its default and meaning")
    parser.add_argument("--print-config", action="store_true",
                        help="print the run's whole config as YAML (the file, the overrides and every default, "
                             "checked) and exit without training; the output is itself a config file")
    parser.add_argument("--plan", action="store_true",
                        help="first print `meshlm plan`'s prediction for this run's layout; the trainer then logs "
                             "its measured peak memory and step time beside it (metrics.jsonl: event plan_check)")


def run(args, plan=None) -> int:
    """``plan``: how ``--plan`` gets its prediction, ``plan(config) -> dict | None`` (plain data:
    ``memory_bytes_per_gpu``, ``step_time_s``). The planner sits above training in the package's
    layers, so the ``meshlm`` command hands it in (meshlm/cli.py; meshlm/planning/configured.py)."""
    if args.list_keys:
        print("\n".join(key_descriptions()))
        return 0
    config_path, overrides = config_and_overrides(args)
    if config_path is None and not overrides:
        raise ConfigError("give a config file, e.g. `meshlm train configs/tiny.yaml` "
                          "(`meshlm train --list-keys` lists every key).")
    from meshlm.config import load_run_config, parse_override
    from meshlm.training.fault_tolerance import CollectiveFailure, NonFiniteTrainingStop, exit_after_collective_failure
    from meshlm.training.out_of_memory import OutOfMemoryStop
    from meshlm.training.trainer import train

    config = load_run_config(config_path, overrides)
    if getattr(args, "print_config", False):
        print(resolved_config_yaml(config, config_path, overrides), end="")
        return 0
    if getattr(args, "plan", False) and plan is None:
        raise ConfigError("--plan needs the planner, which the `meshlm` command hands in: run "
                          "`meshlm train CONFIG --plan` (or python -m meshlm train ...).")
    predicted = plan(config) if getattr(args, "plan", False) else None
    try:
        result = train(config, command_line_keys=[parse_override(text)[0] for text in overrides],
                       predicted=predicted)
    except CollectiveFailure as failure:  # a peer died or hung: leave now, torchrun may restart the job
        exit_after_collective_failure(failure)
    except NonFiniteTrainingStop as stop:
        return report_nonfinite_stop("meshlm train", stop)
    except OutOfMemoryStop as stop:
        return report_out_of_memory("meshlm train", stop)
    finally:
        leave_process_group()
    if int(os.environ.get("RANK", "0")) != 0 or result.stopped_by is not None:
        return 0  # global rank 0 alone prints; a stopped run has printed its line already
    if result.already_complete is not None:
        print(f"meshlm train: {result.already_complete}")
        return 0
    summary = f"step {result.step}/{config.train.steps}"
    if result.losses:
        summary += f", last loss {result.losses[max(result.losses)]:.4f}"
    if result.val_losses:
        summary += f", last validation loss {result.val_losses[max(result.val_losses)]:.4f}"
    print(f"meshlm train: done: {summary}; run directory {result.run_dir}")
    return 0


def resolved_config_yaml(config, config_path: str | None, overrides: list[str]) -> str:
    """``config`` as YAML, headed by a comment naming where it came from (``--print-config``)."""
    import shlex

    import yaml

    source = " ".join(shlex.quote(part) for part in [config_path or "(defaults)", *overrides])
    return f"# meshlm train {source}\n" + yaml.safe_dump(config.to_dict(), sort_keys=False)


def report_out_of_memory(command: str, stop: Exception) -> int:
    """Print why (the rank that ran out, which need not be rank 0, says it) and return the exit
    status ``EXIT_OUT_OF_MEMORY``; under torchrun leave at once with it (``os._exit``), as after a
    peer's failure: the other ranks wait in a collective this one will never join, which a
    process-group teardown could wait on. Shared by ``meshlm train`` and ``meshlm rl``."""
    from meshlm.training.out_of_memory import EXIT_OUT_OF_MEMORY

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = f"rank {os.environ.get('RANK', '0')}: " if world_size > 1 else ""
    print(f"{command}: error: {rank}{stop}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if world_size > 1:
        os._exit(EXIT_OUT_OF_MEMORY)
    return EXIT_OUT_OF_MEMORY


def report_nonfinite_stop(command: str, stop: Exception) -> int:
    """The exit status (1) of a run that train.on_nonfinite=stop ended: every rank raised the same
    ``NonFiniteTrainingStop`` at the same step (fault_tolerance.py), so every rank exits alike and
    global rank 0 alone prints why to stderr. Shared by ``meshlm train`` and ``meshlm rl``."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{command}: stopped: {stop}", file=sys.stderr)
    return 1


def config_and_overrides(args) -> tuple[str | None, list[str]]:
    """(CONFIG.yaml or None, the dotted overrides) from the positional arguments: a first argument
    that is an override rather than a YAML file starts the overrides (no file)."""
    config_path, overrides = args.config, list(args.overrides)
    if config_path is not None and "=" in config_path and not config_path.endswith((".yaml", ".yml")):
        config_path, overrides = None, [config_path, *overrides]
    return config_path, overrides


def leave_process_group() -> None:
    """Destroy the process group a torchrun launch joined (a no-op for a single process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# --- --list-keys --------------------------------------------------------------------------------------
def field_docstrings(cls) -> dict[str, str]:
    """The string literal written under each field of a dataclass (our config convention)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = following.value.value
    return docs


ABBREVIATIONS = {"al.", "e.g.", "i.e.", "etc.", "cf.", "vs.", "approx.", "resp.", "fig.", "eq.", "sec.", "no."}
"""Words ending in a period that do not end a sentence ("Su et al. 2021", "e.g. Llama")."""


def first_sentence(text: str) -> str:
    """The docstring's first sentence: up to the first word that ends in '.', '!' or '?' and is not
    an abbreviation. A decimal point is inside a word ("0.5"), so it never ends one."""
    words = " ".join(text.split()).split(" ")
    for index, word in enumerate(words[:-1]):
        bare = word.rstrip("\"')]").lstrip("(\"'`")
        if bare.endswith((".", "!", "?")) and bare.lower() not in ABBREVIATIONS:
            return " ".join(words[:index + 1])
    return " ".join(words)


def key_descriptions() -> list[str]:
    """``section.key = default  first sentence of its docstring`` for every config key."""
    from meshlm.config import SECTIONS

    lines = []
    for section, cls in SECTIONS.items():
        docs = field_docstrings(cls)
        for config_field in dataclasses.fields(cls):
            if not config_field.init:
                continue
            default = (config_field.default_factory() if config_field.default_factory is not dataclasses.MISSING
                       else config_field.default)
            lines.append(f"{section}.{config_field.name} = {default!r}  # "
                         f"{first_sentence(docs.get(config_field.name, ''))}")
    return lines


__all__ = ["ABBREVIATIONS", "add_arguments", "config_and_overrides", "field_docstrings", "first_sentence",
           "key_descriptions", "leave_process_group", "resolved_config_yaml", "run"]
