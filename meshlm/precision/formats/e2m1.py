"""E2M1, the 4-bit element of NVFP4: round-to-nearest-even and stochastic rounding.

Four bits: a sign, 2 exponent bits (bias 1) and 1 mantissa bit, no infinities or NaN. The eight
magnitudes are

    code & 0b0111:  0    1    2    3    4    5    6    7
    magnitude:      0   0.5   1   1.5   2    3    4    6

(0 and 0.5 are the subnormals), and bit 3 (0b1000) is the sign, so -1.5 is code 0b1011 = 11.
The magnitude index is ordered like the magnitudes, and an even index is an even mantissa bit.
Codes are returned one per ``uint8``, unpacked (hardware packs two per byte).

Two roundings, both saturating (a magnitude above 6 becomes 6, as ``cvt.satfinite`` does):

- **nearest-even**: the closest magnitude; a value exactly halfway goes to the even index
  (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4);
- **stochastic**: between neighbours ``lo <= |x| <= hi`` round up with probability
  ``(|x| - lo) / (hi - lo)``, so ``E[round(x)] = x`` -- unbiased, which is why NVFP4 training uses
  it for gradients ("Pretraining LLMs with NVFP4", 2025; docs/references.md, "Precision"): rounding errors
  of many small updates average out instead of all pointing the same way. Each element's
  absolute error is larger than with nearest rounding; the error of their mean is smaller.
  The random numbers are given (``uniform``, e.g. hashed from the values: ``hashed_noise.py``)
  or drawn from an explicit ``torch.Generator``, never the global RNG.
"""

from __future__ import annotations

from typing import Literal

import torch

E2M1_MAX = 6.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of each code's low three bits."""
SIGN_BIT = 0b1000

Rounding = Literal["nearest", "stochastic"]


def _magnitudes(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)


def _nearest_even_index(magnitude: torch.Tensor) -> torch.Tensor:
    """Index (0..7) of the nearest E2M1 magnitude to ``magnitude`` (fp32, in [0, 6]); ties to even."""
    grid = _magnitudes(magnitude.device)
    midpoints = (grid[:-1] + grid[1:]) / 2
    index = torch.bucketize(magnitude.contiguous(), midpoints)  # on midpoint i: index i, the lower one
    on_midpoint = (index < len(midpoints)) & (magnitude == midpoints[index.clamp(max=len(midpoints) - 1)])
    return torch.where(on_midpoint & (index % 2 == 1), index + 1, index)


def _stochastic_index(magnitude: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index of ``lo`` or ``hi`` around ``magnitude`` (fp32, in [0, 6]); ``hi`` when ``uniform``
    (numbers in [0, 1), same shape) lies below ``(magnitude - lo) / (hi - lo)``."""
    grid = _magnitudes(magnitude.device)
    lower = (torch.bucketize(magnitude.contiguous(), grid, right=True) - 1).clamp(0, len(grid) - 2)
    low, high = grid[lower], grid[lower + 1]
    round_up_probability = (magnitude - low) / (high - low)
    return lower + (uniform < round_up_probability).long()


def encode_e2m1(x: torch.Tensor, rounding: Rounding = "nearest", generator: torch.Generator | None = None,
                uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Round ``x`` (any shape and float dtype, already scaled into [-6, 6]) to E2M1 codes (``uint8``, same shape).

    ``rounding="stochastic"`` needs ``uniform`` (numbers in [0, 1), ``x``'s shape) or ``generator``
    (on ``x``'s device) to draw them. Larger magnitudes saturate to 6.
    """
    magnitude = x.float().abs().clamp(max=E2M1_MAX)
    if rounding == "nearest":
        index = _nearest_even_index(magnitude)
    elif rounding == "stochastic":
        if uniform is None and generator is None:
            raise ValueError("stochastic rounding needs its random numbers (uniform=...) or an explicit "
                             "torch.Generator (generator=...); it never draws from the global random state.")
        if uniform is None:
            uniform = torch.rand(magnitude.shape, generator=generator, device=magnitude.device)
        index = _stochastic_index(magnitude, uniform)
    else:
        raise ValueError(f"rounding={rounding!r} is invalid; use 'nearest' or 'stochastic'.")
    return (index + torch.signbit(x).long() * SIGN_BIT).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (``uint8``, any shape) -> their values in fp32, same shape."""
    codes = codes.long()
    magnitude = _magnitudes(codes.device)[codes & 0b0111]
    return torch.where(codes & SIGN_BIT != 0, -magnitude, magnitude)
