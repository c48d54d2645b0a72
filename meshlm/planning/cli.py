"""``meshlm plan``: which parallel layouts fit a model on N GPUs, and how fast each would train.

    meshlm plan configs/moe-hybrid-tiny.yaml --gpus 16 --gpu h100
    meshlm plan CONFIG.yaml --gpus 8 --layout tp=2,sp=true,pp=2,dp=2,zero=1 --json
    meshlm plan CONFIG.yaml --gpus 2 --gpu cpu          (times this CPU first)

Every layout that divides (the trainer's own rules, ``layouts.py``) gets a memory prediction per
GPU (``memory.py``) and a step time (``step_time.py``) from the per-GPU rates of
``hardware.py``; the ones that fit are ranked by tokens/s, and the rest are listed with the
reason they were refused. ``--json`` prints one JSON object per layout.
"""

from __future__ import annotations

import json

from meshlm.errors import ConfigError


def add_arguments(parser) -> None:
    parser.add_argument("config", metavar="CONFIG.yaml", help="the run's YAML config")
    parser.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="override config values")
    parser.add_argument("--gpus", type=int, required=True, help="how many GPUs (processes) to plan for")
    parser.add_argument("--gpu", default="h100", help="h100, h200, a100-80gb, b200 or cpu (default h100)")
    parser.add_argument("--nodes-of", type=int, default=None, help="GPUs per node (default 8; cpu: all)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (train.global_batch_size)")
    parser.add_argument("--micro-batch", type=int, default=None, help="fix the micro-batch instead of choosing it")
    parser.add_argument("--layout", default=None, help="evaluate one layout, e.g. tp=2,sp=true,pp=2,dp=2,zero=1")
    parser.add_argument("--zero-stages", default="0,1", help="ZeRO stages to enumerate (default 0,1)")
    parser.add_argument("--top", type=int, default=10, help="how many fitting layouts to print (default 10)")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")


def planned_config(args):
    from meshlm.config import load_run_config

    overrides = list(args.overrides)
    if args.global_batch is not None:
        overrides.append(f"train.global_batch_size={args.global_batch}")
    return load_run_config(args.config, overrides)


def run(args) -> int:
    from meshlm.planning.hardware import hardware_named
    from meshlm.planning.layouts import parse_layout
    from meshlm.planning.predict import plan, predict

    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be a positive integer.")
    config = planned_config(args)
    nodes_of = args.nodes_of or (args.gpus if args.gpu == "cpu" else None)
    hardware = hardware_named(args.gpu, nodes_of, processes=args.gpus, config=config)
    if args.layout is not None:
        layout = parse_layout(args.layout)
        if layout.world_size != args.gpus:
            raise ConfigError(f"--layout {args.layout} uses tp*pp*cp*dp = {layout.world_size} GPUs but --gpus is "
                              f"{args.gpus}; make them agree (dp is not filled in for you).")
        predictions, rest = [predict(config, layout, hardware, args.micro_batch)], []
        if predictions[0].get("refused"):
            predictions, rest = [], predictions
    else:
        stages = tuple(int(stage) for stage in args.zero_stages.split(","))
        predictions, rest = plan(config, args.gpus, hardware, args.micro_batch, stages)
        predictions = predictions[:args.top]
    if args.json:
        for prediction in predictions + rest:
            print(json.dumps(prediction))
        return 0
    print(describe_plan(predictions, rest, hardware, args.gpus))
    return 0


def describe_plan(predictions: list[dict], rest: list[dict], hardware, gpus: int) -> str:
    lines = [f"meshlm plan: {gpus} x {hardware.name} ({hardware.peak_tflops:.4g} TFLOP/s peak, "
             f"{hardware.memory_gib:.3g} GiB, {hardware.gpus_per_node} per node)"]
    if hardware.block_rates:
        lines.append("calibrated on this CPU, forward + backward per block kind: " + ", ".join(
            f"{kind} {rate / 1e9:.3g} GFLOP/s + {hardware.block_fixed_s.get(kind, 0.0) * 1e3:.2g} ms"
            for kind, rate in hardware.block_rates.items()) + f"; optimizer {hardware.hbm_gbps:.3g} GB/s")
    if predictions:
        lines.append(f"{'layout':<66} {'mb':>3} {'GiB/GPU':>8} {'step s':>9} {'tokens/s':>11} {'TFLOP/s':>8} "
                     f"{'MFU':>6}")
    for prediction in predictions:
        lines.append(f"{prediction['layout']:<66} {prediction['micro_batch']:>3} "
                     f"{prediction['memory_bytes_per_gpu'] / 2 ** 30:>8.2f} {prediction['step_time_s']:>9.4g} "
                     f"{prediction['tokens_per_s']:>11.4g} {prediction['model_tflops_per_gpu']:>8.4g} "
                     f"{prediction['mfu']:>6.1%}")
    if len(predictions) == 1:
        lines.append("memory: " + ", ".join(f"{name} {value / 2 ** 20:.1f} MiB"
                                            for name, value in predictions[0]["memory_items"].items() if value))
        lines.append("time: " + ", ".join(f"{name} {value:.4g}" for name, value in
                                          predictions[0]["step_time_items"].items()))
    if rest:
        lines.append(f"refused ({len(rest)}):")
        lines += [f"  {prediction['layout']}: {prediction['refused']}" for prediction in rest[:20]]
        if len(rest) > 20:
            lines.append(f"  ... and {len(rest) - 20} more (--json lists all)")
    return "\n".join(lines)


__all__ = ["add_arguments", "describe_plan", "run"]
