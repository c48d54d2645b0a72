"""``meshlm eval RUN --every-checkpoint``: each checkpoint of a run evaluated, its figures kept by step.

    meshlm eval runs/x --every-checkpoint --task hellaswag.jsonl arc.jsonl --data data/valid
    meshlm plot runs/x --metric eval_hellaswag_acc eval_valid_loss

How a benchmark's score moves over training -- the downstream curve that a validation loss does
not show -- comes from evaluating the checkpoints one after another (Pythia's suites are made
this way). Every ``step_N`` of ``RUN/checkpoints`` is loaded in turn, oldest first, into one
layout (built once: one process, or under torchrun data-parallel ranks and ``--tp`` groups,
as ``meshlm eval``), scored on the same ``--data`` and ``--task`` files (read and tokenized once),
and one record per checkpoint is appended to ``RUN/evaluations.jsonl``::

    {"step": 200, "checkpoint": "runs/x/checkpoints/step_200", "eval_hellaswag_acc": 0.31,
     "eval_hellaswag_acc_norm": 0.33, "eval_valid_loss": 3.21, "eval_valid_bits_per_byte": 1.02,
     "settings": {...}}

The metric names are ``eval_`` + the file's stem (non-alphanumerics as ``_``) + the figure;
``meshlm plot RUN`` reads them beside metrics.jsonl. ``settings`` records the data, tasks and
window; a checkpoint already evaluated with the same settings is skipped, so the command can be
run again while training goes on (a cron job, a sidecar) and only scores what is new. A
checkpoint the trainer prunes (``train.keep_checkpoints``) while it is read is skipped with a
note; ``train.keep_checkpoints=0`` keeps them all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from meshlm.checkpoint.folders import checkpoint_dirs, complete_checkpoints
from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.model_files import read_model_config, trained_seq_len
from meshlm.errors import CheckpointError, ConfigError
from meshlm.evaluation.loading import EvaluationModel, default_device, evaluation_context, load_for_layout
from meshlm.evaluation.multiple_choice import read_task
from meshlm.evaluation.perplexity import open_sources
from meshlm.evaluation.results import evaluate_model, perplexity_line, task_line
from meshlm.inference.cli import find_tokenizer
from meshlm.parallel.plain_collectives import barrier, broadcast_objects
from meshlm.training.metrics import EVALUATIONS_FILE, metric_word, read_metrics


def metric_stem(name: str) -> str:
    """'data/hellaswag.jsonl' -> 'hellaswag'; 'all' (the total of several sources) stays 'all'."""
    return metric_word(Path(name).name.split(".")[0])


def figures(perplexities, tasks) -> dict[str, float]:
    """The metrics of one checkpoint's results, named ``eval_<stem>_<figure>``."""
    values = {}
    for result in perplexities:
        values[f"eval_{metric_stem(result.name)}_loss"] = result.loss
        if result.bits_per_byte is not None:
            values[f"eval_{metric_stem(result.name)}_bits_per_byte"] = result.bits_per_byte
    for result in tasks:
        values[f"eval_{metric_stem(result.name)}_acc"] = result.acc
        values[f"eval_{metric_stem(result.name)}_acc_norm"] = result.acc_norm
    return values


def series_settings(args, seq_len: int) -> dict:
    return {"data": list(args.data or []), "tasks": list(args.task or []), "seq_len": seq_len,
            "text_key": args.text_key, "append_eos": args.append_eos, "txt_documents": args.txt_documents}


def evaluated_steps(run_dir: Path, settings: dict) -> set[int]:
    """Steps of RUN/evaluations.jsonl already evaluated with ``settings``."""
    return {record["step"] for record in read_metrics(run_dir / EVALUATIONS_FILE)
            if record.get("settings") == settings and "step" in record}


def append_record(path: Path, record: dict) -> None:
    """One line added whole (a crash leaves at most a torn last line, which readers skip)."""
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def run_checkpoints(run_dir: Path, context) -> list[tuple[int, Path]]:
    """The run's complete checkpoints, oldest first; under torchrun rank 0's list, so that every
    rank loads the same ones while a trainer may be adding and pruning them."""
    return broadcast_objects([complete_checkpoints(run_dir)], context.world_group)[0]


def evaluate_series(args) -> int:
    """Evaluate every checkpoint of the run ``args.checkpoint`` not yet in its evaluations.jsonl."""
    run_dir = Path(args.checkpoint)
    found = checkpoint_dirs(run_dir)
    if not found:
        raise ConfigError(f"{run_dir} holds no checkpoints (checkpoints/step_N); --every-checkpoint takes a run "
                          "directory, and train.save_every with train.keep_checkpoints=0 keeps every checkpoint.")
    first = resolve_model_dir(found[0][1])
    device = default_device() if args.device is None else torch.device(args.device)
    context = evaluation_context(read_model_config(first), device, args.tp)
    tokenizer = find_tokenizer(args.tokenizer, first, run_dir)
    seq_len = args.seq_len or trained_seq_len(first)
    sources = (open_sources(args.data, tokenizer, args.text_key, args.append_eos, args.txt_documents)
               if args.data else [])
    tasks = [(path, read_task(path)) for path in args.task or []]
    settings = series_settings(args, seq_len)
    done = evaluated_steps(run_dir, settings)
    checkpoints = run_checkpoints(run_dir, context)
    report = context.is_logging_rank
    for step, path in checkpoints:
        if step in done:
            continue
        try:
            model = load_for_layout(resolve_model_dir(path), context)
        except (CheckpointError, FileNotFoundError):
            if path.exists():
                raise
            if report:
                print(f"step {step}: skipped, {path} was removed while being read (train.keep_checkpoints)")
            continue
        evaluation = EvaluationModel(model, tokenizer, path, context, seq_len)
        perplexities, scored = evaluate_model(evaluation, sources, tasks, seq_len, args.batch_size)
        record = {"step": step, "checkpoint": str(path), **figures(perplexities, scored), "settings": settings}
        if report:
            append_record(run_dir / EVALUATIONS_FILE, record)
            if args.json:
                print(json.dumps(record))
            else:
                for line in [perplexity_line(result) for result in perplexities] + [task_line(r) for r in scored]:
                    print(f"step {step}: {line}")
        del model, evaluation
    barrier(context.world_group)  # every rank returns once rank 0 has written the records
    if report and not args.json:
        skipped = sum(step in done for step, _ in checkpoints)
        print(f"meshlm eval: {len(checkpoints) - skipped} checkpoint(s) evaluated, {skipped} already in "
              f"{run_dir / EVALUATIONS_FILE}")
    return 0


__all__ = ["evaluate_series", "evaluated_steps", "figures", "metric_stem", "run_checkpoints"]
