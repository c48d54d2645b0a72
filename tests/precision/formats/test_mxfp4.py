"""MXFP4 (meshlm/precision/formats/mxfp4.py): the scale rule, nearest-even E2M1 codes, the packing
(low nibble first) and the dequantization, against values written out by hand."""

import pytest
import torch

from meshlm.precision.formats.e2m1 import E2M1_MAGNITUDES
from meshlm.precision.formats.mxfp4 import E8M0_BIAS, dequantize_mxfp4, quantize_mxfp4


def test_each_block_takes_the_smallest_power_of_two_that_fits_six():
    rows = torch.zeros(4, 64)
    rows[0, :32], rows[0, 32:] = torch.linspace(-3.0, 3.0, 32), torch.linspace(-0.7, 0.7, 32)
    rows[1, 0] = 6.0       # exactly 6: scale 1
    rows[1, 32] = 6.01     # just over: scale 2
    rows[2, 0] = 1e-6      # tiny: a negative exponent, 2^ceil(log2(1e-6 / 6)) = 2^-22
    quantized = quantize_mxfp4(rows)  # row 3 all zero: scale 1
    exponents = quantized.scales.to(torch.int32) - E8M0_BIAS
    assert exponents.tolist() == [[-1, -3], [0, 1], [-22, 0], [0, 0]]
    assert quantized.blocks.shape == (4, 2, 16) and quantized.blocks.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(*quantized, torch.float32)[3], torch.zeros(64))


def test_values_on_the_grid_survive_and_others_round_to_the_nearest_even_code():
    grid = torch.tensor(E2M1_MAGNITUDES)
    block = torch.cat((grid, -grid, grid.flip(0), -grid.flip(0)))  # every code: scale 1
    exact = torch.cat((block, block * 0.25))  # the second block at scale 2^-2
    quantized = quantize_mxfp4(exact)
    assert (quantized.scales.to(torch.int32) - E8M0_BIAS).tolist() == [0, -2]
    assert torch.equal(dequantize_mxfp4(*quantized, torch.float32), exact)
    halfway = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, *([0.0] * 24)])  # scale 1
    expected = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, *([0.0] * 24)])
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(halfway), torch.float32), expected)
    values = torch.randn(8, 96, generator=torch.Generator().manual_seed(0)) * 3
    quantized = quantize_mxfp4(values)
    scale = torch.exp2(quantized.scales.float() - E8M0_BIAS).repeat_interleave(32, -1)
    error = (dequantize_mxfp4(*quantized, torch.float32) - values).abs() / scale
    magnitude = values.abs() / scale  # half a step at most: steps of 0.5 below 2, 1 up to 4, 2 up to 6
    assert error.max() <= 1 + 1e-6 and error[magnitude < 4].max() <= 0.5 + 1e-6
    assert error[magnitude < 2].max() <= 0.25 + 1e-6


def test_two_codes_share_a_byte_the_first_in_the_low_nibble():
    values = torch.zeros(32)
    values[0], values[1], values[2] = 1.0, -6.0, 0.5  # codes 2, 15, 1 at scale 1
    blocks = quantize_mxfp4(values).blocks
    assert blocks[0, 0].item() == 2 | (15 << 4) and blocks[0, 1].item() == 1


def test_a_row_must_be_whole_blocks_and_the_stored_forms_uint8():
    with pytest.raises(ValueError, match="not a multiple of it"):
        quantize_mxfp4(torch.ones(3, 40))
    quantized = quantize_mxfp4(torch.ones(2, 32))
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(quantized.blocks.float(), quantized.scales)
