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
        return _GatedRMSNormFunction.apply(y, gate, self.weight, self.group_size, self.eps)


class _GatedRMSNormFunction(torch.autograd.Function):
    """``w * RMSNorm_per_group(y * silu(z))`` in fp32 (fp64 for fp64 inputs), with a hand-written backward that saves only
    y, z and the per-group 1/rms (autograd would keep four full-size fp32 intermediates).

    With g = y * silu(z), r = 1/sqrt(mean(g^2) + eps) per group and n = g r:
    dn = dout * w, dw = sum(dout * n), dg = r (dn - n * mean(dn * n)) (the RMSNorm backward),
    dy = dg * silu(z), dz = dg * y * silu'(z) with silu'(v) = sigmoid(v) (1 + v (1 - sigmoid(v))).
    """

    @staticmethod
    def forward(ctx, y, gate, weight, group_size, eps):
        compute = torch.promote_types(y.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
        gated = y.to(compute) * F.silu(gate.to(compute))
        grouped = gated.unflatten(-1, (-1, group_size))
        inverse_rms = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(y, gate, weight, inverse_rms)
        ctx.group_size = group_size
        return (weight.to(compute) * (grouped * inverse_rms).flatten(-2)).to(y.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        y, gate, weight, inverse_rms = ctx.saved_tensors
        compute = inverse_rms.dtype
        gate32 = gate.to(compute)
        sigmoid = torch.sigmoid(gate32)
        silu = gate32 * sigmoid
        normed = (y.to(compute) * silu).unflatten(-1, (-1, ctx.group_size)).mul_(inverse_rms)
        grad_normed = (grad_out.to(compute) * weight.to(compute)).unflatten(-1, (-1, ctx.group_size))
        grad_weight = (grad_out.to(compute) * normed.flatten(-2)).flatten(0, -2).sum(0)
        grad_gated = (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True)).mul_(inverse_rms).flatten(-2)
        grad_y = grad_gated * silu
        grad_gate = grad_gated.mul_(y.to(compute)).mul_(sigmoid.mul_(1 + gate32 * (1 - sigmoid)))
        return grad_y.to(y.dtype), grad_gate.to(gate.dtype), grad_weight.to(weight.dtype), None, None


def make_norm(kind: str, size: int, eps: float) -> nn.Module:
    """The block/final norm chosen by ``ModelConfig.norm``."""
    if kind == "rmsnorm":
        return RMSNorm(size, eps)
    if kind == "layernorm":
        return nn.LayerNorm(size, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; use 'rmsnorm' or 'layernorm'")
