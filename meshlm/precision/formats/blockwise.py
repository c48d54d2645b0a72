"""DeepSeek-V3's blockwise FP8: one fp32 scale per 1 x 128 tile or per 128 x 128 block.

A single per-tensor scale lets one outlier squeeze every other value of the tensor towards
FP8's underflow. DeepSeek-V3 (2024, §3.3.2 "fine-grained quantization") scales small groups
instead: activations and gradients per **1 x 128 tile** (one token, 128 channels), weights per
**128 x 128 block** (128 output x 128 input channels). Every group gets
``scale = amax(group) / 448`` in fp32 -- rounded up to a power of two by default, so the
dequantizing multiply is exact -- and E4M3 for all tensors (gradients too: small groups make
E5M2's range unnecessary).

A 128 x 128 block is square, so the quantized weight transposed *is* the quantized transposed
weight (the backward pass's ``W^T`` needs no re-quantization). A 1 x 128 tile is not: the
transpose of a tiled activation groups values along the other dimension, and must be quantized
again from the high-precision tensor.

Partial groups at the end of a dimension are ragged (``blocks.py``): the last tile of a row of
130 channels holds 2 values and has its own amax and scale. Scales have shape
``[..., rows, ceil(cols / 128)]`` for tiles and ``[..., ceil(rows / 128), ceil(cols / 128)]`` for
blocks.
"""

from __future__ import annotations

import torch

from meshlm.precision.formats.blocks import block_amax, block_grid, expand_grid, from_blocks, to_blocks
from meshlm.precision.formats.fp8 import E4M3, FP8Format, FP8Quantized, quantize_fp8, scale_from_amax

TILE_SIZE = 128
"""Length of an activation / gradient tile (1 x 128) and side of a weight block (128 x 128)."""


def quantize_fp8_blockwise(x: torch.Tensor, block_rows: int, block_cols: int, fmt: FP8Format = E4M3,
                           power_of_two: bool = True) -> FP8Quantized:
    """Quantize ``x [..., rows, cols]`` with one scale per ``block_rows x block_cols`` block.

    Returns values (``x.dtype``) and codes in ``x``'s shape, and fp32 scales
    ``[..., ceil(rows / block_rows), ceil(cols / block_cols)]`` (``[ceil(cols / block_cols)]`` for
    a 1-D ``x`` with ``block_rows == 1``). An all-zero block gets scale 1.
    """
    blocks = to_blocks(x.float(), block_rows, block_cols)
    scales = scale_from_amax(block_amax(blocks), fmt, power_of_two)
    quantized = quantize_fp8(blocks, scales, fmt)
    return FP8Quantized(from_blocks(quantized.values, x.shape).to(x.dtype),
                        from_blocks(quantized.codes, x.shape), block_grid(scales, x.dim()))


def dequantize_fp8_blockwise(codes: torch.Tensor, scales: torch.Tensor, block_rows: int, block_cols: int,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes [..., rows, cols]`` times their block's scale (``scales`` as returned above), in ``dtype``."""
    blocks = to_blocks(codes.float(), block_rows, block_cols) * expand_grid(scales.float(), codes.dim())
    return from_blocks(blocks, codes.shape).to(dtype)


def quantize_fp8_tiles(x: torch.Tensor, fmt: FP8Format = E4M3, power_of_two: bool = True,
                       tile_size: int = TILE_SIZE) -> FP8Quantized:
    """Activations and gradients: 1 x ``tile_size`` tiles along the last dim; scales ``[..., ceil(cols / tile)]``."""
    return quantize_fp8_blockwise(x, 1, tile_size, fmt, power_of_two)


def quantize_fp8_weight_blocks(weight: torch.Tensor, fmt: FP8Format = E4M3, power_of_two: bool = True,
                               block_size: int = TILE_SIZE) -> FP8Quantized:
    """Weights ``[..., out, in]``: square ``block_size`` blocks; scales ``[..., ceil(out / b), ceil(in / b)]``."""
    return quantize_fp8_blockwise(weight, block_size, block_size, fmt, power_of_two)
