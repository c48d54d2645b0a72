"""The prediction for a run exactly as configured: what ``meshlm train ... --plan`` prints first.

``meshlm plan`` searches the layouts of N GPUs; here there is nothing to search. The layout is
the config's own (``parallel.tp/sp/pp/vp/dp/cp/ep``, the ZeRO stage in effect and
``train.recompute``, at ``train.micro_batch_size``) over the processes torchrun started
(``WORLD_SIZE``, else 1; dp, when not set, is what tp*pp*cp leave over), and the hardware is the
device the trainer will take (``train.device``; ``auto``: CUDA when present):

- the CPU: the planner's ``cpu`` row, calibrated now (``hardware.calibrate_cpu``), the processes
  of this host sharing its cores;
- a CUDA GPU: the table row whose name the device's name contains (H100, H200, A100 80GB, B200),
  else the h100 row with a note saying so.

The result is printed on global rank 0 only, in ``meshlm plan``'s words, and returned as plain
data -- ``memory_bytes_per_gpu``, ``step_time_s``, ``layout``, ``gpu`` -- which the command line
hands to the trainer (``train(config, predicted=...)``); the trainer sits below the planner and
never imports it, and logs its measured peak memory and step time beside these
(``meshlm/training/plan_check.py``).
"""

from __future__ import annotations

import os

from meshlm.planning.layouts import Layout

CUDA_ROWS = (("H200", "h200"), ("GH200", "h200"), ("H100", "h100"), ("B200", "b200"), ("A100", "a100-80gb"))
"""(text the CUDA device name contains, row of ``hardware.GPUS``), first match wins."""
FALLBACK_ROW = "h100"


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def configured_layout(config, processes: int) -> Layout:
    """The config's layout over ``processes`` (dp: ``parallel.dp``, else the rest of tp*pp*cp)."""
    parallel = config.parallel
    dp = parallel.dp or max(1, processes // (parallel.tp * parallel.pp * parallel.cp))
    return Layout(tp=parallel.tp, sp=parallel.sp, pp=parallel.pp, vp=parallel.vp, dp=dp, cp=parallel.cp,
                  ep=parallel.ep, zero=parallel.sharding_stage, recompute=config.train.recompute)


def gpu_row(device_name: str) -> tuple[str, str | None]:
    """(``hardware.GPUS`` row for a CUDA device name, a note when it is a stand-in)."""
    upper = device_name.upper()
    for text, row in CUDA_ROWS:
        if text in upper and (row != "a100-80gb" or "40GB" not in upper):
            return row, None
    return FALLBACK_ROW, (f"no row for {device_name!r} in meshlm/planning/hardware.py; predicting with the "
                          f"{FALLBACK_ROW} row (add one for this GPU)")


def run_hardware(config, processes: int):
    """(Hardware row of the device the run will take, a note or None)."""
    import torch

    from meshlm.planning.hardware import hardware_named
    from meshlm.precision.device_defaults import parse_device

    device = parse_device(config.train.device)  # the trainer's own reading of train.device
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
    if device.type != "cuda" or not torch.cuda.is_available():
        return hardware_named("cpu", per_node or processes, processes=processes,
                              config=config), None
    row, note = gpu_row(torch.cuda.get_device_name(device))
    return hardware_named(row, per_node), note


def configured_prediction(config, processes: int | None = None) -> tuple[dict, object, Layout, str | None]:
    """(the planner's prediction for the configured layout, its hardware, the layout, a note or None).
    A layout the trainer would refuse gives a prediction with ``refused``: the reason."""
    from meshlm.planning.layouts import refusal
    from meshlm.planning.predict import predict_at

    processes = processes or world_size()
    layout = configured_layout(config, processes)
    hardware, note = run_hardware(config, processes)
    micro_batch = config.train.micro_batch_size
    reason = refusal(config, layout, micro_batch)
    if reason is None and layout.world_size != processes:
        reason = f"the layout uses tp*pp*cp*dp = {layout.world_size} processes but {processes} were started"
    if reason is not None:
        return {"layout": layout.describe(), "micro_batch": micro_batch, "refused": reason}, hardware, layout, note
    return predict_at(config, layout, hardware, micro_batch), hardware, layout, note


def print_configured_prediction(config) -> dict | None:
    """``meshlm train --plan``: on global rank 0, print the prediction for the configured layout and
    return the plain data the trainer logs its measurements beside; None on the other ranks, or
    when the planner refuses the layout (the trainer then says why in its own words)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    import warnings

    from meshlm.planning.cli import describe_plan
    from meshlm.training.initial_weights import model_from_init_folder

    with warnings.catch_warnings():  # train.init_model_config: the trainer gives its note itself
        warnings.simplefilter("ignore")
        config = model_from_init_folder(config)
    processes = world_size()
    prediction, hardware, layout, note = configured_prediction(config, processes)
    command = (f"meshlm plan CONFIG --gpus {processes} --gpu {hardware.name} --layout {layout.describe()} "
               f"--micro-batch {config.train.micro_batch_size}")
    print(f"meshlm train: --plan: the planner's prediction for this run's layout (the same as `{command}`):")
    if note is not None:
        print(f"meshlm train: note: {note}")
    if prediction.get("refused"):
        print(f"meshlm train: --plan: no prediction: {prediction['refused']}", flush=True)
        return None
    print(describe_plan([prediction], [], hardware, processes), flush=True)
    return {"memory_bytes_per_gpu": prediction["memory_bytes_per_gpu"], "step_time_s": prediction["step_time_s"],
            "layout": prediction["layout"], "gpu": hardware.name}


__all__ = ["CUDA_ROWS", "configured_layout", "configured_prediction", "gpu_row", "print_configured_prediction",
           "run_hardware", "world_size"]
