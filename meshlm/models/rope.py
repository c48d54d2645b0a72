"""Rotary position embedding (RoPE, Su et al. 2021).

Each pair of channels (i, i + d/2) of a query or key at position p is rotated by the angle
``p * theta ** (-2i/d)``, so the dot product of a query at p and a key at p' depends on p - p'
only. The "rotate half" layout (pairs are i and i + d/2, not 2i and 2i+1) matches Llama and
the Hugging Face checkpoints. Positions are explicit tensors, so left-padded batches, cached
decoding and (later) context-parallel chunks all pass their own *global* positions.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Holds no tensors: the frequencies are recomputed per call (a few hundred flops), so the
    module is the same on any device, including the meta device used to build large models."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [batch, seq, head_dim] (fp32) for integer positions [batch, seq]."""
        exponents = torch.arange(0, self.head_dim, 2, device=position_ids.device).float() / self.head_dim
        inverse_frequencies = 1.0 / (self.theta ** exponents)
        angles = position_ids[..., None].float() * inverse_frequencies
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, heads, seq, head_dim] by the angles of cos/sin [batch, seq, head_dim]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin
