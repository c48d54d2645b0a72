"""``meshlm status``: where a run stands, read from its directory -- for the run you left on a cluster.

    meshlm status runs/a                 a few lines per run
    meshlm status runs/*  --json         one JSON object per run

Everything comes from what the trainer already writes (no process is contacted): metrics.jsonl
(the start and resume events with the layout and ``train.steps``, the logged steps, validation
losses, stop and rollback events), the checkpoints, and ``evaluations.jsonl`` when ``meshlm eval
--every-checkpoint`` has scored them. For each run it says:

- its **state**: finished (its last logged step is ``train.steps``), stopped (a stop request or
  the time limit saved and left; rerunning resumes), or not finished -- still running, or
  interrupted -- with how long ago metrics.jsonl was last written, which tells the two apart;
- progress (step of steps), tokens trained on, the last loss and validation loss (and the best),
  throughput, MFU and peak memory of the last logged step, and for a run still going the time
  left at the recent pace;
- the layout and model of its latest start, how many times it started, and its rollbacks;
- its checkpoints (the newest, how many, their size on disk) and its newest benchmark figures.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from meshlm.checkpoint.files import BEST_POINTER_FILE, RUN_CONFIG_FILE
from meshlm.checkpoint.folders import complete_checkpoints
from meshlm.training.early_stopping import EARLY_STOP
from meshlm.training.memory_usage import format_bytes
from meshlm.training.metrics import (EVALUATIONS_FILE, format_count, format_duration, read_metrics,
                                    run_metrics_file)
from meshlm.training.plot_cli import tokens_at

RECENT_STEPS = 5
"""Logged steps the pace (seconds per step) is taken over, for the time left."""


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (train.run_dir)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run instead of text")


def folder_bytes(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def run_status(run_dir: str, now: float | None = None) -> dict:
    """Plain data about the run in ``run_dir`` (module docstring); ConfigError when it is no run."""
    run = Path(run_dir)
    metrics_path = run_metrics_file(run_dir)
    records = read_metrics(metrics_path)
    events = [record for record in records if record.get("event") is not None]
    starts = [record for record in events if record["event"] in ("start", "resume")]
    steps = [record for record in records if record.get("event") is None and "loss" in record]
    validation = [record for record in records if "val_loss" in record and record.get("event") is None]
    latest_start = starts[-1] if starts else {}
    checkpoints = complete_checkpoints(run)
    total_steps = latest_start.get("steps") or checkpoint_steps(checkpoints)
    step = max([record["step"] for record in steps] + [record.get("step", 0) for record in events] or [0])
    written_ago = (time.time() if now is None else now) - metrics_path.stat().st_mtime
    status = {"run": str(run), "step": step, "steps": total_steps, "starts": len(starts),
              "rollbacks": sum(record["event"] == "rollback" for record in events),
              "metrics_written_s_ago": written_ago}
    stops = [record for record in events if record["event"] == "stopped"]
    # stopped, and no step logged since (a rerun that resumed and trained nothing -- an early stop's -- stays stopped)
    stopped = stops[-1] if stops and stops[-1]["step"] >= step else None
    if total_steps is not None and step >= total_steps:
        status["state"] = "finished"
    elif stopped is not None:
        status["state"], status["stop_reason"] = "stopped", stopped.get("reason")
    else:
        status["state"] = "not finished"
    if steps:
        last = steps[-1]
        status.update({key: last[key] for key in ("loss", "tokens_per_s", "mfu", "memory_peak_bytes")
                       if key in last})
        status["loss_step"] = last["step"]
        if starts and "tokens_per_step" in latest_start:
            status["tokens"] = tokens_at(step, records)
        pace = seconds_per_step(steps, latest_start)
        if pace is not None and total_steps is not None and status["state"] == "not finished":
            status["eta_s"] = pace * (total_steps - step)
    if validation:
        best = min(validation, key=lambda record: record["val_loss"])
        status.update(val_loss=validation[-1]["val_loss"], val_step=validation[-1]["step"],
                      best_val_loss=best["val_loss"], best_val_step=best["step"])
    layout_keys = ("device", "dtype", "world_size", "tp", "pp", "vp", "cp", "dp", "ep", "sp", "num_parameters")
    status["layout"] = {key: latest_start[key] for key in layout_keys if key in latest_start}
    status["checkpoints"] = [number for number, _ in checkpoints]
    if checkpoints:
        status["newest_checkpoint"] = str(checkpoints[-1][1])
        status["checkpoint_bytes"] = sum(folder_bytes(path) for _, path in checkpoints)
    pointer = run / BEST_POINTER_FILE
    if pointer.is_file():
        try:
            status["best_checkpoint"] = json.loads(pointer.read_text())
        except json.JSONDecodeError:
            pass  # written whole then renamed by the trainer: only a hand edit breaks it
    evaluations = read_metrics(run / EVALUATIONS_FILE)
    if evaluations:
        newest = max(evaluations, key=lambda record: record.get("step", 0))
        status["evaluations"] = {"step": newest.get("step"), **{key: value for key, value in newest.items()
                                                                if key.startswith("eval_")}}
    return status


def checkpoint_steps(checkpoints: list[tuple[int, Path]]) -> int | None:
    """train.steps as the newest checkpoint's run.yaml records it (for runs whose start events do not)."""
    if not checkpoints:
        return None
    try:
        saved = yaml.safe_load((checkpoints[-1][1] / RUN_CONFIG_FILE).read_text())
        return int(saved["train"]["steps"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def seconds_per_step(steps: list[dict], latest_start: dict) -> float | None:
    """Seconds per step at the recent pace: tokens per step over the last logged steps' tokens/s."""
    rates = [record["tokens_per_s"] for record in steps[-RECENT_STEPS:] if record.get("tokens_per_s")]
    if not rates or not latest_start.get("tokens_per_step"):
        return None
    return latest_start["tokens_per_step"] / sorted(rates)[len(rates) // 2]


def describe(status: dict) -> list[str]:
    """The text lines of one run's status."""
    of = f"/{status['steps']}" if status["steps"] is not None else ""
    state = status["state"]
    if state == "stopped" and status.get("stop_reason") == EARLY_STOP:
        state = "stopped early (the validation loss stopped improving: train.early_stop_evals)"
    elif state == "stopped":
        state += f" ({status.get('stop_reason') or 'a stop request'}; rerun the same command to resume)"
    elif state == "not finished":
        ago = format_duration(status["metrics_written_s_ago"])
        state += f" (metrics.jsonl written {ago} ago: still running, or interrupted -- rerunning resumes)"
    lines = [f"{status['run']}: {state} at step {status['step']}{of}"]
    figures = []
    if "loss" in status:
        figures.append(f"loss {status['loss']:.4f} (step {status['loss_step']})")
    if "val_loss" in status:
        figures.append(f"validation {status['val_loss']:.4f} (best {status['best_val_loss']:.4f} at step "
                       f"{status['best_val_step']})")
    if "tokens" in status:
        figures.append(f"{format_count(status['tokens'])} tokens trained on")
    if figures:
        lines.append("  " + ", ".join(figures))
    speed = []
    if "tokens_per_s" in status:
        speed.append(f"{format_count(status['tokens_per_s'])} tok/s")
    if "mfu" in status:
        speed.append(f"MFU {100 * status['mfu']:.1f}%")
    if "memory_peak_bytes" in status:
        speed.append(f"peak memory {format_bytes(status['memory_peak_bytes'])}")
    if "eta_s" in status:
        speed.append(f"about {format_duration(status['eta_s'])} left at the recent pace")
    if speed:
        lines.append("  " + ", ".join(speed) + " (last logged step)")
    layout = status["layout"]
    if layout:
        parallel = ", ".join(f"{key} {layout[key]}" for key in ("tp", "pp", "cp", "dp", "ep")
                             if layout.get(key, 1) > 1)
        lines.append(f"  {format_count(layout.get('num_parameters', 0))} parameters on {layout.get('world_size', 1)} "
                     f"process(es) ({layout.get('device')}, {layout.get('dtype')}{', ' + parallel if parallel else ''})"
                     f"; started {status['starts']} time(s)"
                     + (f", {status['rollbacks']} rollback(s)" if status["rollbacks"] else ""))
    if "best_checkpoint" in status:
        best = status["best_checkpoint"]
        lines.append(f"  best checkpoint: {best['checkpoint']} (validation {best['val_loss']:.4f} at step "
                     f"{best['step']})")
    if status["checkpoints"]:
        numbers = ", ".join(map(str, status["checkpoints"]))
        lines.append(f"  checkpoints: {len(status['checkpoints'])} (steps {numbers}), "
                     f"{format_bytes(status['checkpoint_bytes'])}; newest {status['newest_checkpoint']}")
    else:
        lines.append("  checkpoints: none yet")
    if "evaluations" in status:
        evaluations = status["evaluations"]
        values = ", ".join(f"{key} {value:.4f}" for key, value in evaluations.items()
                           if key != "step" and isinstance(value, float))
        lines.append(f"  evaluations (step {evaluations['step']}): {values}")
    return lines


def run(args) -> int:
    statuses = [run_status(run_dir) for run_dir in args.runs]
    for status in statuses:
        print(json.dumps(status) if args.json else "\n".join(describe(status)))
    return 0


__all__ = ["add_arguments", "describe", "run", "run_status", "seconds_per_step"]
