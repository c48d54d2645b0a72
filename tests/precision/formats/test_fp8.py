"""fp8.py: E4M3 / E5M2 rounding against an independent nearest-even reference, scales, AmaxHistory."""

import math

import pytest
import torch

from meshlm.precision.formats.fp8 import (E4M3, E5M2, AmaxHistory, abs_max, dequantize_fp8, fp8_codes,
                                          power_of_two_scale, quantize_fp8, quantize_fp8_tensorwise, scale_from_amax)

FORMATS = [E4M3, E5M2]


def finite_magnitudes(fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes 0..127 whose value is finite, their values in fp64), ascending -- read off the bit patterns."""
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(fmt.dtype).double()
    finite = torch.isfinite(values)
    return codes[finite], values[finite]


def reference_codes(x: torch.Tensor, fmt) -> torch.Tensor:
    """Independent saturating round-to-nearest-even: nearest finite magnitude, ties to the even code."""
    codes, magnitudes = finite_magnitudes(fmt)
    magnitude = x.double().abs().clamp(max=fmt.max_value)
    distance = (magnitude[:, None] - magnitudes[None, :]).abs()
    nearest = distance == distance.min(dim=1, keepdim=True).values
    # among the (one or two) nearest, prefer an even code: score = nearest * (2 if even else 1)
    score = nearest.long() * (2 - (codes.long() % 2))[None, :]
    chosen = codes[score.argmax(dim=1)]
    return chosen | (torch.signbit(x).to(torch.uint8) << 7)


def bits(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("exponent", [-12, 0, 5])
def test_every_representable_value_scaled_by_a_power_of_two_round_trips(fmt, exponent):
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fmt.dtype).float()
    finite = torch.isfinite(values)
    scale = 2.0 ** exponent
    quantized = quantize_fp8(values[finite] * scale, scale, fmt)
    assert torch.equal(bits(quantized.codes), codes[finite])
    assert torch.equal(quantized.values, values[finite] * scale)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_midpoints_and_their_neighbours_round_to_nearest_even(fmt):
    _, magnitudes = finite_magnitudes(fmt)
    midpoints = ((magnitudes[:-1] + magnitudes[1:]) / 2).float()  # one bit more than the format: exact in fp32
    inputs = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(math.inf)),
                        torch.nextafter(midpoints, torch.tensor(0.0))])
    inputs = torch.cat([inputs, -inputs])
    codes = quantize_fp8(inputs, 1.0, fmt).codes
    assert torch.equal(bits(codes), reference_codes(inputs, fmt))
    # and the library cast agrees on the in-range values
    assert torch.equal(bits(codes), bits(inputs.to(fmt.dtype)))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0 ** -7, 3e3])
def test_random_tensors_match_the_reference_including_saturation(fmt, scale):
    generator = torch.Generator().manual_seed(1)
    magnitudes = torch.logspace(-10, 6, 8)  # from underflow to far beyond both formats' range
    x = (torch.randn(8, 2000, generator=generator) * magnitudes[:, None]).flatten()
    codes = quantize_fp8(x, scale, fmt).codes
    assert torch.equal(bits(codes), reference_codes(x.float() / torch.tensor(scale), fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_out_of_range_saturates_and_nan_stays_nan(fmt):
    x = torch.tensor([math.inf, -math.inf, 1e30, -fmt.max_value * 1.2, fmt.max_value * 1.07, math.nan])
    values = quantize_fp8(x, 1.0, fmt).values
    assert values[:5].tolist() == [fmt.max_value, -fmt.max_value, fmt.max_value, -fmt.max_value, fmt.max_value]
    assert torch.isnan(values[5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_values_are_codes_times_scale_in_the_input_dtype(dtype):
    x = (torch.randn(64, 48, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    quantized = quantize_fp8(x, 2.0 ** -4)
    assert quantized.values.dtype == dtype and quantized.values.shape == x.shape
    assert torch.equal(quantized.values, (quantized.codes.float() * 2.0 ** -4).to(dtype))
    assert torch.equal(dequantize_fp8(quantized.codes, quantized.scales, dtype), quantized.values)


def test_scale_from_amax_hand_computed():
    amax = torch.tensor([448.0, 896.0, 0.0, 1.0, 449.0, 447.0])
    assert torch.equal(scale_from_amax(amax), torch.tensor([1.0, 2.0, 1.0, 1 / 448, 449 / 448, 447 / 448]))
    assert torch.equal(scale_from_amax(amax, power_of_two=True), torch.tensor([1.0, 2.0, 1.0, 2.0 ** -8, 2.0, 1.0]))
    assert torch.equal(scale_from_amax(torch.tensor(57344.0 * 3), E5M2, power_of_two=True), torch.tensor(4.0))


def test_power_of_two_scale_is_the_smallest_that_fits():
    generator = torch.Generator().manual_seed(3)
    amax = torch.exp2(torch.rand(5000, generator=generator) * 200 - 100)
    boundaries = 448.0 * torch.exp2(torch.arange(-20.0, 21.0))
    amax = torch.cat([amax, boundaries, torch.nextafter(boundaries, torch.tensor(math.inf)),
                      torch.nextafter(boundaries, torch.tensor(0.0))])
    scale = power_of_two_scale(amax, 448.0)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # a power of two
    assert torch.all(amax / scale <= 448.0) and torch.all(amax / (scale / 2) > 448.0)
    assert torch.equal(power_of_two_scale(boundaries, 448.0), torch.exp2(torch.arange(-20.0, 21.0)))


def test_tensorwise_maps_the_amax_onto_the_format_max():
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(4)) * 7
    for fmt in FORMATS:
        quantized = quantize_fp8_tensorwise(x, fmt)
        assert quantized.scales.dim() == 0
        assert quantized.codes.float().abs().max() == fmt.max_value
        assert torch.equal(quantized.scales, x.abs().max() / fmt.max_value)
    zeros = quantize_fp8_tensorwise(torch.zeros(4, 4))
    assert zeros.scales == 1.0 and torch.equal(zeros.values, torch.zeros(4, 4))


def test_amax_history_rolls_and_takes_the_max():
    history = AmaxHistory(history_length=3)
    assert history.scale == 1.0  # nothing seen yet
    history.update(448.0)
    history.update(4 * 448.0)
    history.update(2 * 448.0)
    assert history.history.tolist() == [2 * 448.0, 4 * 448.0, 448.0]
    assert history.scale == 4.0
    history.update(448.0)
    assert history.scale == 4.0  # 4 * 448 still in the window of 3
    history.update(448.0)
    assert history.scale == 2.0  # it rolled out
    history.update(448.0)
    assert history.scale == 1.0


def test_amax_history_keeps_its_scale_on_a_non_finite_or_all_zero_window():
    history = AmaxHistory(history_length=2)
    history.update(0.0)
    assert history.scale == 1.0
    history.update(896.0)
    history.update(math.inf)
    assert history.scale == 2.0
    history.update(3 * 448.0)
    assert history.scale == 2.0  # the inf is still in the window
    history.update(3 * 448.0)
    assert history.scale == 3.0


def test_amax_history_quantizes_with_the_previous_steps_scale():
    history = AmaxHistory(history_length=4, power_of_two=True)
    first = history.quantize(torch.tensor([1000.0, 1.0]))
    assert first.scales == 1.0 and first.values.tolist() == [448.0, 1.0]  # delayed: saturates on step one
    second = history.quantize(torch.tensor([1000.0, 1.0]))
    assert second.scales == 4.0 and second.values.tolist() == [1024.0, 1.0]  # 1000 / 4 = 250 -> 256


def test_amax_history_state_round_trips():
    history = AmaxHistory(history_length=5, fmt=E5M2)
    for amax in [1.0, 7.0, 3.0]:
        history.update(amax)
    restored = AmaxHistory(history_length=5, fmt=E5M2)
    restored.load_state_dict(history.state_dict())
    assert torch.equal(restored.history, history.history) and torch.equal(restored.scale, history.scale)
    history.update(2.0)
    restored.update(2.0)
    assert torch.equal(restored.scale, history.scale)
    with pytest.raises(ValueError, match="history_length"):
        AmaxHistory(history_length=4).load_state_dict(history.state_dict())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_codes_alone_are_the_codes_of_the_full_quantization(dtype, fmt):
    """``fp8_codes`` (what the hardware GEMM reads, without the dequantized copy) and ``abs_max``
    (taken in the tensor's own dtype) give bit for bit what ``quantize_fp8`` from an fp32 amax gives."""
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 96, generator=generator) * torch.logspace(-6, 3, 96)).to(dtype)
    x[3, 5] = -4 * x.float().abs().max()  # a lone outlier sets the scale
    amax = abs_max(x)
    assert amax.dtype == torch.float32 and amax.dim() == 0
    assert torch.equal(amax, x.float().abs().amax())
    scale = scale_from_amax(amax, fmt)
    codes = fp8_codes(x, scale, fmt)
    assert torch.equal(codes.view(torch.uint8), quantize_fp8(x, scale, fmt).codes.view(torch.uint8))
    x[0, 0] = float("nan")
    assert torch.isnan(abs_max(x))
