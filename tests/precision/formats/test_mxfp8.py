"""mxfp8.py: 32-element blocks with E8M0 scales 2^ceil(log2(amax / 448)), checked by hand and by a loop."""

import torch

from meshlm.precision.formats.fp8 import E4M3, E5M2, quantize_fp8
from meshlm.precision.formats.mxfp8 import E8M0, dequantize_mxfp8, quantize_mxfp8


def test_e8m0_scales_by_hand_with_zero_tiny_and_partial_blocks():
    x = torch.zeros(3, 40)
    x[0, 0] = 448.0          # block (0, 0): 2^0 -> code 127
    x[0, 39] = -449.0        # block (0, 1), 8 elements: just above 448 -> 2^1, code 128
    x[1, 3] = 1.0            # block (1, 0): 1 / 448 -> 2^-8, code 119; block (1, 1) all zero -> 1, code 127
    x[2, 0] = 1e-40          # block (2, 0): below 448 * 2^-127 -> the smallest scale 2^-127, code 0
    x[2, 35] = 57344.0       # block (2, 1): 57344 / 448 = 128 -> 2^7, code 134
    quantized = quantize_mxfp8(x)
    assert quantized.scales.dtype == E8M0 and quantized.scales.shape == (3, 2)
    assert quantized.scales.view(torch.uint8).tolist() == [[127, 128], [119, 127], [0, 134]]
    assert quantized.values[0, 39] == -448.0 and quantized.values[2, 35] == 57344.0
    e5m2 = quantize_mxfp8(x, E5M2)
    assert e5m2.scales.view(torch.uint8)[2, 1] == 127  # fits E5M2 as it is


def reference_mxfp8(x: torch.Tensor, fmt) -> torch.Tensor:
    values = torch.empty_like(x)
    for row in range(x.shape[0]):
        for col in range(0, x.shape[1], 32):
            block = x[row, col:col + 32]
            amax = block.abs().max().item()
            exponent = 0
            if amax > 0:
                exponent = -127
                while amax > fmt.max_value * 2.0 ** exponent:
                    exponent += 1
            values[row, col:col + 32] = quantize_fp8(block, 2.0 ** exponent, fmt).values
    return values


def test_random_tensors_match_a_block_by_block_reference():
    x = torch.randn(20, 100, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 20)[:, None]
    for fmt in [E4M3, E5M2]:
        quantized = quantize_mxfp8(x, fmt)
        assert torch.equal(quantized.values, reference_mxfp8(x, fmt))
        assert torch.equal(dequantize_mxfp8(quantized.codes, quantized.scales), quantized.values)


def test_dtypes_and_shapes():
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    quantized = quantize_mxfp8(x)
    assert quantized.values.dtype == torch.bfloat16 and quantized.codes.shape == x.shape
    assert quantized.scales.shape == (2, 5, 2)
    assert quantize_mxfp8(torch.randn(33)).scales.shape == (2,)
