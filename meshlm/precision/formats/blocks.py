"""Cutting a tensor into scaling blocks and putting it back together.

Every block-scaled format here shares one scale among a small rectangle of elements: a 1 x 128
tile (DeepSeek-V3 activations), a 128 x 128 block (DeepSeek-V3 weights), a 1 x 32 block (MXFP8),
a 1 x 16 or 16 x 16 block (NVFP4). The rectangle always tiles the last two dimensions of the
tensor, ``[..., rows, cols]``; a 1 x n tile only needs the last one, so a 1-D tensor is fine there.

Partial blocks at the end of a dimension are *ragged*: the last block holds only the elements
that exist and its amax is theirs. We implement that by padding with zeros -- a zero never changes
an amax, quantizes to zero and is cut away again by ``from_blocks`` -- so the result is the same
as quantizing the short block on its own.

Shapes, with ``R = ceil(rows / block_rows)`` and ``C = ceil(cols / block_cols)``:

- ``to_blocks(x [..., rows, cols])`` -> ``[..., R, block_rows, C, block_cols]``;
- per-block statistics reduce dims ``(-3, -1)`` with ``keepdim=True`` -> ``[..., R, 1, C, 1]``;
- ``block_grid(...)`` drops the kept singleton dims -> ``[..., R, C]``, the shape scales are
  returned in (for a 1 x n tile, ``R == rows``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def to_blocks(x: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """``x [..., rows, cols]`` -> ``[..., R, block_rows, C, block_cols]``, zero-padded at the ends.

    A tensor with one dimension is accepted when ``block_rows == 1`` and treated as one row:
    ``[cols]`` -> ``[1, 1, C, block_cols]``.
    """
    if block_rows < 1 or block_cols < 1:
        raise ValueError(f"block shape must be positive, got {block_rows} x {block_cols}.")
    if x.dim() == 1 and block_rows == 1:
        return to_blocks(x.unsqueeze(0), 1, block_cols)
    if x.dim() < 2:
        raise ValueError(f"a {block_rows} x {block_cols} block needs a tensor with at least 2 dimensions, "
                         f"got shape {tuple(x.shape)}.")
    rows, cols = x.shape[-2:]
    pad_rows, pad_cols = -rows % block_rows, -cols % block_cols
    if pad_rows or pad_cols:
        x = F.pad(x, (0, pad_cols, 0, pad_rows))
    grid_rows, grid_cols = (rows + pad_rows) // block_rows, (cols + pad_cols) // block_cols
    return x.reshape(*x.shape[:-2], grid_rows, block_rows, grid_cols, block_cols)


def from_blocks(blocks: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``to_blocks``: ``[..., R, block_rows, C, block_cols]`` -> ``shape`` (padding cut off)."""
    if len(shape) == 1:
        return from_blocks(blocks, (1, *shape)).squeeze(0)
    grid_rows, block_rows, grid_cols, block_cols = blocks.shape[-4:]
    full = blocks.reshape(*blocks.shape[:-4], grid_rows * block_rows, grid_cols * block_cols)
    return full[..., : shape[-2], : shape[-1]].contiguous()


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Largest magnitude per block: ``[..., R, block_rows, C, block_cols]`` -> ``[..., R, 1, C, 1]`` (fp32)."""
    return blocks.float().abs().amax(dim=(-3, -1), keepdim=True)


def block_grid(per_block: torch.Tensor, input_dims: int) -> torch.Tensor:
    """``[..., R, 1, C, 1]`` -> ``[..., R, C]`` (or ``[C]`` for a 1-D input): the shape scales are returned in."""
    grid = per_block.squeeze(-1).squeeze(-2)
    return grid.squeeze(-2) if input_dims == 1 else grid


def expand_grid(grid: torch.Tensor, input_dims: int) -> torch.Tensor:
    """Inverse of ``block_grid``: ``[..., R, C]`` -> ``[..., R, 1, C, 1]``, ready to broadcast over blocks."""
    if input_dims == 1:
        grid = grid.unsqueeze(-2)
    return grid.unsqueeze(-1).unsqueeze(-3)
