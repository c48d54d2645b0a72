"""power.png: a job's power trace (and a mitigated one) over time, and its spectrum with the critical band.

Drawn like ``loss.png`` (``meshlm/training/plots.py``): matplotlib is optional (without it
``meshlm power`` says so and prints its numbers anyway), the Agg backend writes files only.
Top: the job's power in MW against seconds -- measured or predicted, and the trace under the
first power floor ``meshlm power`` evaluated. Bottom: the amplitude of each frequency of the
running part (log frequency axis), the critical band shaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from meshlm.planning.power_spectrum import spectrum

PLOT_FILE = "power.png"


def plot_power(trace, output: str | os.PathLike, band: tuple[float, float], title: str,
               mitigated=None) -> Path | None:
    """Draw the trace and its spectrum to ``output``; None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    output = Path(output)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6))
    top.plot(trace.seconds, trace.job_megawatts, linewidth=0.8, label="job")
    if mitigated is not None:
        top.plot(trace.seconds, mitigated.watts_per_gpu * trace.gpus / 1e6, linewidth=0.8, alpha=0.8,
                 label=f"power floor {mitigated.floor:g}")
        top.legend(loc="upper right")
    top.set_xlabel("seconds")
    top.set_ylabel("MW")
    top.set_title(title, fontsize=9)
    top.grid(alpha=0.3)
    spec = spectrum(trace.run_part(), trace.rate_hz)
    shown = spec.frequencies_hz > 0
    bottom.plot(spec.frequencies_hz[shown], spec.amplitude[shown], linewidth=0.8)
    bottom.axvspan(*band, color="tab:red", alpha=0.1, label=f"critical band {band[0]:g}-{band[1]:g} Hz")
    bottom.set_xscale("log")
    bottom.set_xlabel("frequency (Hz)")
    bottom.set_ylabel("amplitude (MW)")
    bottom.set_xlim(left=max(float(np.min(spec.frequencies_hz[shown])) if shown.any() else 0.01, 1e-3))
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    figure.tight_layout()
    temporary = output.with_name(output.name + ".tmp.png")
    figure.savefig(temporary, dpi=100)
    plt.close(figure)
    os.replace(temporary, output)
    return output


__all__ = ["PLOT_FILE", "plot_power"]
