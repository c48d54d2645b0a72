"""What a grid operator asks of a job's power trace: swing, ramp rates, and where its oscillation energy lies.

Three numbers constrain a large training job on the grid (the power-stabilization paper, 2025):

* **swing** -- peak minus trough of the job's power while it runs (MW): the dynamic range the
  supply must follow every step;
* **ramp rate** -- how fast power rises or falls (MW/s), measured here as the largest change over
  any ``window`` seconds divided by ``window`` (default 0.1 s; the job's start and stop count);
* **oscillation energy in the critical band** -- synchronous training repeats the same
  compute/communication pattern every step, so its power oscillates at the step frequency
  ``1/T`` and its harmonics; a square wave of period T has its energy at 1/T, 3/T, 5/T, ...
  (amplitudes 4/pi, 4/(3 pi), 4/(5 pi) of its half-swing). Oscillations at 0.1-20 Hz can excite
  grid and generator resonances, so utilities limit the energy there.

The spectrum is the discrete Fourier transform of the running part of the trace (mean removed:
the constant draw is not an oscillation): ``energy[k] = |X_k|^2`` normalized so the bins k >= 1
sum to 1, and ``amplitude[k] = 2 |X_k| / n``, the amplitude (MW) of the sinusoid at frequency
``k * rate / n`` (both one-sided). The band fraction is the share of that energy at frequencies in
[low, high] Hz. A trace holding a whole number of periods puts each harmonic in one bin; otherwise
its energy leaks into the neighbouring bins (no window is applied: it would move energy between
bins of a square wave whose period divides the trace exactly, the case tests check).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshlm.errors import ConfigError

DEFAULT_BAND_HZ = (0.1, 20.0)
DEFAULT_RAMP_WINDOW_S = 0.1


@dataclass
class Spectrum:
    frequencies_hz: np.ndarray
    energy: np.ndarray
    """Share of the oscillation energy per frequency bin (bin 0, the mean, is 0)."""
    amplitude: np.ndarray
    """Amplitude of each bin's sinusoid, in the trace's units."""

    def dominant_hz(self) -> float:
        return float(self.frequencies_hz[int(np.argmax(self.energy))]) if len(self.energy) > 1 else 0.0

    def band_fraction(self, low_hz: float, high_hz: float) -> float:
        inside = (self.frequencies_hz >= low_hz) & (self.frequencies_hz <= high_hz)
        return float(self.energy[inside].sum())


def spectrum(values: np.ndarray, rate_hz: float) -> Spectrum:
    """The one-sided spectrum of ``values`` sampled at ``rate_hz`` (see the module docstring)."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    transform = np.fft.rfft(values - values.mean())
    frequencies = np.fft.rfftfreq(n, 1.0 / rate_hz)
    power = np.abs(transform) ** 2
    power[0] = 0.0
    total = power.sum()
    amplitude = 2 * np.abs(transform) / max(n, 1)
    amplitude[0] = 0.0
    return Spectrum(frequencies, power / total if total > 0 else power, amplitude)


def swing(values: np.ndarray) -> float:
    """Peak minus trough."""
    return float(np.max(values) - np.min(values)) if len(values) else 0.0


def ramp_rates(values: np.ndarray, rate_hz: float, window_s: float = DEFAULT_RAMP_WINDOW_S) -> tuple[float, float]:
    """(largest rise, largest fall) per second over any ``window_s`` (at least one sample), both >= 0."""
    lag = max(1, int(round(window_s * rate_hz)))
    if len(values) <= lag:
        return 0.0, 0.0
    change = (values[lag:] - values[:-lag]) / (lag / rate_hz)
    return float(max(0.0, change.max())), float(max(0.0, -change.min()))


def parse_band(text: str) -> tuple[float, float]:
    """``'0.1,20'`` -> (0.1, 20.0): the critical band in Hz."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        low = high = float("nan")
    if not 0 <= low < high:
        raise ConfigError(f"--band {text!r} must be LOW,HIGH in Hz with 0 <= LOW < HIGH, e.g. --band 0.1,20.")
    return low, high


__all__ = ["DEFAULT_BAND_HZ", "DEFAULT_RAMP_WINDOW_S", "Spectrum", "parse_band", "ramp_rates", "spectrum", "swing"]
