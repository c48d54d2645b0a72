"""Normalization layers: RMSNorm, LayerNorm and Mamba-2's gated, grouped RMSNorm.

RMSNorm (Zhang & Sennrich 2019) rescales each vector by the root of its mean square, with no
mean subtraction and no bias: ``y = w * x / sqrt(mean(x^2) + eps)``. The statistics are taken
in fp32 whatever the input dtype, then the result is cast back, as Llama and Nemotron-H do.

*Zero-centered* weights (``model.norm_zero_centered``; Gemma's norms, Megatron's
``layernorm_zero_centered_gamma``) store gamma - 1: ``y = (1 + w) * x / sqrt(mean(x^2) + eps)``,
the weights starting at 0. The function is the same; the parameter near 0 is what a checkpoint
holds (Gemma's bf16 weights keep their precision only this way: 1 + w in bf16 would round w to
2^-8) and what weight decay would pull towards 1 rather than 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.function_outputs import distinct_output


class RMSNorm(nn.Module):
    """``w * x / rms(x)``; zero-centered (``offset`` 1): ``(1 + w) * x / rms(x)``, w starting at 0."""

    def __init__(self, size: int, eps: float = 1e-5, zero_centered: bool = False):
        super().__init__()
        self.offset = 1.0 if zero_centered else 0.0
        self.weight = nn.Parameter(torch.full((size,), 1.0 - self.offset))
        self.eps = eps

    def init_rules(self, config) -> dict:
        return {"weight": lambda tensor, generator: tensor.fill_(1.0 - self.offset)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32 statistics; fp64 stays fp64
        x_wide = x.to(wide)
        normed = x_wide * torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight.to(wide)
        scale = weight + self.offset if self.offset else weight
        return (scale * normed).to(x.dtype)


class HeadNorm(nn.Module):
    """QK-norm over each head's channels: RMSNorm or LayerNorm of the last dim of [b, heads, t,
    head_dim], statistics in fp32, then a weight (and with ``bias`` a bias) that is one [head_dim]
    vector shared by the heads, or with ``heads`` one row per head, [heads, head_dim].

    Qwen3 and Gemma 3 share an RMSNorm weight (Yang et al. 2025; Gemma Team 2025); Phi's
    ``qk_layernorm`` shares a LayerNorm with a bias; StableLM 2 12B and Command R+ give every head
    a LayerNorm weight of its own, without a bias (Dehghani et al. 2023 introduced the QK LayerNorm
    to keep attention logits from growing without bound at scale). A per-head weight scales head h
    of x by row h: under tensor parallelism each rank holds the rows of its heads, or, where key
    heads are replicated over the ranks, the whole weight of which ``head_rows`` is what it reads.
    """

    def __init__(self, kind: str, head_dim: int, eps: float, heads: int | None = None, zero_centered: bool = False,
                 bias: bool = False):
        super().__init__()
        if kind not in ("rmsnorm", "layernorm"):
            raise ValueError(f"unknown QK-norm {kind!r}; use 'rmsnorm' or 'layernorm'")
        shape = (head_dim,) if heads is None else (heads, head_dim)
        self.kind, self.eps = kind, eps
        self.offset = 1.0 if zero_centered else 0.0
        self.weight = nn.Parameter(torch.full(shape, 1.0 - self.offset))
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None
        self.head_rows: slice | None = None
        """The rows of a per-head weight this module applies, in order, to x's heads (None: all)."""

    def init_rules(self, config) -> dict:
        return {"weight": lambda tensor, generator: tensor.fill_(1.0 - self.offset)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(x.dtype, torch.float32)  # fp32 statistics; fp64 stays fp64
        x_wide = x.to(wide)
        if self.kind == "layernorm":
            normed = F.layer_norm(x_wide, x.shape[-1:], eps=self.eps)
        else:
            normed = x_wide * torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.per_token(self.weight).to(wide)
        out = (weight + self.offset if self.offset else weight) * normed
        if self.bias is not None:
            out = out + self.per_token(self.bias).to(wide)
        return out.to(x.dtype)

    def per_token(self, tensor: torch.Tensor) -> torch.Tensor:
        """A weight or bias as it broadcasts over [b, heads, t, head_dim]: a per-head one as [heads, 1, head_dim]."""
        if tensor.dim() == 1:
            return tensor
        return (tensor if self.head_rows is None else tensor[self.head_rows]).unsqueeze(-2)

    def extra_repr(self) -> str:
        heads = "" if self.weight.dim() == 1 else f", {self.weight.shape[0]} heads"
        return f"{self.kind}, {self.weight.shape[-1]}{heads}, bias={self.bias is not None}"


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: ``RMSNorm(y * silu(z))`` with statistics per group of channels.

    The SSM output y is gated by the z branch *before* normalizing (``norm_before_gate=False``
    in mamba_ssm), and the mean square is taken over ``group_size`` channels at a time
    (d_inner / num_groups), so that each B/C group is normalized on its own -- which is what
    lets tensor parallelism split the norm along with the heads (Dao & Gu 2024, §8).

    ``skip`` and ``skip_scale`` add a scaled input to y first, Mamba-2's D skip: the norm of
    ``(y + skip_scale * skip) * silu(z)``, all in fp32, so that the mixer hands over its bf16
    tensors as they are instead of fp32 copies (``_SkipGatedRMSNorm``).
    """

    def __init__(self, size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        if size % group_size:
            raise ValueError(f"GatedRMSNorm: size {size} is not a multiple of group_size {group_size}")
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor, skip: torch.Tensor | None = None,
                skip_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The norm of ``(y [+ skip_scale * skip]) * silu(gate)`` over the last dimension, in
        ``out_dtype`` (default: y's). ``skip_scale`` [size] multiplies ``skip`` (y's shape) per channel."""
        if (skip is None) != (skip_scale is None):
            raise ValueError("GatedRMSNorm: give skip and skip_scale together")
        out_dtype = out_dtype or y.dtype
        if not torch.is_grad_enabled():  # generation: no backward to prepare for
            return gated_rms_norm(y, gate, self.weight, self.group_size, self.eps, skip, skip_scale).to(out_dtype)
        return _SkipGatedRMSNorm.apply(y, gate, skip, skip_scale, self.weight, self.group_size, self.eps, out_dtype)


class SiluGate(nn.Module):
    """``GatedRMSNorm``'s gate without the norm: ``(y [+ skip_scale * skip]) * silu(z)``, in fp32
    (``model.mamba_gated_norm=false``: Falcon-H1's Mamba mixers, ``mamba_rms_norm: false``, and the
    original Mamba-2 without its output norm). No parameters; the same call as ``GatedRMSNorm``."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor, skip: torch.Tensor | None = None,
                skip_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if (skip is None) != (skip_scale is None):
            raise ValueError("SiluGate: give skip and skip_scale together")
        summed = y.float() if skip is None else y.float() + skip_scale.float() * skip.float()
        return (summed * F.silu(gate.float())).to(out_dtype or y.dtype)


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float, skip: torch.Tensor | None = None, skip_scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``weight * RMSNorm_per_group((y + skip_scale * skip) * silu(gate))``, statistics in fp32 (fp64
    for fp64 inputs), in the wider of y's dtype and fp32 (the caller rounds)."""
    compute = torch.promote_types(y.dtype, torch.float32)
    summed = y.to(compute)
    if skip is not None:
        summed = summed + skip_scale.to(compute) * skip.to(compute)
    gated = summed * F.silu(gate.to(compute))
    grouped = gated.unflatten(-1, (-1, group_size))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(compute) * normed.flatten(-2)


class _SkipGatedRMSNorm(torch.autograd.Function):
    """``gated_rms_norm`` with a hand-written backward that recomputes from the inputs.

    Saved for backward: the inputs as they came (y, the gate and the skip in the run's dtype, the
    parameters) and the per-group 1/rms (one fp32 number per token and group). Every fp32
    intermediate -- y + D x, silu(z), their product, the normalized values -- is recomputed in
    backward (selective recomputation of cheap elementwise work, Korthikanti et al. 2022). Left to
    autograd, or to ``torch.compile``'s partitioner, the fp32 copies of the skip and the gate were
    kept between forward and backward: two fp32 tensors of the layer's inner width, four times
    the bytes of the bf16 inputs the layer holds anyway. With g = s * silu(z), s = y + c * x,
    n = g * r (r = 1/rms per group) and out = w * n, the gradients for dout are

        dw = sum_tokens dout * n,      dn = dout * w,     dg = r * (dn - n * mean_group(dn * n))
        ds = dg * silu(z),    dz = dg * s * silu'(z),   silu'(v) = sigmoid(v) (1 + v (1 - sigmoid(v)))
        dy = ds,    dx = c * ds,    dc = sum_tokens ds * x

    in fp32, each rounded once to its input's dtype; the sums over tokens accumulate in fp32.
    """

    @staticmethod
    def forward(ctx, y, gate, skip, skip_scale, weight, group_size, eps, out_dtype):
        compute = torch.promote_types(y.dtype, torch.float32)
        summed = y.to(compute)
        if skip is not None:
            summed = summed + skip_scale.to(compute) * skip.to(compute)
        grouped = (summed * F.silu(gate.to(compute))).unflatten(-1, (-1, group_size))
        inverse_rms = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
        if torch.compiler.is_compiling():
            # The gate is a slice of in_proj's output. Inductor cannot keep a slice for backward (it
            # recomputes views from their base) and weighs tensors far from the backward as dearer,
            # so it kept gate.float(), which forward and backward both compute: twice a bf16 copy's
            # bytes. A copy of the gate made here, beside the norm, is what it keeps instead (its
            # write fused into the norm's forward kernel, which reads the gate anyway).
            gate = gate.clone()
        ctx.save_for_backward(y, gate, skip, skip_scale, weight, inverse_rms)
        ctx.group_size = group_size
        # a tensor of its own under torch.compile: .to() is a no-op in an fp32 run (function_outputs.py)
        return distinct_output((weight.to(compute) * (grouped * inverse_rms).flatten(-2)).to(out_dtype))

    @staticmethod
    def backward(ctx, grad_out):
        y, gate, skip, skip_scale, weight, inverse_rms = ctx.saved_tensors
        compute = torch.promote_types(y.dtype, torch.float32)
        summed = y.to(compute)
        if skip is not None:
            summed = summed + skip_scale.to(compute) * skip.to(compute)
        gate32 = gate.to(compute)
        sigmoid = torch.sigmoid(gate32)
        silu = gate32 * sigmoid
        grouped = (summed * silu).unflatten(-1, (-1, ctx.group_size))
        normed = grouped * inverse_rms
        grad_out = grad_out.to(compute)
        reduced = tuple(range(grad_out.dim() - 1))  # every token
        grad_weight = (grad_out * normed.flatten(-2)).sum(reduced) if ctx.needs_input_grad[4] else None
        grad_normed = (grad_out * weight.to(compute)).unflatten(-1, (-1, ctx.group_size))
        grad_gated = inverse_rms * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        grad_gated = grad_gated.flatten(-2)
        grad_summed = grad_gated * silu
        grad_gate = grad_gated * summed * sigmoid * (1 + gate32 * (1 - sigmoid))
        grad_skip = grad_scale = None
        if skip is not None:
            if ctx.needs_input_grad[2]:
                grad_skip = (grad_summed * skip_scale.to(compute)).to(skip.dtype)
            if ctx.needs_input_grad[3]:
                grad_scale = (grad_summed * skip.to(compute)).sum(reduced).to(skip_scale.dtype)
        return (grad_summed.to(y.dtype), grad_gate.to(gate.dtype), grad_skip, grad_scale,
                None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None)


def model_norm(config, size: int | None = None) -> nn.Module:
    """The norm ``config`` (a ``ModelConfig``) asks for, over ``size`` channels (default hidden_size)."""
    return make_norm(config.norm, size or config.hidden_size, config.norm_eps, config.norm_zero_centered,
                     config.norm_bias)


def make_norm(kind: str, size: int, eps: float, zero_centered: bool = False, bias: bool = True) -> nn.Module:
    """The block/final norm chosen by ``ModelConfig.norm`` (zero-centered: RMSNorm only; ``bias``:
    LayerNorm's, ``model.norm_bias``)."""
    if kind == "rmsnorm":
        return RMSNorm(size, eps, zero_centered)
    if kind == "layernorm":
        return nn.LayerNorm(size, eps=eps, bias=bias)
    raise ValueError(f"unknown norm {kind!r}; use 'rmsnorm' or 'layernorm'")
