"""``meshlm rl``: GRPO on an environment's prompts, from an SFT'ed model.

    meshlm rl CONFIG.yaml train.init_from=runs/sft/checkpoints/step_200 [--env arithmetic]
    meshlm rl CONFIG.yaml train.init_from=... --prompts math.jsonl  prompts of your own (prompt_file.py)
    meshlm rl CONFIG.yaml train.init_from=... --eval-only       held-out accuracy, as one JSON line
    meshlm rl CONFIG.yaml train.init_from=... --eval-only --pass-at 8
                                                  also the sampled pass@1 and pass@8 (RL's headroom)
    torchrun --nproc_per_node 2 -m meshlm rl CONFIG.yaml ...    data parallel (the same run)

The config is a training config (``meshlm train --list-keys``) whose ``rl`` section sets the
group size, prompts per step, sampling, clip, KL and environment (``meshlm/config.py``
``RLConfig``), with ``train.reward_fn=module:function`` for a reward of your own. The model,
optimizer, checkpoints (re-running resumes), metrics.jsonl and progress line are the trainer's;
``meshlm/rl/loop.py`` says what a step does. A bad setting exits with status 2 and one sentence;
too many non-finite steps in a row with train.on_nonfinite=stop exit with status 1 after one
line on stderr, as ``meshlm train`` does.
"""

from __future__ import annotations

import json
import os
import sys

from meshlm.errors import ConfigError


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="the run's YAML config")
    parser.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE",
                        help="override config values, e.g. rl.group_size=8 train.init_from=runs/sft")
    parser.add_argument("--env", help="the prompt environment (sets rl.env): arithmetic, or prompts (with rl.prompts)")
    parser.add_argument("--prompts", metavar="FILE.jsonl",
                        help='train on the prompts of a file of {"prompt": ..., "answer": ...} records (sets '
                             "rl.env=prompts and rl.prompts=FILE; rl.eval_prompts of them are held out)")
    parser.add_argument("--eval-only", action="store_true",
                        help="print the held-out accuracy of the run's newest checkpoint (else train.init_from) "
                             "as JSON and exit, training nothing")
    parser.add_argument("--pass-at", type=int, default=0, metavar="K",
                        help="with --eval-only: also sample K completions of each held-out prompt at rl.temperature "
                             "and report the sampled pass@1 and pass@K (the headroom RL can use)")


def load_rl_config(config_path, overrides: list[str]):
    """The run config with train.global_batch_size = rl.prompts_per_step * rl.group_size (a step's
    completions; a value given for it is replaced), so it is validated as the trainer will use it."""
    from meshlm.config import load_run_config

    sizes = load_run_config(config_path, [*overrides, "train.micro_batch_size=1", "train.global_batch_size=1"]).rl
    return load_run_config(config_path, [*overrides,
                                         f"train.global_batch_size={sizes.prompts_per_step * sizes.group_size}"])


def run(args) -> int:
    from meshlm.config import parse_override
    from meshlm.rl.loop import evaluate_only, run_rl
    from meshlm.training.cli import (config_and_overrides, leave_process_group, report_nonfinite_stop,
                                     report_out_of_memory)
    from meshlm.training.fault_tolerance import CollectiveFailure, NonFiniteTrainingStop, exit_after_collective_failure
    from meshlm.training.out_of_memory import OutOfMemoryStop

    config_path, overrides = config_and_overrides(args)
    if config_path is None and not overrides:
        raise ConfigError("give a config file or overrides, e.g. `meshlm rl configs/tiny.yaml "
                          "train.init_from=runs/sft --env arithmetic`.")
    if args.env is not None:
        overrides.append(f"rl.env={args.env}")
    if args.prompts is not None:
        if args.env not in (None, "prompts"):
            raise ConfigError(f"--prompts {args.prompts} trains on a prompt file, which is rl.env=prompts, not --env "
                              f"{args.env}; drop one of them.")
        overrides += ["rl.env=prompts", f"rl.prompts={args.prompts}"]
    pass_at = args.pass_at
    if pass_at < 0 or (pass_at and not args.eval_only):
        raise ConfigError(f"--pass-at {pass_at}: give a number of samples >= 1, together with --eval-only.")
    config = load_rl_config(config_path, overrides)
    logging_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        if args.eval_only:
            report = evaluate_only(config, samples=pass_at)
            if logging_rank:
                print(json.dumps(report))
            return 0
        result, accuracies = run_rl(config, command_line_keys=[parse_override(text)[0] for text in overrides])
    except CollectiveFailure as failure:
        exit_after_collective_failure(failure)
    except NonFiniteTrainingStop as stop:
        return report_nonfinite_stop("meshlm rl", stop)
    except OutOfMemoryStop as stop:  # the trainer's (meshlm/training/out_of_memory.py)
        return report_out_of_memory("meshlm rl", stop)
    finally:
        leave_process_group()
    if not logging_rank or result.stopped_by is not None:
        return 0
    if result.already_complete is not None:
        print(f"meshlm rl: {result.already_complete}")
        return 0
    summary = f"step {result.step}/{config.train.steps}"
    if accuracies:
        summary += f", held-out accuracy {accuracies[max(accuracies)]:.1%}"
    print(f"meshlm rl: done: {summary}; run directory {result.run_dir}", file=sys.stdout)
    return 0


__all__ = ["add_arguments", "load_rl_config", "run"]
