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
        # Generation needs no backward. Under torch.compile the plain ops are what to trace: a custom
        # Function whose backward runs autograd cannot be traced (dynamo breaks the block's graph
        # there), and the compiler's own partitioner recomputes such cheap elementwise ops anyway.
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return gated_rms_norm(y, gate, self.weight, self.group_size, self.eps)
        return _RecomputedGatedRMSNorm.apply(y, gate, self.weight, self.group_size, self.eps)


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float) -> torch.Tensor:
    """``weight * RMSNorm_per_group(y * silu(gate))``, statistics in fp32 (fp64 for fp64 inputs)."""
    compute = torch.promote_types(y.dtype, torch.float32)
    gated = y.to(compute) * F.silu(gate.to(compute))
    grouped = gated.unflatten(-1, (-1, group_size))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(compute) * normed.flatten(-2)).to(y.dtype)


class _RecomputedGatedRMSNorm(torch.autograd.Function):
    """``gated_rms_norm`` that saves only its inputs and recomputes itself in backward.

    Autograd would keep four full-size fp32 intermediates (silu(z), the gated product, the
    normalized values and more) between forward and backward; this keeps y and z, which the
    layer holds anyway, and reruns the few elementwise ops under autograd in backward (selective
    recomputation of cheap ops, Korthikanti et al. 2022), so the gradients are exactly autograd's.
    """

    @staticmethod
    def forward(ctx, y, gate, weight, group_size, eps):
        ctx.save_for_backward(y, gate, weight)
        ctx.group_size, ctx.eps = group_size, eps
        return gated_rms_norm(y, gate, weight, group_size, eps)

    @staticmethod
    def backward(ctx, grad_out):
        y, gate, weight = (tensor.detach().requires_grad_(tensor.requires_grad) for tensor in ctx.saved_tensors)
        with torch.enable_grad():
            out = gated_rms_norm(y, gate, weight, ctx.group_size, ctx.eps)
        inputs = [tensor for tensor in (y, gate, weight) if tensor.requires_grad]
        grads = iter(torch.autograd.grad(out, inputs, grad_out))
        return tuple(next(grads) if tensor.requires_grad else None for tensor in (y, gate, weight)) + (None, None)


def make_norm(kind: str, size: int, eps: float) -> nn.Module:
    """The block/final norm chosen by ``ModelConfig.norm``."""
    if kind == "rmsnorm":
        return RMSNorm(size, eps)
    if kind == "layernorm":
        return nn.LayerNorm(size, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; use 'rmsnorm' or 'layernorm'")
