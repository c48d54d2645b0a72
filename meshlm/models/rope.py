"""Rotary position embedding (RoPE, Su et al. 2021), and its scalings for longer contexts.

Each pair of channels (i, i + d/2) of a query or key at position p is rotated by the angle
``p * f_i`` with f_i = theta ** (-2i/d), so the dot product of a query at p and a key at p'
depends on p - p' only. The "rotate half" layout (pairs are i and i + d/2, not 2i and 2i+1)
matches Llama and the Hugging Face checkpoints. Positions are explicit tensors, so left-padded
batches, cached decoding and context-parallel chunks all pass their own *global* positions.

**Scaling** (``model.rope_scaling``): a model pretrained at context L reads s times longer
sequences when its frequencies are stretched, once, before any rotation (the positions stay
the integers they are; only f_i changes):

- ``linear`` (position interpolation, Chen et al. 2023): every f_i / s.
- ``llama3`` (Llama 3.1, Meta 2024): with wavelength w_i = 2 pi / f_i, dims whose wavelength is
  longer than L / low_freq_factor are divided by s, those shorter than L / high_freq_factor keep
  f_i, and in between f_i is blended, (1 - t) f_i / s + t f_i with t = (L / w_i - low) / (high - low).
- ``yarn`` (Peng et al. 2023, "YaRN: efficient context window extension"): "NTK-by-parts". Dim i
  turns r_i = L f_i / (2 pi) times over the original context; dims turning more than beta_fast
  times keep f_i (extrapolate), those turning fewer than beta_slow are divided by s
  (interpolate), with a linear ramp over the dims between (the ramp's ends rounded outwards to
  whole dims unless ``rope_yarn_truncate=false``). Stretched low frequencies flatten the
  attention distribution, so YaRN multiplies cos and sin by an attention factor, by default
  0.1 ln(s) + 1 (the logits by its square).
- ``longrope`` (Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million
  Tokens"; Phi-3.5, Phi-4-mini): each f_i is divided by a factor of its own, found by search --
  ``rope_short_factors`` while the sequence fits the original context L, ``rope_long_factors``
  once its largest position reaches L -- and cos and sin are multiplied by
  sqrt(1 + ln(s) / ln(L)). The choice is per forward, by the largest position it rotates, as
  transformers makes it: a sequence that grows past L is rotated anew, all of it, with the long
  factors (generation runs it again then: ``inference/generate.longrope_crossing``). Both sets
  are computed and one picked on the device (``torch.where``), so the choice costs no host sync
  and a compiled graph holds both.

**Partial rotary** (``model.rope_fraction`` f): only the first d = int(f head_dim) channels of each
head are rotated, with the frequencies of a d-channel head (pairs (i, i + d/2) of them); the other
channels carry no position (GPT-NeoX, Phi-4-mini; transformers' ``partial_rotary_factor``).

These are the formulas of the Hugging Face configurations (``rope_type`` 'linear', 'llama3',
'yarn', 'longrope'), so converted checkpoints keep their logits (tests/hf). NTK-aware "dynamic" scaling,
which changes with the sequence length at inference, is not built.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """``model.rope_scaling`` and its parameters (``ModelConfig`` fields of the same names)."""

    kind: str = "none"
    factor: float = 1.0
    original_max_positions: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    yarn_truncate: bool = True
    short_factors: tuple[float, ...] | None = None
    long_factors: tuple[float, ...] | None = None

    @staticmethod
    def from_config(config) -> "RopeScaling":
        short, long = config.rope_short_factors, config.rope_long_factors
        return RopeScaling(config.rope_scaling, config.rope_scaling_factor, config.rope_original_max_positions,
                           config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_beta_fast,
                           config.rope_beta_slow, config.rope_attention_factor, config.rope_yarn_truncate,
                           None if short is None else tuple(float(factor) for factor in short),
                           None if long is None else tuple(float(factor) for factor in long))


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling(),
                     device: torch.device | None = None, long: bool = False) -> tuple[torch.Tensor, float]:
    """(f_i for i < head_dim / 2 in fp32 on ``device``, the factor on cos and sin): see the module
    docstring; ``long``: LongRoPE's long factors rather than its short ones."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling.kind == "linear":
        return base / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return llama3_frequencies(base, scaling), 1.0
    if scaling.kind == "yarn":
        return yarn_frequencies(base, head_dim, theta, scaling), yarn_attention_factor(scaling)
    if scaling.kind == "longrope":
        factors = torch.tensor(scaling.long_factors if long else scaling.short_factors, device=device)
        return base / factors, longrope_attention_factor(scaling)
    return base, 1.0


def llama3_frequencies(base: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    wavelength = 2 * math.pi / base
    context, low, high = scaling.original_max_positions, scaling.low_freq_factor, scaling.high_freq_factor
    blend = (context / wavelength - low) / (high - low)  # between the two: 0 long wavelengths, 1 short ones
    blended = (1 - blend) * base / scaling.factor + blend * base
    return torch.where(wavelength < context / high, base, torch.where(wavelength > context / low,
                                                                       base / scaling.factor, blended))


def yarn_frequencies(base: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    def dim_turning(rotations: float) -> float:
        """The (fractional) dim index whose frequency turns ``rotations`` times over the original context."""
        return head_dim * math.log(scaling.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    first, last = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
    if scaling.yarn_truncate:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, head_dim - 1)
    if first == last:
        last += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, device=base.device).float() - first) / (last - first)).clamp(0, 1)
    return base / scaling.factor * ramp + base * (1 - ramp)  # ramp 0: extrapolate (keep), 1: interpolate


def yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def longrope_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_positions))


class RotaryEmbedding(nn.Module):
    """Holds no tensors: the frequencies are recomputed per call (a few hundred flops), so the
    module is the same on any device, including the meta device used to build large models."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.table_key = (head_dim, theta, *dataclasses.astuple(scaling))
        """Plain numbers naming the table (``SequenceContext.rotary_cos_sin``): every attention block
        with the same sizes shares one, and a compiled block's guard compares values, not objects."""

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [batch, seq, head_dim] (fp32) for integer positions [batch, seq]."""
        frequencies, factor = rope_frequencies(self.head_dim, self.theta, self.scaling, position_ids.device)
        if self.scaling.kind == "longrope":  # the long factors once the sequence passes the original context
            long, _ = rope_frequencies(self.head_dim, self.theta, self.scaling, position_ids.device, long=True)
            frequencies = torch.where(position_ids.max() + 1 > self.scaling.original_max_positions, long, frequencies)
        angles = position_ids[..., None].float() * frequencies
        angles = torch.cat((angles, angles), dim=-1)
        if factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * factor, angles.sin() * factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the angles of cos/sin [batch, seq, d]: the first d
    channels of each head (all of them when d = head_dim; ``model.rope_fraction``), the rest as they are."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    part, rest = x[..., :rotated], x[..., rotated:]
    # joined as [batch, seq, heads, head_dim] in memory, the layout of the projection x is a view of: the
    # attention core's output follows its queries', and o_proj then reads it without a copy
    return torch.cat(((part * cos + rotate_half(part) * sin).transpose(1, 2), rest.transpose(1, 2)),
                     dim=-1).transpose(1, 2)
