"""Normalization layers: RMSNorm, LayerNorm and Mamba-2's gated, grouped RMSNorm.

RMSNorm (Zhang & Sennrich 2019) rescales each vector by the root of its mean square, with no
mean subtraction and no bias: ``y = w * x / sqrt(mean(x^2) + eps)``. The statistics are taken
in fp32 whatever the input dtype, then the result is cast back, as Llama and Nemotron-H do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: ``RMSNorm(y * silu(z))`` with statistics per group of channels.

    The SSM output y is gated by the z branch *before* normalizing (``norm_before_gate=False``
    in mamba_ssm), and the mean square is taken over ``group_size`` channels at a time
    (d_inner / num_groups), so that each B/C group is normalized on its own -- which is what
    lets tensor parallelism split the norm along with the heads (Dao & Gu 2024, §8).
    """

    def __init__(self, size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        if size % group_size:
            raise ValueError(f"GatedRMSNorm: size {size} is not a multiple of group_size {group_size}")
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(gate.float())
        grouped = gated.unflatten(-1, (-1, self.group_size))
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed.flatten(-2)).to(y.dtype)


def make_norm(kind: str, size: int, eps: float) -> nn.Module:
    """The block/final norm chosen by ``ModelConfig.norm``."""
    if kind == "rmsnorm":
        return RMSNorm(size, eps)
    if kind == "layernorm":
        return nn.LayerNorm(size, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; use 'rmsnorm' or 'layernorm'")
