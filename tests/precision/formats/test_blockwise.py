"""blockwise.py: DeepSeek-V3 1 x 128 tiles and 128 x 128 blocks, scales checked by hand."""

import torch

from meshlm.precision.formats.blockwise import (dequantize_fp8_blockwise, quantize_fp8_blockwise, quantize_fp8_tiles,
                                                quantize_fp8_weight_blocks)
from meshlm.precision.formats.fp8 import E4M3, E5M2, quantize_fp8


def test_tile_scales_by_hand_with_a_zero_tile_and_a_partial_last_tile():
    x = torch.zeros(2, 130)
    x[0, :128] = 1.0
    x[0, 5] = 896.0                            # tile (0, 0): amax 896 -> 896 / 448 = 2
    x[0, 128:] = torch.tensor([0.5, -3.0])     # tile (0, 1), 2 elements: amax 3
    x[1, 128:] = torch.tensor([0.0, 448.0])    # tile (1, 0) all zero -> 1; tile (1, 1): 448 -> 1
    power_of_two = quantize_fp8_tiles(x)
    # 3 / 448 = 2^-7.22..., rounded up to 2^-7: 3 / 2^-7 = 384 fits, 3 / 2^-8 = 768 would not
    assert torch.equal(power_of_two.scales, torch.tensor([[2.0, 2.0 ** -7], [1.0, 1.0]]))
    assert torch.equal(power_of_two.values, x)  # every value here is exact at its tile's scale
    assert power_of_two.codes[0, 129].float() == -384.0
    plain = quantize_fp8_tiles(x, power_of_two=False)
    assert torch.equal(plain.scales, torch.tensor([[2.0, 3.0 / 448.0], [1.0, 1.0]]))
    assert plain.codes[0, 129].float() == -448.0


def test_weight_block_scales_by_hand():
    weight = torch.zeros(130, 260)
    weight[0, 0] = 1.0                         # block (0, 0): 1 / 448 -> 2^-8
    weight[5, 200] = 448.0 * 2.0 ** -20        # block (0, 1): exactly 2^-20
    weight[129, 259] = -1000.0                 # block (1, 2), partial in both dims: 1000 / 448 = 2.2 -> 4
    quantized = quantize_fp8_weight_blocks(weight)
    expected = torch.tensor([[2.0 ** -8, 2.0 ** -20, 1.0], [1.0, 1.0, 4.0]])
    assert torch.equal(quantized.scales, expected)
    assert quantized.values[129, 259] == -1024.0  # -1000 / 4 = -250, nearest E4M3 -256
    assert quantized.values[0, 0] == 1.0 and quantized.values[5, 200] == weight[5, 200]


def reference_blockwise(x: torch.Tensor, block_rows: int, block_cols: int, fmt) -> torch.Tensor:
    """Block by block with Python loops: smallest power of two that fits the block's amax (1 if zero)."""
    values = torch.empty_like(x)
    for row in range(0, x.shape[0], block_rows):
        for col in range(0, x.shape[1], block_cols):
            block = x[row:row + block_rows, col:col + block_cols]
            amax = block.abs().max().item()
            scale = 1.0
            if amax > 0:
                scale = 2.0 ** -127
                while amax / scale > fmt.max_value:
                    scale *= 2
            values[row:row + block_rows, col:col + block_cols] = quantize_fp8(block, scale, fmt).values
    return values


def test_random_tensors_match_a_block_by_block_reference():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(150, 300, generator=generator) * torch.logspace(-3, 3, 300)  # columns of different ranges
    for block_rows, block_cols, fmt in [(1, 128, E4M3), (128, 128, E4M3), (1, 128, E5M2)]:
        quantized = quantize_fp8_blockwise(x, block_rows, block_cols, fmt)
        assert torch.equal(quantized.values, reference_blockwise(x, block_rows, block_cols, fmt))


def test_a_square_block_quantizes_the_transpose_alike_but_a_tile_does_not():
    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, 300)
    blocks, blocks_of_transpose = quantize_fp8_weight_blocks(weight), quantize_fp8_weight_blocks(weight.T)
    assert torch.equal(blocks.values.T, blocks_of_transpose.values)
    assert torch.equal(blocks.scales.T, blocks_of_transpose.scales)
    assert not torch.equal(quantize_fp8_tiles(weight).values.T, quantize_fp8_tiles(weight.T).values)


def test_dequantize_and_dtypes_and_batch_dims():
    x = (torch.randn(2, 3, 130, generator=torch.Generator().manual_seed(2)) * 5).to(torch.bfloat16)
    tiles = quantize_fp8_tiles(x)
    assert tiles.values.dtype == torch.bfloat16 and tiles.scales.shape == (2, 3, 2)
    assert torch.equal(dequantize_fp8_blockwise(tiles.codes, tiles.scales, 1, 128, torch.bfloat16), tiles.values)
    blocks = quantize_fp8_weight_blocks(x, power_of_two=False)
    assert blocks.scales.shape == (2, 1, 2)
    assert torch.equal(dequantize_fp8_blockwise(blocks.codes, blocks.scales, 128, 128, torch.bfloat16),
                       blocks.values)
    vector = quantize_fp8_tiles(torch.randn(300))
    assert vector.scales.shape == (3,) and vector.values.shape == (300,)
