"""nvfp4.py: tensor and block scales by hand, a block-by-block reference, 16 x 16 blocks and W^T."""

import math

import pytest
import torch

from meshlm.precision.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4


def test_scales_and_values_by_hand():
    # Tensor amax 2688 = 448 * 6, so s_tensor = 1 and s_block = e4m3(block amax / 6).
    x = torch.zeros(2, 36)
    x[0, :3] = torch.tensor([2688.0, 1000.0, -300.0])  # block (0, 0): s_block 448
    x[0, 16:19] = torch.tensor([12.0, 3.0, 0.7])       # block (0, 1): 12 / 6 = 2
    x[0, 32:34] = torch.tensor([13.0, 1.0])            # block (0, 2), 4 elements: 13 / 6 = 2.1667 -> e4m3 2.25
    x[1, 16] = 1e-4                                    # block (1, 1): 1.7e-5 underflows e4m3 -> 0
    x[1, 32:35] = torch.tensor([6.0, 0.25, -0.75])     # block (1, 2): s_block 1; block (1, 0) all zero
    quantized = quantize_nvfp4(x)
    assert quantized.tensor_scale == 1.0
    assert quantized.block_scales.float().tolist() == [[448.0, 2.0, 2.25], [0.0, 0.0, 1.0]]
    expected = torch.zeros(2, 36)
    expected[0, :3] = torch.tensor([2688.0, 896.0, -224.0])  # 1000/448 = 2.23 -> 2; -300/448 = -0.67 -> -0.5
    expected[0, 16:19] = torch.tensor([12.0, 3.0, 1.0])       # 0.7 / 2 = 0.35 -> 0.5
    expected[0, 32:34] = torch.tensor([13.5, 1.125])          # 13 / 2.25 = 5.78 -> 6; 1 / 2.25 = 0.44 -> 0.5
    expected[1, 32:35] = torch.tensor([6.0, 0.0, -1.0])       # ties: 0.25 -> 0, 0.75 -> 1
    assert torch.equal(quantized.values, expected)
    assert quantized.codes[0, :3].tolist() == [0b0111, 0b0100, 0b1001]


def test_tensor_scale_and_an_all_zero_tensor():
    x = torch.tensor([1.0, 0.5] + [0.0] * 14 + [0.5] + [0.0] * 15)
    quantized = quantize_nvfp4(x)
    assert torch.equal(quantized.tensor_scale, torch.tensor(1.0) / 2688.0)
    assert quantized.block_scales.float().tolist() == [448.0, 224.0]
    assert torch.equal(quantized.values, x)
    zeros = quantize_nvfp4(torch.zeros(3, 16))
    assert zeros.tensor_scale == 1.0 and torch.equal(zeros.values, torch.zeros(3, 16))
    shared = quantize_nvfp4(x, tensor_amax=torch.tensor(2.0))  # e.g. the amax of a tensor sharded over ranks
    assert torch.equal(shared.tensor_scale, torch.tensor(2.0) / 2688.0)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even_e2m1(value: float) -> float:
    magnitude = min(abs(value), 6.0)
    index = min(range(8), key=lambda i: (abs(E2M1[i] - magnitude), i % 2))
    return math.copysign(E2M1[index], value)


def reference_nvfp4(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Python loops over blocks and elements, the formulas of the module docstring in fp32."""
    tensor_scale = x.abs().max() / 2688.0
    values = torch.zeros_like(x)
    for row in range(0, x.shape[0], block_rows):
        for col in range(0, x.shape[1], block_cols):
            block = x[row:row + block_rows, col:col + block_cols]
            block_scale = ((block.abs().max() / 6.0) / tensor_scale).to(torch.float8_e4m3fn).float()
            total = (block_scale * tensor_scale).item()
            if total == 0:
                continue
            scaled = (block / (block_scale * tensor_scale)).tolist()
            values[row:row + block_rows, col:col + block_cols] = torch.tensor(
                [[nearest_even_e2m1(v) * total for v in line] for line in scaled])
    return values


@pytest.mark.parametrize("block_rows, block_cols", [(1, 16), (16, 16)])
def test_random_tensors_match_a_block_by_block_reference(block_rows, block_cols):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 56, generator=generator) * torch.logspace(-4, 2, 56)
    quantized = quantize_nvfp4(x, block_rows, block_cols)
    assert torch.equal(quantized.values, reference_nvfp4(x, block_rows, block_cols))
    assert torch.equal(dequantize_nvfp4(quantized.codes, quantized.block_scales, quantized.tensor_scale,
                                        block_rows, block_cols), quantized.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_square_blocks_quantize_the_weight_and_its_transpose_alike(dtype):
    weight = (torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    weight[0, 5, 7] = 3.0  # an outlier
    blocks = quantize_nvfp4(weight, 16, 16)
    of_transpose = quantize_nvfp4(weight.transpose(-1, -2), 16, 16)
    assert blocks.values.dtype == dtype and blocks.block_scales.shape == (3, 3, 2)
    assert torch.equal(blocks.values.transpose(-1, -2), of_transpose.values)
    assert torch.equal(blocks.codes.transpose(-1, -2), of_transpose.codes)
    assert torch.equal(blocks.block_scales.transpose(-1, -2).float(), of_transpose.block_scales.float())
    # 1 x 16 blocks do not have this property
    assert not torch.equal(quantize_nvfp4(weight).values.transpose(-1, -2),
                           quantize_nvfp4(weight.transpose(-1, -2)).values)


def test_stochastic_rounding_is_unbiased_through_the_scales():
    # block amaxes 6 and s_tensor 1 (the last block holds 2688), so the scales are exact and only E2M1 rounds
    x = torch.rand(4, 16, generator=torch.Generator().manual_seed(2)) * 12 - 6
    x[:, 0] = 6.0
    x = torch.cat([x, torch.full((4, 16), 2688.0)], dim=1)
    draws = 4000
    generator = torch.Generator().manual_seed(3)
    rounded = quantize_nvfp4(x.expand(draws, -1, -1), rounding="stochastic", generator=generator).values
    assert torch.equal(quantize_nvfp4(x).block_scales.float()[:, 0], torch.ones(4))
    # every neighbour gap is at most 2, so a standard error is at most 1 / sqrt(draws)
    assert (rounded.double().mean(dim=0) - x).abs().max() < 5 / math.sqrt(draws)
    with pytest.raises(ValueError, match="torch.Generator"):
        quantize_nvfp4(x, rounding="stochastic")
