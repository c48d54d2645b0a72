"""The dense MLP block and the activation functions shared with the MoE experts.

Non-gated: ``down(act(up(x)))``. Gated (SwiGLU, Shazeer 2020): ``down(silu(gate(x)) * up(x))``;
GeGLU (Gemma) the same with GELU's tanh approximation for silu.
Squared ReLU (So et al. 2021, "Primer") is Nemotron-H's choice. Under tensor parallelism
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
    return activation in GATES


def activate(activation: str, up: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the MLP nonlinearity to the up projection (and the gate projection when gated)."""
    if is_gated(activation):
        return GATES[activation](gate) * up
    return ELEMENTWISE_ACTIVATIONS[activation](up)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str, bias: bool = False,
                 lora_dropout: float = 0.0):
        super().__init__()
        self.activation = activation
        self.lora_dropout = lora_dropout
        """``model.lora_dropout``: whether the projections' adapters need the tokens' coordinates."""
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=bias) if is_gated(activation) else None
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:
        """x [b, t, hidden]; ``context`` describes its tokens (their coordinates feed the adapters' dropout)."""
        coordinates = lora_coordinates(self, context)
        if self.gate_proj is None:
            return adapted(self.down_proj, activate(self.activation, adapted(self.up_proj, x, coordinates), None),
                           coordinates)
        gate, up = project_together(x, (self.gate_proj, self.up_proj), coordinates)  # one GEMM where it can
        return adapted(self.down_proj, activate(self.activation, up, gate), coordinates)
