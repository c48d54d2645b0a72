"""NVFP4: E2M1 values in blocks of 16, an E4M3 scale per block and an fp32 scale per tensor.

"Pretraining LLMs with NVFP4" (NVIDIA, 2025; docs/references.md, "Precision"). An element is

    value = e2m1 x s_block x s_tensor.

Four-bit E2M1 (``e2m1.py``) spans only 0.5 .. 6, so a scale per 16 elements does most of the work.
That scale is itself an E4M3 number (range 2^-9 .. 448), too narrow for a whole tensor's range of
block amaxes, hence a second, fp32 scale per tensor that maps the tensor's amax onto the largest
block scale times the largest element:

    s_tensor = amax(tensor) / (448 * 6)
    s_block  = e4m3( (amax(block) / 6) / s_tensor )           (round-to-nearest-even, saturating)
    code     = e2m1( x / (s_block * s_tensor) )

Rounding choices (our reading of the formulas, not checked against a hardware kernel):

- The block scale is computed and rounded exactly as written, in fp32. Because E4M3 rounds to
  nearest, ``s_block`` can land slightly *below* ``amax(block) / 6 / s_tensor`` and the block's
  largest element then saturates to 6 (error at most one E4M3 rounding step, 1/16 relative).
  Transformer Engine multiplies by reciprocals (``448 * 6 / amax``) instead of dividing; the
  scaled values can then differ from ours in the last fp32 bit, which can flip an exact E2M1 tie.
- A block whose scale underflows E4M3 to zero (all zeros, or amax below about 2e-6 of the
  tensor's) quantizes to zeros: hardware multiplies every element by the zero scale anyway.
- An all-zero tensor gets ``s_tensor = 1``.

Weights use **16 x 16 2D blocks** (``block_rows=16``): a square block has the same amax whether
the weight or its transpose is cut into blocks, so ``W`` and ``W^T`` quantize to exactly
transposed results and the forward ``X W^T`` and backward ``dY W`` GEMMs see the same weight.
Activations and gradients use 1 x 16 blocks along the last (GEMM-reduction) dim. Gradients use
stochastic rounding, everything else nearest-even. Partial last blocks are ragged (``blocks.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshlm.precision.formats.blocks import block_amax, block_grid, expand_grid, from_blocks, to_blocks
from meshlm.precision.formats.e2m1 import E2M1_MAX, Rounding, decode_e2m1, encode_e2m1
from meshlm.precision.formats.fp8 import E4M3
from meshlm.precision.formats.hashed_noise import hashed_uniform

NVFP4_BLOCK_SIZE = 16


class NVFP4Quantized(NamedTuple):
    """A tensor after NVFP4 quantization."""

    values: torch.Tensor
    """Dequantized ``e2m1 * s_block * s_tensor``, in the input's dtype and shape."""
    codes: torch.Tensor
    """E2M1 codes (``uint8``, one per element, unpacked), the input's shape."""
    block_scales: torch.Tensor
    """``float8_e4m3fn`` ``[..., ceil(rows / block_rows), ceil(cols / block_cols)]``."""
    tensor_scale: torch.Tensor
    """0-dim fp32."""


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / (448 * 6)`` in fp32 (0-dim); an amax of zero gives 1."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax == 0, torch.ones_like(amax), amax / (E4M3.max_value * E2M1_MAX))


def nvfp4_block_scales(amax_per_block: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """``e4m3((amax_per_block / 6) / tensor_scale)``: fp32 amaxes of any shape -> ``float8_e4m3fn``, same shape."""
    block_scale = (amax_per_block.float() / E2M1_MAX) / tensor_scale
    return block_scale.clamp(max=E4M3.max_value).to(E4M3.dtype)


def quantize_nvfp4(x: torch.Tensor, block_rows: int = 1, block_cols: int = NVFP4_BLOCK_SIZE,
                   rounding: Rounding = "nearest", generator: torch.Generator | None = None,
                   tensor_amax: torch.Tensor | None = None, noise_key: int | None = None) -> NVFP4Quantized:
    """Quantize ``x [..., rows, cols]`` (or ``[cols]`` for 1 x n blocks) to NVFP4.

    ``block_rows=1`` (default): 1 x 16 blocks for activations and gradients; ``block_rows=16``:
    16 x 16 blocks for weights. ``rounding="stochastic"`` (gradients) needs ``noise_key`` (the
    random numbers are then hashed from it, each element's place in its block and its scaled
    value: ``hashed_noise.py``, the same in any layout) or a ``generator`` to draw them from.
    ``tensor_amax`` overrides ``amax(|x|)`` for the tensor scale, e.g. an amax reduced over the
    ranks that hold shards of one tensor, so that every shard uses the same ``s_tensor``.
    """
    blocks = to_blocks(x.float(), block_rows, block_cols)
    amax = blocks.abs().amax() if tensor_amax is None else tensor_amax
    tensor_scale = nvfp4_tensor_scale(amax).to(x.device)
    block_scales = nvfp4_block_scales(block_amax(blocks), tensor_scale)
    total_scale = block_scales.float() * tensor_scale
    scaled = torch.where(total_scale > 0, blocks / total_scale, torch.zeros_like(blocks))
    uniform = None
    if rounding == "stochastic" and noise_key is not None:
        block_rows_, block_cols_ = blocks.shape[-3], blocks.shape[-1]
        places = torch.arange(block_rows_ * block_cols_, device=x.device).view(block_rows_, 1, block_cols_)
        uniform = hashed_uniform(scaled, places, noise_key)
    codes = encode_e2m1(scaled, rounding, generator, uniform)
    values = decode_e2m1(codes) * total_scale
    return NVFP4Quantized(from_blocks(values, x.shape).to(x.dtype), from_blocks(codes, x.shape),
                          block_grid(block_scales, x.dim()), tensor_scale)


def dequantize_nvfp4(codes: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor,
                     block_rows: int = 1, block_cols: int = NVFP4_BLOCK_SIZE,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e2m1(codes) * s_block * s_tensor``; ``codes [..., rows, cols]``, scales as from ``quantize_nvfp4``."""
    total_scale = expand_grid(block_scales.float(), codes.dim()) * tensor_scale.float()
    blocks = decode_e2m1(to_blocks(codes, block_rows, block_cols)) * total_scale
    return from_blocks(blocks, codes.shape).to(dtype)
