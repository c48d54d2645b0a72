"""FP8 with one scale: the E4M3 and E5M2 formats, amax -> scale, current and delayed scaling.

An FP8 number has 8 bits: E4M3 (4 exponent bits, 3 mantissa bits, no infinities, largest finite
value 448) for weights and activations, E5M2 (5 exponent, 2 mantissa, largest 57344) where range
matters more than precision -- gradients in Transformer Engine's "hybrid" recipe. So few values
cover a tensor only after a *scale* moves its magnitudes into the format's range:

    codes = fp8(x / scale),        x ~ codes * scale    (scale an fp32 number).

A tensor's largest magnitude ``amax`` should land on the format's largest value, hence
``scale = amax / format_max``. Optionally the scale is rounded *up* to a power of two (DeepSeek-V3
does this for its block scales): multiplying by a power of two is exact, so dequantization adds
no rounding, and rounding up keeps ``amax / scale <= format_max`` (nothing saturates).

The cast is round-to-nearest-even, saturating: a value beyond the format's largest finite value
becomes that value (``satfinite`` on NVIDIA hardware), never inf or NaN; NaN stays NaN. We cast
through ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, after clamping: PyTorch's E4M3 cast
already saturates, its E5M2 cast does not (61440 -> inf).

Two ways to choose the scale (Transformer Engine recipes; see docs/references.md, "Precision"):

- *current* (per-tensor) scaling, ``quantize_fp8_tensorwise``: the amax of this very tensor --
  exact, but it needs a full pass over the tensor before the cast;
- *delayed* scaling, ``AmaxHistory``: the scale comes from the largest amax seen in the last
  ``history_length`` steps (TE default 1024), so the cast needs no extra pass; this step's amax
  is recorded after the cast and affects the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class FP8Format:
    """One 8-bit floating-point element format."""

    name: str
    """``"e4m3"`` or ``"e5m2"``."""
    dtype: torch.dtype
    """The PyTorch dtype whose cast rounds to this format."""
    max_value: float
    """Largest finite magnitude; larger inputs saturate to it."""


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0)

MIN_SCALE_EXPONENT = -127
MAX_SCALE_EXPONENT = 127
"""Power-of-two scales are 2^k with k in [-127, 127]: the range of an E8M0 scale (MXFP8), all of it
representable in fp32 (2^-127 as a subnormal)."""


class FP8Quantized(NamedTuple):
    """A tensor after FP8 quantization."""

    values: torch.Tensor
    """Dequantized: ``codes * scales`` (scales broadcast over their block), in the input's dtype and shape."""
    codes: torch.Tensor
    """The FP8 numbers themselves (dtype ``float8_e4m3fn`` / ``float8_e5m2``), the input's shape."""
    scales: torch.Tensor
    """fp32 (``float8_e8m0fnu`` for MXFP8): a 0-dim tensor per tensor, or one per block (see the function)."""


def power_of_two_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """Smallest 2^k (k in [-127, 127]) with ``amax / 2^k <= max_value``, elementwise, fp32.

    ``2^ceil(log2(amax / max_value))`` in exact arithmetic. ``log2`` of the rounded ratio can miss
    by one next to a power of two, so the exponent is corrected with comparisons that are exact in
    fp32 (``max_value * 2^k`` is representable). ``amax = 0`` gives 2^-127; callers that want
    another scale for an all-zero block replace it.
    """
    amax = amax.float()
    exponent = torch.ceil(torch.log2(amax / max_value)).clamp(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT)
    exponent = torch.where(amax > max_value * torch.exp2(exponent), exponent + 1, exponent)
    exponent = torch.where(amax <= max_value * torch.exp2(exponent - 1), exponent - 1, exponent)
    return torch.exp2(exponent.clamp(MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT))


def scale_from_amax(amax: torch.Tensor, fmt: FP8Format = E4M3, power_of_two: bool = False) -> torch.Tensor:
    """The scale that maps ``amax`` onto ``fmt.max_value``: ``amax / max_value`` (fp32, elementwise).

    ``power_of_two=True`` rounds it up to the next power of two (``power_of_two_scale``). An amax of
    zero (an all-zero tensor or block) gets scale 1, so zeros stay zeros and nothing divides by 0.
    A non-finite amax gives a non-finite scale: the caller decides (``AmaxHistory`` keeps its old one).
    """
    amax = torch.as_tensor(amax, dtype=torch.float32)
    scale = power_of_two_scale(amax, fmt.max_value) if power_of_two else amax / fmt.max_value
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, fmt: FP8Format = E4M3) -> FP8Quantized:
    """Quantize ``x [any shape]`` with ``scale`` (fp32, broadcastable to ``x``) to ``fmt``.

    ``codes = fp8(clamp(x / scale, -max, max))`` (round-to-nearest-even, computed in fp32), and
    ``values = codes * scale`` cast back to ``x.dtype`` -- exact when ``scale`` is a power of two
    and the product fits ``x.dtype``, otherwise rounded once more to ``x.dtype``.
    """
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    codes = fp8_codes(x, scale, fmt)
    return FP8Quantized(dequantize_fp8(codes, scale, x.dtype), codes, scale)


def fp8_codes(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format = E4M3) -> torch.Tensor:
    """The codes of ``quantize_fp8`` alone, for a GEMM that multiplies codes (``fp8_gemm.py``):
    without a compiler to drop the unused dequantized values, computing them would double the
    bytes an eager step moves per operand."""
    return (x.float() / scale).clamp(-fmt.max_value, fmt.max_value).to(fmt.dtype)


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a 0-dim fp32 tensor (NaN if ``x`` holds one), with no gradient. Taken in
    ``x``'s own dtype -- the absolute value and the maximum of bf16 numbers are bf16 numbers, so
    this is exact -- and widened after: no fp32 copy of the whole tensor."""
    return x.detach().abs().amax().float()


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale`` in fp32, then cast to ``dtype``; ``scale`` broadcastable to ``codes``."""
    return (codes.float() * scale.float()).to(dtype)


def quantize_fp8_tensorwise(x: torch.Tensor, fmt: FP8Format = E4M3, power_of_two: bool = False) -> FP8Quantized:
    """Current per-tensor scaling: ``scale = amax(|x|) / fmt.max_value``; ``scales`` is a 0-dim fp32 tensor."""
    return quantize_fp8(x, scale_from_amax(abs_max(x), fmt, power_of_two), fmt)


class AmaxHistory:
    """Delayed scaling (Transformer Engine's ``DelayedScaling`` with ``amax_compute_algo="max"``).

    ``history[0]`` is the newest amax, ``history[-1]`` the oldest; ``update`` rolls the window by one
    and recomputes ``scale`` from the window's max. The scale used at step t therefore comes from
    steps t - history_length .. t - 1. As in TE the scale is kept (not recomputed) while the window's
    max is zero (nothing seen yet: the initial scale is 1) or non-finite (an overflowed step), so
    one inf does not wipe out the scale.

    The state is two fp32 tensors (``state_dict``), so it can live in a checkpoint and never needs
    a device-to-host sync.
    """

    def __init__(self, history_length: int = 1024, fmt: FP8Format = E4M3, power_of_two: bool = False,
                 device: torch.device | str | None = None):
        if history_length < 1:
            raise ValueError(f"history_length={history_length} is invalid; use a positive integer such as 1024.")
        self.fmt = fmt
        self.power_of_two = power_of_two
        self.history = torch.zeros(history_length, dtype=torch.float32, device=device)
        """``[history_length]`` amaxes, newest first."""
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        """0-dim fp32: the scale the next ``quantize`` uses."""

    def update(self, amax: torch.Tensor | float) -> None:
        """Record one step's amax and recompute ``scale`` from the window's max."""
        self.history.copy_(torch.roll(self.history, 1))
        self.history[0] = torch.as_tensor(amax, dtype=torch.float32)
        window_max = self.history.max()
        candidate = scale_from_amax(window_max, self.fmt, self.power_of_two)
        keep = (window_max == 0) | ~torch.isfinite(window_max)
        self.scale = torch.where(keep, self.scale, candidate)

    def quantize(self, x: torch.Tensor) -> FP8Quantized:
        """Quantize ``x`` with the current (delayed) scale, then record ``x``'s amax for the next steps."""
        quantized = quantize_fp8(x, self.scale, self.fmt)
        self.update(abs_max(x))
        return quantized

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": self.history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["history"].shape != self.history.shape:
            raise ValueError(f"the saved amax history has length {state['history'].shape[0]}, this one "
                             f"{self.history.shape[0]}; build the AmaxHistory with the saved history_length.")
        self.history.copy_(state["history"])
        self.scale = state["scale"].to(self.scale.device, torch.float32).clone()
