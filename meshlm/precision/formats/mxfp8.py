"""MXFP8 (OCP Microscaling formats v1.0): FP8 elements sharing one E8M0 power-of-two scale per 32.

Every 32 consecutive elements along the last dimension form a block with one 8-bit scale that
is a pure power of two: E8M0 has 8 exponent bits and no sign or mantissa, code ``c`` means
``2^(c - 127)`` (code 255 is NaN). Hardware (Blackwell tensor cores) reads the scales directly,
so the blocks are small enough to need no per-tensor scale at all.

The exponent follows NVIDIA's MXFP8 training recipe (Mishra et al. 2025, "Recipes for
pre-training LLMs with MXFP8"; docs/references.md, "Precision"): ``scale = 2^ceil(log2(amax / 448))``,
the smallest power of two that maps the block's amax into E4M3's range, so no element saturates.
The OCP spec's own suggestion, ``2^(floor(log2 amax) - 8)``, can be up to 2x smaller and
saturates blocks whose amax lies in (448, 512) x 2^k; we do not use it.

An all-zero block gets scale 1 (code 127); amax below 448 x 2^-127 gets the smallest scale,
2^-127 (code 0). A partial last block (cols not a multiple of 32) is ragged, see ``blocks.py``.
Elements are E4M3 by default; E5M2 (largest 57344) is the spec's other FP8 element type.
"""

from __future__ import annotations

import torch

from meshlm.precision.formats.blocks import block_amax, block_grid, expand_grid, from_blocks, to_blocks
from meshlm.precision.formats.fp8 import E4M3, FP8Format, FP8Quantized, power_of_two_scale, quantize_fp8

MX_BLOCK_SIZE = 32
E8M0 = torch.float8_e8m0fnu
"""PyTorch's dtype for the E8M0 scale: the byte is the biased exponent (``.view(torch.uint8)``)."""


def e8m0_scales(amax: torch.Tensor, fmt: FP8Format = E4M3) -> torch.Tensor:
    """Per-block amax (fp32, any shape) -> E8M0 scales ``2^ceil(log2(amax / fmt.max_value))``, zero amax -> 1."""
    scale = power_of_two_scale(amax, fmt.max_value)
    return torch.where(amax == 0, torch.ones_like(scale), scale).to(E8M0)


def quantize_mxfp8(x: torch.Tensor, fmt: FP8Format = E4M3, block_size: int = MX_BLOCK_SIZE) -> FP8Quantized:
    """Quantize ``x [..., cols]`` in 1 x ``block_size`` blocks along the last dim.

    Returns values (``x.dtype``) and FP8 codes in ``x``'s shape, and E8M0 scales
    ``[..., ceil(cols / block_size)]`` (dtype ``float8_e8m0fnu``).
    """
    blocks = to_blocks(x.float(), 1, block_size)
    scales = e8m0_scales(block_amax(blocks), fmt)
    quantized = quantize_fp8(blocks, scales.float(), fmt)
    return FP8Quantized(from_blocks(quantized.values, x.shape).to(x.dtype),
                        from_blocks(quantized.codes, x.shape), block_grid(scales, x.dim()))


def dequantize_mxfp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block_size: int = MX_BLOCK_SIZE) -> torch.Tensor:
    """``codes [..., cols]`` times their block's E8M0 scale (``[..., ceil(cols / block_size)]``), in ``dtype``."""
    blocks = to_blocks(codes.float(), 1, block_size) * expand_grid(scales.float(), codes.dim())
    return from_blocks(blocks, codes.shape).to(dtype)
