"""What one GPU draws in each phase of a training step: the watts ``meshlm power`` builds its trace from.

A job's power is the sum of its GPUs', and a GPU's power is set mostly by what it is doing:
dense GEMMs run it at its power limit, a collective leaves most of its SMs idle, a pipeline
stage waiting for its neighbour is nearly idle. So a per-GPU level per phase, times the
phase timeline, gives the trace (the power-stabilization paper, 2025, analyses the same
compute/communication alternation).

Defaults: the GPU's power limit (TDP) times the fraction of ``PHASE_POWER_FRACTION``
(``meshlm/training/power_floor.py``, which the power floor's filler uses too, so the two agree).
The limits are the vendors' board powers for the SXM parts: H100 700 W, H200 700 W, B200
1000 W, A100 80GB 400 W; the 'cpu' row is a nominal 250 W socket, so that a CPU test run has a
trace in the same units (its absolute numbers mean nothing). The fractions are assumptions, not
measurements: compute 1.0, communication 0.45, bubble 0.25, optimizer 0.6, evaluation 0.85,
checkpoint 0.2, idle 0.15 (between steps), off 0 (before and after the job). Override any with
``--levels compute=690,communication=300`` (watts), or measure the GPU's own: ``--calibrate``
reads NVML (``pynvml``) while this process runs GEMMs (compute) and while it sleeps (idle), and
places the other phases between the two at the same fractions.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from meshlm.errors import ConfigError
from meshlm.training.power_floor import PHASE_POWER_FRACTION

TDP_WATTS = {"h100": 700.0, "h200": 700.0, "b200": 1000.0, "a100-80gb": 400.0, "cpu": 250.0}
"""Board power per GPU (SXM parts); 'cpu': a nominal socket (see the module docstring)."""
PHASES = (*PHASE_POWER_FRACTION, "off")


@dataclass(frozen=True)
class PowerLevels:
    gpu: str
    watts: dict
    """Phase -> watts per GPU, for every name of ``PHASES``."""
    source: str
    """Where the numbers come from: 'defaults', 'defaults + --levels', 'NVML' ..."""

    def __getitem__(self, phase: str) -> float:
        return self.watts[phase]


def default_levels(gpu: str) -> PowerLevels:
    if gpu not in TDP_WATTS:
        raise ConfigError(f"--gpu {gpu!r} has no power levels; use one of {', '.join(TDP_WATTS)}, or give every "
                          f"phase with --levels ({','.join(f'{phase}=W' for phase in PHASES[:3])},...).")
    watts = {phase: TDP_WATTS[gpu] * fraction for phase, fraction in PHASE_POWER_FRACTION.items()}
    return PowerLevels(gpu, {**watts, "off": 0.0}, "defaults")


def parse_levels(text: str, base: PowerLevels) -> PowerLevels:
    """``'compute=700,communication=350'`` over ``base``: the named phases replaced (watts per GPU)."""
    watts = dict(base.watts)
    for item in filter(None, (part.strip() for part in text.split(","))):
        phase, equals, value = (piece.strip() for piece in item.partition("="))
        try:
            number = float(value) if equals else None
        except ValueError:
            number = None
        if phase not in PHASES or number is None or not number >= 0:
            raise ConfigError(f"--levels item {item!r} is not PHASE=WATTS with PHASE one of {', '.join(PHASES)} and "
                              "WATTS >= 0; write e.g. --levels compute=700,communication=350.")
        watts[phase] = number
    if watts["compute"] <= 0 or any(watts[phase] > watts["compute"] for phase in PHASES):
        raise ConfigError(f"--levels {text!r}: compute ({watts['compute']:g} W) must be positive and the highest "
                          "level (the power floor is a fraction of it); lower the others or raise compute.")
    return dataclasses.replace(base, watts=watts, source=f"{base.source} + --levels")


def nvml_power_watts(device_index: int, seconds: float, work=None) -> float:
    """Median NVML power reading of GPU ``device_index`` over ``seconds``, calling ``work()`` between readings."""
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    readings, until = [], time.perf_counter() + seconds
    while time.perf_counter() < until:
        if work is not None:
            work()
        else:
            time.sleep(0.02)
        readings.append(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)  # milliwatts
    readings.sort()
    return readings[len(readings) // 2]


def calibrate_levels(base: PowerLevels, seconds: float = 2.0) -> tuple[PowerLevels | None, str]:
    """(levels measured on this machine's first GPU, a note) -- or (None, why not) without CUDA or
    pynvml. Compute: NVML while bf16 GEMMs of 8192^2 run back to back; idle: while nothing runs;
    the other phases between the two at ``PHASE_POWER_FRACTION``'s places."""
    try:
        import pynvml
        import torch
    except ImportError:
        return None, "NVML calibration skipped: pynvml is not installed (pip install nvidia-ml-py)"
    if not torch.cuda.is_available():
        return None, "NVML calibration skipped: no CUDA device here"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return None, f"NVML calibration skipped: NVML did not start ({error})"
    try:
        device = torch.device("cuda", 0)
        left = torch.ones(8192, 8192, dtype=torch.bfloat16, device=device)

        def gemms():
            for _ in range(8):
                left @ left
            torch.cuda.synchronize(device)

        gemms()  # warm-up: clocks and power settle
        compute = nvml_power_watts(0, seconds, gemms)
        idle = nvml_power_watts(0, seconds / 2)
        name = torch.cuda.get_device_name(device)
    finally:
        pynvml.nvmlShutdown()
    floor = PHASE_POWER_FRACTION["idle"]
    watts = {phase: idle + (fraction - floor) / (1 - floor) * (compute - idle)
             for phase, fraction in PHASE_POWER_FRACTION.items()}
    watts.update(idle=idle, off=0.0)
    note = f"NVML on {name}: {compute:.0f} W computing, {idle:.0f} W idle"
    return dataclasses.replace(base, watts=watts, source="NVML"), note


__all__ = ["PHASES", "TDP_WATTS", "PowerLevels", "calibrate_levels", "default_levels", "parse_levels"]
