"""MXFP4 (OCP Microscaling formats v1.0): E2M1 elements sharing one E8M0 power-of-two scale per 32.

The format gpt-oss's released checkpoints store their experts in (``meshlm/hf/gpt_oss.py``). Each
row is cut into blocks of 32 values along the contraction (the input features of a weight
[out, in]); a block keeps one scale byte s, meaning 2^(s - 127) (E8M0: an exponent, no sign, no
mantissa; 255 is NaN), and 32 four-bit E2M1 codes (``e2m1.py``: magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6 and a sign bit). A value is ``decode_e2m1(code) * 2^(s - 127)``. Stored, two codes share a
byte, the first of the pair in the low nibble: ``blocks [..., G, 16]`` uint8 and ``scales [..., G]``
uint8 for a row of G * 32 values, as transformers' ``convert_moe_packed_tensors`` reads them.

**The scale.** Each block's is the smallest power of two that brings its largest magnitude within
E2M1's 6 (``scale = 2^ceil(log2(amax / 6))``, the rule ``mxfp8.py`` follows after "Recipes for
pre-training LLMs with MXFP8", 2025): nothing saturates. The OCP specification's own suggestion,
``2^(floor(log2 amax) - 2)``, can be half as large, keeping one more step of resolution for the
block's smaller values but clipping magnitudes between 6 and 8 times the scale to 6. An all-zero
block gets scale 1 (byte 127). Elements round to the nearest E2M1 magnitude, ties to the even
code, so each element's error is at most half a step: a quarter of the scale below magnitude 2
(steps of 0.5), half of it up to 4, a whole one up to 6.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshlm.precision.formats.e2m1 import E2M1_MAX, decode_e2m1, encode_e2m1
from meshlm.precision.formats.fp8 import power_of_two_scale

MXFP4_BLOCK_SIZE = 32
"""Values per E8M0 scale."""
E8M0_BIAS = 127
"""A scale byte s means 2^(s - 127)."""


class Mxfp4Quantized(NamedTuple):
    """``blocks [..., G, 16]`` (uint8, two E2M1 codes a byte, low nibble first) and ``scales [..., G]``
    (uint8 E8M0 bytes) of a tensor ``[..., G * 32]``."""

    blocks: torch.Tensor
    scales: torch.Tensor


def quantize_mxfp4(x: torch.Tensor) -> Mxfp4Quantized:
    """``x [..., cols]`` (``cols`` a multiple of 32) in MXFP4 blocks along its last dim (the module docstring)."""
    if x.shape[-1] % MXFP4_BLOCK_SIZE:
        raise ValueError(f"MXFP4 blocks are {MXFP4_BLOCK_SIZE} values along the last dim; got {x.shape[-1]} "
                         "values there, not a multiple of it.")
    grouped = x.float().unflatten(-1, (-1, MXFP4_BLOCK_SIZE))  # [..., G, 32]
    amax = grouped.abs().amax(-1)
    scale = torch.where(amax == 0, torch.ones_like(amax), power_of_two_scale(amax, E2M1_MAX))
    codes = encode_e2m1(grouped / scale.unsqueeze(-1))  # within [-6, 6]: nothing saturates
    scale_bytes = (torch.log2(scale).round().to(torch.int32) + E8M0_BIAS).to(torch.uint8)
    return Mxfp4Quantized(codes[..., 0::2] | (codes[..., 1::2] << 4), scale_bytes)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 ``blocks`` [..., G, 16] (uint8, two FP4 codes per byte, low nibble first) with ``scales``
    [..., G] (E8M0 bytes) -> [..., G * 32] values in ``dtype`` (the module docstring); bit for bit
    transformers' ``convert_moe_packed_tensors``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} must be uint8, the scales one per block")
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)  # [..., G, 16, 2]: low nibble first
    values = decode_e2m1(codes).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents[..., None].to(torch.float32)).flatten(-2).to(dtype)


__all__ = ["E8M0_BIAS", "MXFP4_BLOCK_SIZE", "Mxfp4Quantized", "dequantize_mxfp4", "quantize_mxfp4"]
