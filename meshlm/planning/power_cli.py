"""``meshlm power``: a training job's power trace, its swing, ramps and spectrum, and what a power floor costs.

    meshlm power runs/my-run --gpus 4096                          (the run's measured timeline)
    meshlm power --plan configs/tiny.yaml --gpus 1024 --gpu h100 --layout tp=8,pp=4,dp=32
    meshlm power runs/my-run --levels compute=690,communication=300 --band 0.1,20 --json

From a run directory it reads ``power_timeline.jsonl`` (written by the trainer: every step's
waits, optimizer, evaluations, checkpoint saves, power-floor bursts; ``phase_timeline.py``);
with ``--plan`` it predicts one step with the planner (``step_time.py``: computation, TP and
pipeline communication, the bubble, the exposed DP reduction, the optimizer) and repeats it,
with the config's evaluations and checkpoint saves. The timeline is painted with per-GPU power
levels (``power_levels.py``), scaled to ``--gpus`` (``power_trace.py``), and reported: peak,
trough and swing in MW, ramp rates in MW/s, the dominant frequency and the share of oscillation
energy in the critical band (``power_spectrum.py``), then the same for each power floor of
``--power-floor`` with ``--ramp-seconds`` ramps, with the energy each costs
(``power_mitigation.py``). ``power.png`` shows the trace and its spectrum (``power_plot.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from meshlm.errors import ConfigError

STORAGE_GBPS_PER_GPU = 2.0
"""Assumed checkpoint write rate per GPU (GB/s) for a synchronous save, when --checkpoint-seconds is not given."""
HOST_COPY_GBPS_PER_GPU = 25.0
"""Assumed device-to-host copy rate (GB/s): the pause of an asynchronous save (train.async_save)."""
PLAN_SECONDS = (60.0, 3600.0)
"""A planned trace lasts at least the first and at most the second (unless --steps says otherwise)."""


def add_arguments(parser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="RUN_DIR | SECTION.KEY=VALUE",
                        help="a run directory; with --plan: overrides of the config")
    parser.add_argument("--plan", metavar="CONFIG.yaml", default=None, help="predict from a config instead of a run")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the job (a run's default: its world size)")
    parser.add_argument("--gpu", default=None, help="h100, h200, b200, a100-80gb or cpu (default: the run's device; "
                                                    "--plan: h100)")
    parser.add_argument("--layout", default=None, help="--plan: the layout, e.g. tp=8,pp=4,dp=32 (default: the config's)")
    parser.add_argument("--micro-batch", type=int, default=None, help="--plan: micro-batch size (default: the config's)")
    parser.add_argument("--steps", type=int, default=None, help="--plan: steps to simulate (default: 60 s to 1 h)")
    parser.add_argument("--checkpoint-seconds", type=float, default=None,
                        help="--plan: length of a checkpoint save (default: estimated from the state's size)")
    parser.add_argument("--levels", default=None, help="per-GPU watts per phase, e.g. compute=700,communication=350")
    parser.add_argument("--calibrate", action="store_true", help="measure the levels with NVML on this GPU")
    parser.add_argument("--power-floor", default="0.5,0.7,0.9", help="floors to evaluate (default 0.5,0.7,0.9)")
    parser.add_argument("--ramp-seconds", type=float, default=0.0, help="ramps of the evaluated floors (default 0)")
    parser.add_argument("--band", default="0.1,20", help="critical band LOW,HIGH in Hz (default 0.1,20)")
    parser.add_argument("--rate", type=float, default=200.0, help="samples per second of the trace (default 200)")
    parser.add_argument("--ramp-window", type=float, default=0.1, help="seconds over which ramp rates are measured")
    parser.add_argument("--out", default=None, help="the plot (default RUN_DIR/power.png; --plan: ./power.png)")
    parser.add_argument("--no-plot", action="store_true", help="draw no power.png")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def parse_floors(text: str) -> list[float]:
    try:
        floors = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        floors = [float("nan")]
    if not all(0 < floor < 1 for floor in floors):
        raise ConfigError(f"--power-floor {text!r} must be fractions of compute power in (0, 1), comma-separated, "
                          "e.g. --power-floor 0.5,0.7.")
    return floors


def levels_for(gpu: str, args):
    from meshlm.planning.power_levels import calibrate_levels, default_levels, parse_levels

    levels, notes = default_levels(gpu), []
    if args.calibrate:
        measured, note = calibrate_levels(levels)
        notes.append(note)
        levels = measured or levels
    if args.levels:
        levels = parse_levels(args.levels, levels)
    return levels, notes


# --- a run directory ---------------------------------------------------------------------------------------

def run_intervals(args):
    """(intervals, GPU count, GPU row, notes) from RUN_DIR/power_timeline.jsonl."""
    from meshlm.planning.configured import gpu_row
    from meshlm.planning.power_trace import intervals_from_timeline
    from meshlm.training.metrics import read_metrics
    from meshlm.training.phase_timeline import TIMELINE_FILE

    if len(args.inputs) != 1:
        raise ConfigError("meshlm power needs one RUN_DIR, or --plan CONFIG.yaml --gpus N; got "
                          f"{len(args.inputs)} positional arguments.")
    run_dir = Path(args.inputs[0])
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist; give a run's train.run_dir, or use --plan "
                          "CONFIG.yaml --gpus N to predict.")
    path = run_dir / TIMELINE_FILE
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: the run recorded no phase timeline; train it with "
                          "train.record_phases=true (the default), or use --plan CONFIG.yaml --gpus N.")
    records = read_metrics(path)  # JSONL, a torn line skipped, as metrics.jsonl
    headers = [record for record in records if record.get("event") == "start"]
    intervals = intervals_from_timeline(records)
    if not intervals:
        raise ConfigError(f"{path} holds no step yet; train at least one step, or use --plan.")
    header = headers[-1] if headers else {}
    notes, gpu = [], args.gpu
    if gpu is None and "device_name" in header:
        gpu, note = gpu_row(header["device_name"])
        notes += [note] if note else []
    gpu = gpu or ("cpu" if str(header.get("device", "cpu")).startswith("cpu") else "h100")
    gpus = args.gpus or int(header.get("world_size", 1))
    return intervals, gpus, gpu, notes, f"{run_dir.name}: {gpus} x {gpu}, measured"


# --- a plan --------------------------------------------------------------------------------------------------

def plan_intervals(args):
    """(intervals, GPU count, GPU row, notes, title) from the planner's prediction of one step."""
    from meshlm.config import load_run_config
    from meshlm.planning.configured import configured_layout
    from meshlm.planning.hardware import hardware_named
    from meshlm.planning.layouts import parse_layout
    from meshlm.planning.power_trace import intervals_from_plan, plan_step
    from meshlm.planning.predict import predict

    if args.gpus is None or args.gpus < 1:
        raise ConfigError("meshlm power --plan needs --gpus N (a positive integer): the job's GPU count.")
    config = load_run_config(args.plan, list(args.inputs))
    gpu = args.gpu or "h100"
    hardware = hardware_named(gpu, None if gpu != "cpu" else args.gpus, processes=args.gpus,
                              config=config)
    layout = parse_layout(args.layout) if args.layout else configured_layout(config, args.gpus)
    if layout.world_size != args.gpus:
        raise ConfigError(f"the layout {layout.describe()} uses tp*pp*cp*dp = {layout.world_size} GPUs but --gpus is "
                          f"{args.gpus}; make them agree (--layout ...,dp=D).")
    prediction = predict(config, layout, hardware, args.micro_batch or config.train.micro_batch_size)
    if prediction.get("refused"):
        raise ConfigError(f"the planner refuses layout {layout.describe()}: {prediction['refused']}")
    train = config.train
    micro_batches = max(1, train.global_batch_size // (prediction["micro_batch"] * layout.dp))
    step = plan_step(prediction["step_time_items"], micro_batches)
    step_s = sum(part[1] for part in step)
    items = prediction["memory_items"]
    state_bytes = items.get("weights", 0) + items.get("optimizer", 0)
    checkpoint_s = args.checkpoint_seconds
    if checkpoint_s is None:
        checkpoint_s = state_bytes / 1e9 / (HOST_COPY_GBPS_PER_GPU if train.async_save else STORAGE_GBPS_PER_GPU)
    compute_s = sum(seconds * (1 - tp_share) for phase, seconds, tp_share in step if phase == "compute")
    evaluation_s = compute_s / 3 * train.eval_batches / micro_batches  # forward only, every eval batch per DP rank
    steps = args.steps
    if steps is None:
        wanted = max(PLAN_SECONDS[0], 2 * train.save_every * step_s)
        steps = max(1, min(int(math.ceil(wanted / step_s)), int(PLAN_SECONDS[1] / step_s) or 1))
    if steps < 1:
        raise ConfigError(f"--steps {steps} must be a positive integer.")
    intervals = intervals_from_plan(step, steps, train.save_every, checkpoint_s, train.eval_every, evaluation_s)
    notes = [f"planned: {steps} steps of {step_s:.4g} s ({', '.join(f'{phase} {seconds:.3g}' for phase, seconds in merged_parts(step))}); "
             f"checkpoint saves of {checkpoint_s:.3g} s every {train.save_every or 'last'} step(s)"]
    return intervals, args.gpus, gpu, notes, f"{Path(args.plan).name}: {args.gpus} x {gpu}, {layout.describe()}"


def merged_parts(step: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """Seconds per phase of a planned step (TP's share of the computation counted as communication)."""
    totals: dict[str, float] = {}
    for phase, seconds, tp_share in step:
        totals[phase] = totals.get(phase, 0.0) + seconds * (1 - tp_share)
        if tp_share:
            totals["communication"] = totals.get("communication", 0.0) + seconds * tp_share
    return list(totals.items())


# --- the report ------------------------------------------------------------------------------------------------

def run(args) -> int:
    from meshlm.planning.power_mitigation import mitigation_rows, with_floor
    from meshlm.planning.power_plot import PLOT_FILE, plot_power
    from meshlm.planning.power_spectrum import parse_band
    from meshlm.planning.power_trace import OFF_PADDING_S, paint

    band, floors = parse_band(args.band), parse_floors(args.power_floor)
    if not args.rate > 0 or band[1] > args.rate / 2:
        raise ConfigError(f"--rate {args.rate:g} must be positive and at least twice the band's top ({band[1]:g} Hz) "
                          f"to resolve it; raise --rate to {2 * band[1]:g} or more.")
    if args.ramp_seconds < 0 or args.ramp_window <= 0:
        raise ConfigError("--ramp-seconds must be >= 0 and --ramp-window > 0 (seconds).")
    intervals, gpus, gpu, notes, title = plan_intervals(args) if args.plan else run_intervals(args)
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be a positive integer.")
    levels, level_notes = levels_for(gpu, args)
    trace = paint(intervals, levels, args.rate, gpus, padding_s=max(OFF_PADDING_S, args.ramp_seconds + 1))  # ramps fit
    rows = mitigation_rows(trace, levels, floors, args.ramp_seconds, band, args.ramp_window)
    plot = None
    if not args.no_plot:
        out = Path(args.out) if args.out else (Path(args.inputs[0]) if not args.plan else Path(".")) / PLOT_FILE
        plot = plot_power(trace, out, band, title, with_floor(trace, levels, floors[0], args.ramp_seconds))
        if plot is None:
            notes.append("matplotlib is not installed, so no power.png was drawn (pip install matplotlib)")
    report = {"source": title, "gpus": gpus, "gpu": gpu, "levels_watts": levels.watts, "levels_source": levels.source,
              "rate_hz": args.rate, "band_hz": list(band), "ramp_window_s": args.ramp_window,
              "seconds": (trace.run_end - trace.run_start) / trace.rate_hz, "rows": rows,
              "plot": str(plot) if plot else None, "notes": notes + level_notes}
    print(json.dumps(report) if args.json else describe(report))
    return 0


def describe(report: dict) -> str:
    band = report["band_hz"]
    levels = ", ".join(f"{phase} {watts:.0f}" for phase, watts in report["levels_watts"].items())
    lines = [f"meshlm power: {report['source']}; {report['seconds']:.4g} s of training at {report['rate_hz']:g} Hz",
             f"levels per GPU (W, {report['levels_source']}): {levels}"]
    lines += [f"note: {note}" for note in report["notes"]]
    lines.append(f"{'mitigation':<24} {'peak MW':>9} {'trough MW':>10} {'swing MW':>9} {'ramp MW/s':>10} "
                 f"{'main Hz':>8} {f'in {band[0]:g}-{band[1]:g} Hz':>13} {'energy MWh':>11} {'extra':>8}")
    for row in report["rows"]:
        ramp = max(row["max_ramp_up_mw_per_s"], row["max_ramp_down_mw_per_s"])
        extra = f"{row['extra_energy_fraction']:+.1%}" if "extra_energy_fraction" in row else ""
        lines.append(f"{row['mitigation']:<24} {row['peak_mw']:>9.4g} {row['trough_mw']:>10.4g} {row['swing_mw']:>9.4g} "
                     f"{ramp:>10.4g} {row['dominant_hz']:>8.3g} {row['band_fraction']:>13.1%} "
                     f"{row['energy_mwh']:>11.4g} {extra:>8}")
    if report["plot"]:
        lines.append(f"plot: {report['plot']}")
    return "\n".join(lines)


__all__ = ["add_arguments", "describe", "parse_floors", "run"]
