"""meshlm/planning/power_spectrum.py: a square wave's energy sits at 1/T and its odd harmonics;
swing, ramp rates and band shares of hand-built traces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshlm.errors import ConfigError
from meshlm.planning.power_spectrum import parse_band, ramp_rates, spectrum, swing


def square_wave(period_s: float, seconds: float, rate_hz: float, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    times = np.arange(int(round(seconds * rate_hz))) / rate_hz
    return np.where((times % period_s) < period_s / 2, high, low)


def energy_at(spec, frequency_hz: float) -> float:
    return float(spec.energy[int(np.argmin(np.abs(spec.frequencies_hz - frequency_hz)))])


@pytest.mark.parametrize("period_s", [0.5, 2.0, 4.0])
def test_square_wave_energy_is_at_its_frequency_and_odd_harmonics(period_s):
    rate, seconds = 200.0, 40 * period_s  # a whole number of periods: each harmonic in one bin
    spec = spectrum(square_wave(period_s, seconds, rate, low=-1.0, high=1.0), rate)
    fundamental = 1 / period_s
    assert spec.dominant_hz() == pytest.approx(fundamental)
    assert spec.amplitude[np.argmax(spec.energy)] == pytest.approx(4 / math.pi, rel=0.01)  # 4/pi of the half-swing
    for harmonic in (3, 5, 7):
        assert energy_at(spec, harmonic * fundamental) / energy_at(spec, fundamental) == pytest.approx(
            1 / harmonic ** 2, rel=0.03)
    for even in (2, 4, 6):
        assert energy_at(spec, even * fundamental) < 1e-12  # a 50% duty cycle has no even harmonics
    assert spec.band_fraction(0.9 * fundamental, 1.1 * fundamental) == pytest.approx(8 / math.pi ** 2, rel=0.01)


def test_band_fraction_counts_the_harmonics_inside():
    rate = 400.0
    spec = spectrum(square_wave(0.5, 20.0, rate), rate)  # 2 Hz: harmonics 2, 6, 10, 14, 18 Hz lie in 0.1-20 Hz
    inside = sum(1 / k ** 2 for k in (1, 3, 5, 7, 9)) / (math.pi ** 2 / 8)
    assert spec.band_fraction(0.1, 20.0) == pytest.approx(inside, rel=0.01)
    assert spec.band_fraction(0.1, 1.0) < 1e-12
    assert spec.energy.sum() == pytest.approx(1.0)


def test_constant_trace_has_no_oscillation():
    spec = spectrum(np.full(100, 3.0), 10.0)
    assert spec.energy.sum() == 0 and spec.band_fraction(0.1, 5) == 0


def test_swing_and_ramps_of_hand_built_traces():
    assert swing(np.array([3.0, 1.0, 4.0, 1.0, 5.0])) == 4.0
    rate = 100.0
    rising = np.concatenate([np.zeros(100), np.linspace(0, 10, 201), np.full(100, 10.0)])  # 10 MW in 2 s
    up, down = ramp_rates(rising, rate, window_s=0.1)
    assert up == pytest.approx(5.0) and down == 0.0
    step_down = np.concatenate([np.full(50, 8.0), np.full(50, 2.0)])  # a 6 MW drop in one sample
    up, down = ramp_rates(step_down, rate, window_s=0.1)
    assert up == 0.0 and down == pytest.approx(6.0 / 0.1)  # measured over the 0.1 s window
    assert ramp_rates(step_down, rate, window_s=0.01)[1] == pytest.approx(6.0 / 0.01)


@pytest.mark.parametrize("text", ["20,0.1", "1", "a,b", "-1,5", "5,5"])
def test_bad_band_is_refused(text):
    with pytest.raises(ConfigError, match="--band"):
        parse_band(text)
    assert parse_band(" 0.1, 20 ") == (0.1, 20.0)
