"""``meshlm eval``: perplexity, bits per byte and multiple-choice accuracy of a model or checkpoint.

    meshlm eval runs/x --data data/valid                      a token store (PREFIX.bin + PREFIX.idx)
    meshlm eval runs/x --data notes.txt docs.jsonl --json     text files, tokenized here
    meshlm eval runs/x --task hellaswag.jsonl --batch-size 32
    meshlm eval runs/x --every-checkpoint --task hellaswag.jsonl   every checkpoint, kept by step
                                                                  (checkpoint_series.py)
    torchrun --nproc_per_node 4 -m meshlm eval runs/x --data data/valid --tp 2

CKPT is a model folder, a training checkpoint or a run directory (its newest ``step_N``). The
tokenizer is ``--tokenizer``, else the one saved with the model or run; text and tasks need
one, a token store needs one only for bits per byte. ``--seq-len`` is the window (default: the
length the model was trained with, see ``loading.py``). Output is one line per ``--data``
entry (and their total when there are several) and per ``--task`` file, or with ``--json`` one
JSON object each. Under torchrun the work is split over the data-parallel ranks (``--tp N``:
groups of N ranks share one tensor-parallel copy of the model) and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist

from meshlm.data.readers import TXT_DOCUMENT_MODES
from meshlm.errors import ConfigError
from meshlm.evaluation.checkpoint_series import evaluate_series
from meshlm.evaluation.loading import load_for_evaluation
from meshlm.evaluation.multiple_choice import read_task
from meshlm.evaluation.perplexity import open_sources
from meshlm.evaluation.results import evaluate_model, perplexity_line, task_line

DEFAULT_BATCH_SIZE = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT",
                        help="model directory, training checkpoint, or run directory (latest step_N is used)")
    parser.add_argument("--data", nargs="+", metavar="PREFIX|FILE",
                        help="token store prefixes (PREFIX.bin + PREFIX.idx) and/or .txt/.jsonl/.json/.parquet/.arrow "
                             "files (text ones may be compressed: .gz, .bz2, .xz, .zst): perplexity and bits per byte")
    parser.add_argument("--task", nargs="+", metavar="FILE.jsonl",
                        help='multiple-choice questions, one {"context", "choices", "answer"} object a line: accuracy')
    parser.add_argument("--seq-len", type=int, metavar="N",
                        help="window length in tokens (default: the model's training seq_len, else 1024)")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, metavar="N",
                        help=f"windows or answers per forward (default {DEFAULT_BATCH_SIZE})")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer.json or a directory holding one")
    parser.add_argument("--text-key", default="text", help="JSON key / parquet column of the text (default: text)")
    parser.add_argument("--append-eos", action="store_true",
                        help="end every document of the text files with the end-of-text token, as "
                             "`meshlm preprocess --append-eos` does")
    parser.add_argument("--txt-documents", choices=TXT_DOCUMENT_MODES, default="paragraph",
                        help="how a .txt file is cut into documents: at blank lines (paragraph, the default) or "
                             "not at all (file), as for `meshlm preprocess`")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="under torchrun: tensor-parallel ranks per copy of the model (default 1)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per data source and task")
    parser.add_argument("--every-checkpoint", action="store_true",
                        help="CKPT is a run directory: evaluate each of its checkpoints, oldest first, and append "
                             "the figures to RUN/evaluations.jsonl by step (those already there are skipped; "
                             "`meshlm plot RUN --metric eval_NAME_acc` draws them)")


def check_arguments(args: argparse.Namespace) -> None:
    if not args.data and not args.task:
        raise ConfigError("nothing to evaluate; pass --data PREFIX|FILE for perplexity and/or --task FILE.jsonl "
                          "for multiple-choice accuracy.")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1.")
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len {args.seq_len} must be at least 1 token.")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    joined_here = not dist.is_initialized()
    if args.every_checkpoint:
        try:
            return evaluate_series(args)
        finally:
            if joined_here and dist.is_initialized():
                dist.destroy_process_group()
    evaluation = load_for_evaluation(args.checkpoint, args.tokenizer, args.device, args.tp)
    seq_len = args.seq_len or evaluation.default_seq_len
    sources = (open_sources(args.data, evaluation.tokenizer, args.text_key, args.append_eos, args.txt_documents)
               if args.data else [])
    tasks = [(path, read_task(path)) for path in args.task or []]
    perplexities, scored = evaluate_model(evaluation, sources, tasks, seq_len, args.batch_size)
    records = [result.to_dict() for result in [*perplexities, *scored]]
    lines = [perplexity_line(result) for result in perplexities] + [task_line(result) for result in scored]
    if evaluation.context.is_logging_rank:
        print("\n".join(json.dumps(record) for record in records) if args.json else "\n".join(lines))
    if joined_here and dist.is_initialized():
        dist.destroy_process_group()
    return 0
