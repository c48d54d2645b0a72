"""The 16 x 16 random Hadamard transform that NVFP4 applies to both inputs of the weight-gradient GEMM.

Why: the weight gradient ``dW = dY^T X`` reduces over tokens, and a few tokens with outlier
values make a 1 x 16 block's amax large, crushing that block's other values towards zero. An
orthogonal ``Q`` applied to both operands along the reduction dim changes nothing in exact
arithmetic -- ``(Q^T dY)^T (Q^T X) = dY^T Q Q^T X = dY^T X`` -- but it mixes every 16 values
together, spreading an outlier over the block so its amax says less about any single value.
("Pretraining LLMs with NVFP4", 2025; docs/references.md, "Precision".)

The matrix: Sylvester's Hadamard matrix, ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``,
divided by ``sqrt(n)`` so that ``H H^T = I`` (for n = 16 every entry is +-1/4 and the identity
comes out exactly in fp32), times one fixed random sign per row: ``Q = diag(s) H``, still
orthogonal. The signs are drawn once from a seeded ``torch.Generator`` and stay the same for the
whole run (the recipe uses one fixed sign vector); without them the first output of every block
would be the plain block mean, the same structured mixing for every tensor.

``apply_blockwise(x, Q, dim)`` cuts ``dim`` into consecutive groups of 16 and maps each group
``g`` (as a row vector) to ``g Q``, i.e. ``x -> B^T x`` along ``dim`` for the block-diagonal
``B = diag(Q, Q, ...)``; the inverse is ``apply_blockwise(y, Q^T, dim)``.
"""

from __future__ import annotations

import math

import torch

HADAMARD_SIZE = 16
DEFAULT_SIGN_SEED = 0
"""Seed of the fixed sign vector; any fixed value works, as long as it never changes mid-run."""


def hadamard_matrix(size: int = HADAMARD_SIZE, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Sylvester's Hadamard matrix ``[size, size]`` over ``sqrt(size)`` (orthogonal, symmetric); size a power of 2."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {size}.")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], dim=1), torch.cat([matrix, -matrix], dim=1)], dim=0)
    return (matrix / math.sqrt(size)).to(dtype=dtype, device=device)


def random_signs(size: int = HADAMARD_SIZE, seed: int = DEFAULT_SIGN_SEED) -> torch.Tensor:
    """``[size]`` fp32 of +-1, drawn from ``torch.Generator().manual_seed(seed)`` (CPU, global RNG untouched)."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (size,), generator=generator)
    return (1 - 2 * bits).float()


def random_hadamard_matrix(size: int = HADAMARD_SIZE, seed: int = DEFAULT_SIGN_SEED,
                           dtype: torch.dtype = torch.float32,
                           device: torch.device | str | None = None) -> torch.Tensor:
    """``diag(random_signs(size, seed)) @ hadamard_matrix(size)``: ``[size, size]``, orthogonal."""
    signs = random_signs(size, seed).to(torch.float64)
    return (signs[:, None] * hadamard_matrix(size, torch.float64)).to(dtype=dtype, device=device)


def apply_blockwise(x: torch.Tensor, matrix: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Map every group of ``n = matrix.shape[0]`` consecutive entries along ``dim`` to ``group @ matrix``.

    ``x`` any shape with ``x.shape[dim]`` a multiple of n; computed in fp32 (fp64 stays fp64) and
    returned in ``x.dtype``, same shape.
    """
    size = matrix.shape[0]
    length = x.shape[dim]
    if length % size:
        raise ValueError(f"the Hadamard transform works on groups of {size}, but dim {dim} has length "
                         f"{length}; pad it to a multiple of {size}.")
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    moved = x.to(compute_dtype).movedim(dim, -1)
    groups = moved.reshape(*moved.shape[:-1], length // size, size)
    mixed = groups @ matrix.to(device=x.device, dtype=compute_dtype)
    return mixed.reshape(moved.shape).movedim(-1, dim).to(x.dtype)
