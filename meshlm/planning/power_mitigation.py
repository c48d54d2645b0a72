"""What a power floor and its ramps would cost a job, against the swing they remove.

The software mitigation of the power-stabilization paper (2025), as ``train.power_floor=F`` and
``train.power_ramp_seconds=R`` run it (``meshlm/training/power_floor.py``), applied to a trace:

* **floor F**: while the job runs, no GPU draws less than ``F`` of its compute power -- the
  filler's GEMMs make up the difference in every wait. The swing shrinks from
  ``peak - trough`` to at most ``(1 - F) * peak``; the energy of the filler is
  ``integral of max(0, F * compute - P(t)) dt`` over the GPUs.
* **ramps R**: the floor rises from 0 to F over the R seconds before the first step and falls
  back over the R seconds after the last; during a checkpoint save it fades from F to 0 over R
  and climbs back over the last R seconds of the save (the trainer climbs back after the save,
  delaying the next step by up to R: the trace does not shift for it). Without ramps a save is
  held at F. Ramps turn the job's start and stop from a jump of its whole peak into a jump of
  ``(1 - F)`` of it plus a slope of ``F * peak / R``.

The result keeps the same samples, so swing, ramp rates and band energy are computed the same
way before and after; the cost is in MWh and as a share of the job's energy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshlm.planning.power_spectrum import ramp_rates, spectrum, swing


@dataclass
class Mitigated:
    floor: float
    ramp_seconds: float
    watts_per_gpu: np.ndarray


def floor_envelope(trace, floor: float, ramp_seconds: float) -> np.ndarray:
    """The floor in force at each sample, as a fraction of compute power (0 outside the job)."""
    times = trace.seconds
    start, end = trace.run_start / trace.rate_hz, trace.run_end / trace.rate_hz
    envelope = np.where((times >= start) & (times < end), 1.0, 0.0)
    if ramp_seconds > 0:
        envelope = np.maximum(envelope, np.clip(1 - (start - times) / ramp_seconds, 0, 1) * (times < start))
        envelope = np.maximum(envelope, np.clip(1 - (times - end) / ramp_seconds, 0, 1) * (times >= end))
        for _, pause_start, pause_end in trace.pauses:
            inside = (times >= pause_start) & (times < pause_end)
            fade = np.clip(1 - (times - pause_start) / ramp_seconds, 0, 1)
            climb = np.clip(1 - (pause_end - times) / ramp_seconds, 0, 1)
            envelope = np.where(inside, np.maximum(fade, climb), envelope)
    return floor * envelope


def with_floor(trace, levels, floor: float, ramp_seconds: float = 0.0) -> Mitigated:
    """The trace as ``train.power_floor=floor`` and ``train.power_ramp_seconds=ramp_seconds`` would make it."""
    target = floor_envelope(trace, floor, ramp_seconds) * levels["compute"]
    return Mitigated(floor, ramp_seconds, np.maximum(trace.watts_per_gpu, target))


def power_report(trace, watts_per_gpu: np.ndarray, band: tuple[float, float], ramp_window_s: float) -> dict:
    """Swing, ramp rates, dominant frequency, band share and energy of a (possibly mitigated) trace."""
    megawatts = watts_per_gpu * trace.gpus / 1e6
    running = trace.run_part(megawatts)
    up, down = ramp_rates(megawatts, trace.rate_hz, ramp_window_s)
    steady_up, steady_down = ramp_rates(running, trace.rate_hz, ramp_window_s)
    spec = spectrum(running, trace.rate_hz)
    return {"peak_mw": float(running.max()), "trough_mw": float(running.min()), "mean_mw": float(running.mean()),
            "swing_mw": swing(running), "max_ramp_up_mw_per_s": up, "max_ramp_down_mw_per_s": down,
            "running_ramp_mw_per_s": max(steady_up, steady_down), "dominant_hz": spec.dominant_hz(),
            "band_fraction": spec.band_fraction(*band),
            "band_amplitude_mw": float(np.sqrt(np.sum(spec.amplitude[(spec.frequencies_hz >= band[0])
                                                                      & (spec.frequencies_hz <= band[1])] ** 2))),
            "energy_mwh": float(megawatts.sum() / trace.rate_hz / 3600)}


def mitigation_rows(trace, levels, floors: list[float], ramp_seconds: float, band, ramp_window_s: float) -> list[dict]:
    """The baseline, then each floor (with the ramps): its report, the extra energy and the swing removed."""
    baseline = power_report(trace, trace.watts_per_gpu, band, ramp_window_s)
    rows = [{"mitigation": "none", **baseline}]
    for floor in floors:
        mitigated = with_floor(trace, levels, floor, ramp_seconds)
        report = power_report(trace, mitigated.watts_per_gpu, band, ramp_window_s)
        extra = report["energy_mwh"] - baseline["energy_mwh"]
        name = f"floor {floor:g}" + (f", ramps {ramp_seconds:g} s" if ramp_seconds > 0 else "")
        rows.append({"mitigation": name, "power_floor": floor, "power_ramp_seconds": ramp_seconds, **report,
                     "extra_energy_mwh": extra,
                     "extra_energy_fraction": extra / baseline["energy_mwh"] if baseline["energy_mwh"] else 0.0,
                     "swing_removed_mw": baseline["swing_mw"] - report["swing_mw"]})
    return rows


__all__ = ["Mitigated", "floor_envelope", "mitigation_rows", "power_report", "with_floor"]
