"""The dense MLP block and the activation functions shared with the MoE experts.

Non-gated: ``down(act(up(x)))``. Gated (SwiGLU, Shazeer 2020): ``down(silu(gate(x)) * up(x))``;
GeGLU (Gemma) the same with GELU's tanh approximation for silu.
gpt-oss's clamped SwiGLU (``clamped_swiglu``) bounds both projections first and shifts the up
projection by one: with g = min(x W_gate, limit) and u = clamp(x W_up, -limit, limit),
``g sigmoid(alpha g) (u + 1)`` (OpenAI 2025, the gpt-oss model card; alpha = 1.702 makes
g sigmoid(alpha g) the sigmoid approximation of GELU). Squared ReLU (So et al. 2021, "Primer") is
Nemotron-H's choice. Under tensor parallelism
``gate``/``up`` are split by columns and ``down`` by rows, so the activation stays local.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.fused_linear import project_together
from meshlm.models.lora import adapted, lora_coordinates


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (Hendrycks & Gimpel 2016): GPT-2's ``gelu_new``, transformers'
    ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


ELEMENTWISE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "squared_relu": squared_relu,
    "gelu": F.gelu,
    "gelu_tanh": gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}


GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": F.silu,
    "geglu": gelu_tanh,  # Gemma's gelu_pytorch_tanh
}
"""The gated activations (Shazeer 2020, "GLU Variants Improve Transformer"): gate(x W_gate) * x W_up."""


def is_gated(activation: str) -> bool:
    return activation in GATES or activation == "clamped_swiglu"


def clamped_swiglu(up: torch.Tensor, gate: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's gated activation (module docstring): g sigmoid(alpha g) (u + 1), g and u clamped at ``limit``."""
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + 1)


def activate(activation: str, up: torch.Tensor, gate: torch.Tensor | None = None, swiglu_limit: float = 7.0,
             swiglu_alpha: float = 1.702) -> torch.Tensor:
    """Apply the MLP nonlinearity to the up projection (and the gate projection when gated);
    ``swiglu_limit`` and ``swiglu_alpha`` are ``clamped_swiglu``'s (``model.swiglu_*``)."""
    if activation == "clamped_swiglu":
        return clamped_swiglu(up, gate, swiglu_limit, swiglu_alpha)
    if is_gated(activation):
        return GATES[activation](gate) * up
    return ELEMENTWISE_ACTIVATIONS[activation](up)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str, bias: bool = False,
                 lora_dropout: float = 0.0, swiglu_limit: float = 7.0, swiglu_alpha: float = 1.702):
        super().__init__()
        self.activation = activation
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        """``clamped_swiglu``'s clamp and gain (``model.swiglu_limit``, ``model.swiglu_alpha``)."""
        self.lora_dropout = lora_dropout
        """``model.lora_dropout``: whether the projections' adapters need the tokens' coordinates."""
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=bias) if is_gated(activation) else None
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:
        """x [b, t, hidden]; ``context`` describes its tokens (their coordinates feed the adapters' dropout)."""
        coordinates = lora_coordinates(self, context)
        if self.gate_proj is None:
            return adapted(self.down_proj, self.activate(adapted(self.up_proj, x, coordinates), None), coordinates)
        gate, up = project_together(x, (self.gate_proj, self.up_proj), coordinates)  # one GEMM where it can
        return adapted(self.down_proj, self.activate(up, gate), coordinates)

    def activate(self, up: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return activate(self.activation, up, gate, self.swiglu_limit, self.swiglu_alpha)
