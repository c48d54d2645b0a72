"""``meshlm eval``: perplexity, bits per byte and multiple-choice accuracy of a model or checkpoint.

    meshlm eval runs/x --data data/valid                      a token store (PREFIX.bin + PREFIX.idx)
    meshlm eval runs/x --data notes.txt docs.jsonl --json     text files, tokenized here
    meshlm eval runs/x --task hellaswag.jsonl --batch-size 32
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
from functools import reduce

import torch.distributed as dist

from meshlm.data.readers import TXT_DOCUMENT_MODES
from meshlm.errors import ConfigError
from meshlm.evaluation.loading import load_for_evaluation
from meshlm.evaluation.multiple_choice import TaskResult, evaluate_task, read_task
from meshlm.evaluation.perplexity import PerplexityResult, evaluate_perplexity, open_sources

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


def check_arguments(args: argparse.Namespace) -> None:
    if not args.data and not args.task:
        raise ConfigError("nothing to evaluate; pass --data PREFIX|FILE for perplexity and/or --task FILE.jsonl "
                          "for multiple-choice accuracy.")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1.")
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len {args.seq_len} must be at least 1 token.")


def perplexity_line(result: PerplexityResult) -> str:
    bits = "n/a (a token store needs --tokenizer)" if result.bits_per_byte is None else f"{result.bits_per_byte:.4f}"
    return (f"{result.name}: {result.tokens} tokens  loss {result.loss:.4f}  perplexity {result.perplexity:.4f}  "
            f"bits/byte {bits}")


def task_line(result: TaskResult) -> str:
    def with_error(value: float, error: float | None) -> str:
        return f"{value:.4f}" + ("" if error is None else f" ± {error:.4f}")
    return (f"{result.name}: {result.questions} questions  acc {with_error(result.acc, result.acc_stderr)}  "
            f"acc_norm {with_error(result.acc_norm, result.acc_norm_stderr)}")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    joined_here = not dist.is_initialized()
    evaluation = load_for_evaluation(args.checkpoint, args.tokenizer, args.device, args.tp)
    seq_len = args.seq_len or evaluation.default_seq_len
    records, lines = [], []
    if args.data:
        sources = open_sources(args.data, evaluation.tokenizer, args.text_key, args.append_eos, args.txt_documents)
        results = evaluate_perplexity(evaluation, sources, seq_len, args.batch_size)
        if len(results) > 1:
            results.append(reduce(PerplexityResult.__add__, results))
        records += [result.to_dict() for result in results]
        lines += [perplexity_line(result) for result in results]
    for path in args.task or []:
        result = evaluate_task(evaluation, read_task(path), seq_len, args.batch_size, name=path)
        records.append(result.to_dict())
        lines.append(task_line(result))
    if evaluation.context.is_logging_rank:
        print("\n".join(json.dumps(record) for record in records) if args.json else "\n".join(lines))
    if joined_here and dist.is_initialized():
        dist.destroy_process_group()
    return 0
