"""``meshlm plot``: curves of one run or several side by side, from their metrics.jsonl.

    meshlm plot runs/a runs/b                              train and validation loss of both runs
    meshlm plot runs/a runs/b --metric loss grad_norm lr   one panel per metric, the runs overlaid
    meshlm plot runs/a --metric tokens_per_s mfu --x tokens --smooth 0.9 --out speed.png
    meshlm plot runs/a --list                              the metrics the runs logged

Each run directory's ``metrics.jsonl`` (the trainer's log: one record per logged step, the
validation records, events) holds the whole history of a run, resumes included, so a plot made
here always shows every step. ``loss`` panels also draw the run's ``val_loss`` as dashed lines of
the same colour; any other number a step record carries is a metric too (``grad_norm``, ``lr``,
``tokens_per_s``, ``mfu``, ``memory_peak_bytes`` in GiB, an MoE run's ``moe_max_load``, an RL run's
``reward_mean``, ...), and so is every number of the evaluation records (``val_loss``,
``eval_accuracy``) and of ``RUN/evaluations.jsonl``, where ``meshlm eval RUN --every-checkpoint``
keeps each checkpoint's benchmark figures (``eval_hellaswag_acc``, ...).

``--x tokens`` puts the tokens trained on the x axis: step x the run's ``tokens_per_step`` (from
its start events), which compares runs of different batch sizes fairly. ``--smooth W`` draws
the exponential moving average with weight W in [0, 1) -- TensorBoard's smoothing -- over the raw
curve, drawn faint. A point that is not finite (a diverged step) is left out. The figure goes to
``--out`` (default ``plot.png``), written to a temporary file first so an existing figure is
replaced whole or not at all.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from meshlm.errors import ConfigError
from meshlm.training.metrics import EVALUATIONS_FILE, read_metrics, run_metrics_file

X_AXES = ("step", "tokens")
GIB = 2 ** 30


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (train.run_dir) to plot")
    parser.add_argument("--metric", nargs="+", default=["loss"], metavar="NAME",
                        help="metrics to plot, one panel each (default: loss, with val_loss dashed); see --list")
    parser.add_argument("--x", choices=X_AXES, default="step", help="x axis: step (default) or tokens trained on")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="W",
                        help="exponential moving average weight in [0, 1) (TensorBoard's smoothing; default 0: none)")
    parser.add_argument("--log-y", action="store_true", help="logarithmic y axes")
    parser.add_argument("--out", default="plot.png", help="the figure to write (default plot.png)")
    parser.add_argument("--list", action="store_true", help="print the metrics each run logged, and draw nothing")


def load_run(run_dir: str) -> list[dict]:
    """The records of ``run_dir``'s metrics.jsonl and evaluations.jsonl, or ConfigError naming what is wrong."""
    return read_metrics(run_metrics_file(run_dir)) + read_metrics(Path(run_dir) / EVALUATIONS_FILE)


def metric_names(records: list[dict]) -> list[str]:
    """The numeric metrics of a run's step and evaluation records, sorted."""
    names = set()
    for record in records:
        if record.get("event") is None:
            names.update(key for key, value in record.items()
                         if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool))
    return sorted(names)


def tokens_per_step(records: list[dict]) -> list[tuple[int, float]]:
    """(from step, tokens per step) of each start or resume event that records it, in file order."""
    return [(record.get("step", 0), record["tokens_per_step"]) for record in records
            if record.get("event") is not None and "tokens_per_step" in record]


def metric_curve(records: list[dict], metric: str, x_axis: str = "step") -> list[tuple[float, float]]:
    """(x, value) points of ``metric``, one per step (the last record of a step wins: a rolled-back
    or resumed step is drawn as it finally stood), in step order; non-finite values are left out."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(metric)
        if record.get("event") is None and isinstance(value, (int, float)) and not isinstance(value, bool):
            by_step[int(record["step"])] = float(value)
    scale = 1 / GIB if metric.endswith("_bytes") else 1.0
    points = [(step, value * scale) for step, value in sorted(by_step.items()) if math.isfinite(value)]
    if x_axis == "tokens":
        points = [(tokens_at(step, records), value) for step, value in points]
    return points


def tokens_at(step: int, records: list[dict]) -> float:
    """Tokens trained on by the end of ``step``: each span of steps at its own tokens per step."""
    changes = tokens_per_step(records)
    if not changes:
        raise ConfigError("--x tokens needs the runs' tokens_per_step, which their metrics.jsonl start events do not "
                          "record (a run from an older meshlm); plot with --x step.")
    total, (previous_step, rate) = 0.0, changes[0]
    for change_step, change_rate in changes[1:]:
        if change_step >= step:
            break
        total += (change_step - previous_step) * rate
        previous_step, rate = change_step, change_rate
    return total + (step - previous_step) * rate


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's exponential moving average, debiased so the first points are not pulled to 0."""
    result, average = [], 0.0
    for count, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        result.append(average / (1 - weight ** count))
    return result


def run_labels(runs: list[str]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [Path(run).name or run for run in runs]
    return [run if names.count(name) > 1 else name for run, name in zip(runs, names)]


def check_arguments(args) -> None:
    if not 0 <= args.smooth < 1:
        raise ConfigError(f"--smooth {args.smooth} must lie in [0, 1) (0.6 to 0.99 are usual; 0 draws the raw curve).")
    if not args.out.endswith((".png", ".pdf", ".svg")):
        raise ConfigError(f"--out {args.out}: give a .png, .pdf or .svg file.")


def build_panels(histories: list[list[dict]], labels: list[str], metrics: list[str],
                 x_axis: str) -> list[tuple[str, list[tuple[str, list, list]]]]:
    """(metric, [(run label, points, validation points)]) per metric; ConfigError for a metric no run logged."""
    panels = []
    for metric in metrics:
        curves = []
        for label, records in zip(labels, histories):
            points = metric_curve(records, metric, x_axis)
            validation = metric_curve(records, "val_loss", x_axis) if metric == "loss" else []
            if points or validation:
                curves.append((label, points, validation))
        if not curves:
            known = sorted(set().union(*(metric_names(records) for records in histories)))
            raise ConfigError(f"--metric {metric}: no run logged it; the runs' metrics are "
                              f"{', '.join(known) or 'none yet'}.")
        panels.append((metric, curves))
    return panels


def draw(panels: list[tuple[str, list[tuple[str, list, list]]]], x_axis: str, smooth: float, log_y: bool,
         out: str) -> None:
    """Write the figure: one panel per (metric, [(run label, points, validation points)])."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ConfigError("meshlm plot draws with matplotlib, which is not installed; "
                          "pip install matplotlib.") from error
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 3.2 * len(panels)), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (metric, curves) in zip(axes[:, 0], panels):
        for index, (label, points, validation) in enumerate(curves):
            color = colors[index % len(colors)]
            if points:
                xs, ys = zip(*points)
                if smooth > 0:
                    axis.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
                    ys = smoothed(list(ys), smooth)
                axis.plot(xs, ys, color=color, linewidth=1.4, label=label)
            if validation:
                axis.plot(*zip(*validation), color=color, linestyle="--", marker="o", markersize=3,
                          label=f"{label} (validation)")
        axis.set_ylabel(f"{metric} (GiB)" if metric.endswith("_bytes") else metric)
        axis.grid(alpha=0.3)
        if log_y:
            axis.set_yscale("log")
        axis.legend(fontsize="small")
    axes[-1, 0].set_xlabel("tokens" if x_axis == "tokens" else "step")
    figure.tight_layout()
    temporary = Path(out).with_name(f".{Path(out).name}.tmp{Path(out).suffix}")
    figure.savefig(temporary, dpi=100)
    plt.close(figure)
    os.replace(temporary, out)


def run(args) -> int:
    check_arguments(args)
    histories = [load_run(run_dir) for run_dir in args.runs]
    labels = run_labels(args.runs)
    if args.list:
        for label, records in zip(labels, histories):
            print(f"{label}: {', '.join(metric_names(records)) or 'no metrics logged yet'}")
        return 0
    panels = build_panels(histories, labels, args.metric, args.x)
    draw(panels, args.x, args.smooth, args.log_y, args.out)
    print(f"meshlm plot: wrote {args.out} ({', '.join(args.metric)} of {len(args.runs)} run"
          f"{'s' if len(args.runs) > 1 else ''})")
    return 0


__all__ = ["add_arguments", "build_panels", "load_run", "metric_curve", "metric_names", "run", "run_labels", "smoothed",
           "tokens_at"]
