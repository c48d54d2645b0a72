"""``meshlm checkpoint``: look into and consolidate training checkpoints of any layout.

    meshlm checkpoint inspect CKPT [--json] [--all] [--no-verify]
        step, samples consumed, the layout it was saved at, the model config, and every model
        tensor's global shape, dtype and number of stored chunks, after checking every file's
        size and CRC-32 as loading does (--no-verify skips that); the optimizer's tensors are
        counted, and listed with --all
    meshlm checkpoint consolidate CKPT OUT [--fp32-masters] [--overwrite]
        one process reads every shard and writes OUT/config.json + OUT/model.safetensors
        (+ tokenizer files): the single-file model `meshlm generate` and `meshlm convert` take

CKPT is a checkpoint folder (``RUN_DIR/checkpoints/step_N``), a model folder or a run directory
(its newest complete checkpoint; ``meshlm/checkpoint/locate.py``). See
``meshlm/checkpoint/consolidate.py``.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    inspect = actions.add_parser("inspect", help="print step, layout, config and tensor shapes",
                                 description="Print a checkpoint's step, layout, model config and tensor shapes.")
    inspect.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder, model folder or run directory")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.add_argument("--all", action="store_true", help="list the optimizer's tensors too (default: a count)")
    inspect.add_argument("--no-verify", action="store_true",
                         help="skip checking every file's size and CRC-32 (which reads the whole checkpoint)")
    consolidate = actions.add_parser("consolidate", help="write a single-file model from a sharded checkpoint",
                                     description="Read every shard of a checkpoint (any layout) in one process "
                                                 "and write config.json + model.safetensors.")
    consolidate.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder, model folder or run directory")
    consolidate.add_argument("out", metavar="OUT", help="model folder to write")
    consolidate.add_argument("--fp32-masters", action="store_true",
                             help="write the fp32 master weights of a bf16/fp16 run instead of its bf16/fp16 weights")
    consolidate.add_argument("--overwrite", action="store_true",
                             help="write into OUT even if it is not empty (files of the same names are replaced)")


def run(args: argparse.Namespace) -> int:
    from meshlm.checkpoint.consolidate import consolidate, format_inspection, inspect_checkpoint

    if args.action == "inspect":
        info = inspect_checkpoint(args.checkpoint, verify=not args.no_verify, all_tensors=args.all)
        print(json.dumps(info, indent=2) if args.json else format_inspection(info))
        return 0
    out = consolidate(args.checkpoint, args.out, overwrite=args.overwrite, fp32_masters=args.fp32_masters)
    print(f"wrote model {out} from {args.checkpoint}")
    return 0


__all__ = ["add_arguments", "run"]
