"""Muon against AdamW on the same model and data: validation loss, step time and optimizer state.

    python -m bench.muon [--config configs/tiny.yaml] [--steps 200] [--lr LR] [--muon-lr LR ...]
                         [--repeats 25] [--timed-steps 2] [--overrides KEY=VALUE ...]

``--config`` (the dense configs/tiny.yaml, or configs/hybrid-tiny.yaml; both read the demo corpus
``data/demo/blend.json`` that ``meshlm data demo`` writes) is trained twice by the real trainer
(``Trainer(config).run()``: the loop ``meshlm train`` runs, validation included), for ``--steps``
steps: once with ``optim.optimizer=adamw`` and once with ``optim.optimizer=muon``. Everything else
is the same -- seed (so the same initial weights and the same batches), ``--lr`` (default: the
config's), weight decay, warmup and schedule -- which is the comparison Muon's update-RMS matching
makes meaningful (``meshlm/optim/muon.py``: AdamW's hyperparameters carry over). ``--muon-lr``
adds Muon runs at other learning rates (the rest of the schedule, min_lr included, unchanged).
Each run reports its validation curve (step -> loss at every ``train.eval_every`` and the last
step), the final validation loss, the last step's training loss and the mean of the last ten.

Step time is measured apart from those runs, because on a shared CPU a burst of someone else's
work can slow one whole run: two fresh trainers (one per optimizer) take ``--timed-steps`` steps
in turn, ``--repeats`` rounds after one warm-up round each (``bench/timing.py``), and the median
seconds per step of each are compared. The optimizer state is counted from the tensors of
``trainer.optimizer.state`` after the run (AdamW: two fp32 moments per parameter; Muon: one
momentum buffer per matrix it steps, AdamW's moments for the rest). ``val_loss_ratio`` and
``step_time_ratio`` are Muon over AdamW at the same learning rate. ``--overrides`` are dotted
config keys applied to every run (e.g. ``data.blend=other/blend.json``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.timing import interleaved_medians, timed_steps
from meshlm.config import load_run_config
from meshlm.errors import ConfigError, DataError
from meshlm.optim.muon import MUON_GROUP
from meshlm.training.trainer import Trainer

OPTIMIZERS = ("adamw", "muon")
QUIET = ["train.save_every=0", "train.tensorboard=false", "train.progress=false", "train.plot=false"]


def build_trainer(args, optimizer: str, lr: float, steps: int, run_dir: Path) -> Trainer:
    overrides = [*args.overrides, *QUIET, f"train.steps={steps}", f"train.run_dir={run_dir}",
                 f"optim.optimizer={optimizer}", f"optim.lr={lr}"]
    return Trainer(load_run_config(args.config, overrides))


def optimizer_state_bytes(trainer: Trainer) -> int:
    return sum(value.numel() * value.element_size() for state in trainer.optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))


def train(args, optimizer: str, lr: float, run_dir: Path) -> tuple[dict, Trainer]:
    """One whole run of ``Trainer.run()``: its losses, and the trainer (for its optimizer state)."""
    trainer = build_trainer(args, optimizer, lr, args.steps, run_dir)
    result = trainer.run()
    last_step = max(result.losses)
    return {"optimizer": optimizer, "lr": lr, "final_val_loss": result.val_losses[max(result.val_losses)],
            "val_curve": result.val_losses, "final_train_loss": result.losses[last_step],
            "train_loss_last_10": statistics.mean(list(result.losses.values())[-10:])}, trainer


def seconds_per_step(args, lr: float, root: Path) -> dict[str, float]:
    """Median seconds per step of each optimizer, the two stepping in turn (``--repeats`` rounds)."""
    steps = max(args.steps, (args.repeats + 1) * args.timed_steps)
    trainers = {name: build_trainer(args, name, lr, steps, root / f"timing-{name}") for name in OPTIMIZERS}
    return interleaved_medians({name: (lambda trainer=trainer: timed_steps(trainer, args.timed_steps))
                                for name, trainer in trainers.items()}, args.repeats)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str | None]:
    """The arguments, and the first problem with them (None when there is none)."""
    parser = argparse.ArgumentParser(prog="python -m bench.muon", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml", help="run config (dense tiny or hybrid-tiny)")
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run")
    parser.add_argument("--lr", type=float, default=None, help="optim.lr of both optimizers (default: the config's)")
    parser.add_argument("--muon-lr", type=float, nargs="*", default=[], help="more learning rates to run Muon at")
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds (medians are compared)")
    parser.add_argument("--timed-steps", type=int, default=2, help="training steps per timed round")
    parser.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="dotted config overrides for every run")
    args = parser.parse_args(argv)
    problems = [f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1"
                for name in ("steps", "repeats", "timed_steps") if getattr(args, name) < 1]
    problems += [f"--lr {lr} must be a positive number" for lr in [args.lr] if lr is not None and not lr > 0]
    problems += [f"--muon-lr {lr} must be a positive number" for lr in args.muon_lr if not lr > 0]
    problems += [f"--overrides {item} must be KEY=VALUE (e.g. train.seq_len=64)" for item in args.overrides
                 if "=" not in item]
    if not Path(args.config).is_file():
        problems.append(f"--config {args.config} is not a file (run from the repository root, or pass a path)")
    return args, problems[0] if problems else None


def measure(args, config, root: Path) -> dict:
    lr = args.lr if args.lr is not None else config.optim.lr
    runs, trainers = {}, {}
    for name, optimizer, run_lr in [("adamw", "adamw", lr), ("muon", "muon", lr),
                                    *[(f"muon lr={other:g}", "muon", other) for other in args.muon_lr if other != lr]]:
        runs[name], trainers[name] = train(args, optimizer, run_lr, root / name.replace(" ", "-"))
    for run in runs.values():
        if run["optimizer"] == "muon":
            run["val_loss_ratio"] = run["final_val_loss"] / runs["adamw"]["final_val_loss"]
    seconds = seconds_per_step(args, lr, root)
    states = {name: optimizer_state_bytes(trainers[name]) for name in OPTIMIZERS}
    muon = trainers["muon"]
    return {
        "bench": "muon", "config": args.config, "overrides": args.overrides, "device": str(muon.device),
        "dtype": muon.config.precision.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "steps": args.steps, "lr": lr, "seed": config.train.seed, "parameters": muon.num_parameters,
        "muon_parameters": sum(param.numel() for group in muon.optimizer.param_groups
                               if group["name"] == MUON_GROUP for param in group["params"]),
        "tokens_per_step": config.train.global_batch_size * config.train.seq_len,
        "runs": runs, "val_loss_ratio": runs["muon"]["val_loss_ratio"],
        "seconds_per_step": seconds, "step_time_ratio": seconds["muon"] / seconds["adamw"],
        "timing": {"repeats": args.repeats, "timed_steps": args.timed_steps},
        "optimizer_state_bytes": states, "state_ratio": states["muon"] / states["adamw"],
    }


def main(argv: list[str] | None = None) -> int:
    args, problem = parse_args(argv)
    if problem is not None:
        print(f"bench.muon: {problem}.", file=sys.stderr)
        return 2
    try:  # an unknown key, a bad value, data that is not there: the config's own sentence
        config = load_run_config(args.config, args.overrides)
        if config.train.eval_every <= 0:
            raise ConfigError("train.eval_every=0 computes no validation loss to compare; set it (e.g. 50).")
        with tempfile.TemporaryDirectory() as scratch:
            record = measure(args, config, Path(scratch))
    except (ConfigError, DataError) as error:
        print(f"bench.muon: {error}", file=sys.stderr)
        return 2
    print(json.dumps(record))
    return 0

if __name__ == "__main__":
    sys.exit(main())
