"""e2m1.py: nearest-even against an independent table; stochastic rounding unbiased and reproducible.

What the stochastic-rounding tests claim, precisely: for x between neighbours lo < x < hi,
(1) every draw is lo or hi; (2) the mean of N draws is within 5 standard errors of x, the standard
error being (hi - lo) sqrt(p (1 - p) / N) with p = (x - lo) / (hi - lo); (3) that mean is closer
to x than nearest rounding is; (4) the sum of many rounded small values tracks the true sum where
nearest rounding loses it; and (5) the per-element mean absolute error is *not* smaller than
nearest rounding's (2 p (1 - p) (hi - lo) >= min(p, 1 - p) (hi - lo)): the gain is in the bias.
"""

import math

import pytest
import torch

from meshlm.precision.formats.e2m1 import decode_e2m1, encode_e2m1


def table_value(code: int) -> float:
    """E2M1 from its bit fields: sign | 2 exponent bits (bias 1) | 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


TABLE = {code: table_value(code) for code in range(16)}


def reference_nearest_even(value: float) -> int:
    magnitude = min(abs(value), 6.0)
    best = min(range(8), key=lambda code: (abs(TABLE[code] - magnitude), code % 2))  # ties: even mantissa
    return best | (0b1000 if math.copysign(1.0, value) < 0 else 0)


def test_the_table():
    assert [TABLE[code] for code in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    decoded = decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert decoded.tolist() == [TABLE[code] for code in range(16)]
    assert torch.signbit(decoded[8])  # code 8 is -0


def test_nearest_even_matches_the_table_on_a_grid_with_every_midpoint_and_random_values():
    grid = torch.arange(-8 * 64, 8 * 64 + 1) / 64.0  # steps of 1/64: all midpoints 0.25, 0.75, ..., 5
    random = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 3
    x = torch.cat([grid, random, torch.tensor([-0.0, math.inf, -math.inf, 1e30])])
    expected = torch.tensor([reference_nearest_even(v) for v in x.tolist()], dtype=torch.uint8)
    assert torch.equal(encode_e2m1(x), expected)


def test_ties_by_hand():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5])
    assert decode_e2m1(encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0]


def test_accepts_low_precision_inputs():
    x = torch.tensor([0.3, -1.3, 2.6, 7.0], dtype=torch.bfloat16)
    assert decode_e2m1(encode_e2m1(x)).tolist() == [0.5, -1.5, 3.0, 6.0]


NEIGHBOURS = {0.1: (0.0, 0.5), 0.3: (0.0, 0.5), 0.6: (0.5, 1.0), 1.2: (1.0, 1.5), 1.7: (1.5, 2.0),
              2.2: (2.0, 3.0), 2.9: (2.0, 3.0), 3.3: (3.0, 4.0), 4.5: (4.0, 6.0), 5.9: (4.0, 6.0),
              -0.3: (-0.5, -0.0), -2.6: (-3.0, -2.0)}
DRAWS = 20000


def stochastic_draws(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(list(NEIGHBOURS))
    generator = torch.Generator().manual_seed(seed)
    rounded = decode_e2m1(encode_e2m1(x[:, None].expand(-1, DRAWS), "stochastic", generator))
    return x, rounded


def test_stochastic_rounding_gives_a_neighbour_and_is_unbiased():
    x, rounded = stochastic_draws()
    for row, value in enumerate(x.tolist()):
        low, high = NEIGHBOURS[round(value, 6)]
        assert set(rounded[row].unique().tolist()) == {low, high}
        p = (value - low) / (high - low)
        standard_error = (high - low) * math.sqrt(p * (1 - p) / DRAWS)
        assert abs(rounded[row].double().mean().item() - value) < 5 * standard_error


def test_stochastic_mean_beats_nearest_but_its_per_element_error_does_not():
    x, rounded = stochastic_draws(seed=1)
    nearest_error = (decode_e2m1(encode_e2m1(x)) - x).abs()
    mean_error = (rounded.double().mean(dim=1) - x.double()).abs()
    assert torch.all(mean_error < nearest_error.double())
    per_element_error = (rounded - x[:, None]).abs().double().mean(dim=1)
    assert torch.all(per_element_error > 0.95 * nearest_error.double())


def test_a_sum_of_small_values_survives_only_stochastic_rounding():
    small = torch.full((10000,), 0.1)  # nearest: every one rounds to 0
    generator = torch.Generator().manual_seed(2)
    assert decode_e2m1(encode_e2m1(small)).sum() == 0.0
    stochastic_sum = decode_e2m1(encode_e2m1(small, "stochastic", generator)).sum().item()
    assert abs(stochastic_sum - 1000.0) < 5 * 0.5 * math.sqrt(0.2 * 0.8 * 10000)


def test_stochastic_rounding_saturates_above_six():
    generator = torch.Generator().manual_seed(3)
    assert decode_e2m1(encode_e2m1(torch.full((100,), -7.5), "stochastic", generator)).eq(-6.0).all()


def test_stochastic_rounding_is_reproducible_and_leaves_the_global_rng_alone():
    global_state = torch.get_rng_state()
    _, first = stochastic_draws(seed=7)
    _, again = stochastic_draws(seed=7)
    _, other = stochastic_draws(seed=8)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.get_rng_state(), global_state)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="torch.Generator"):
        encode_e2m1(torch.ones(3), "stochastic")
    with pytest.raises(ValueError, match="'nearest' or 'stochastic'"):
        encode_e2m1(torch.ones(3), "truncate")
