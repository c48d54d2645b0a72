"""A plain-PyTorch GPT and training step: the baseline meshlm's trainer is measured against.

The same architecture as a meshlm model with pattern ``"*-" * layers`` (pre-norm RMSNorm,
multi-head attention with rotate-half RoPE through ``scaled_dot_product_attention``, SwiGLU
MLP, tied embeddings), written the way one would write it by hand in a single file, with no
meshlm code. Its training step is the textbook one: forward, cross-entropy, backward,
global-norm clipping, AdamW. In bf16 it uses ``torch.autocast`` over fp32 weights, the usual
plain-PyTorch recipe.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        h = self.attention_norm(x)
        q, k, v = (proj(h).view(batch, seq, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, seq, hidden))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class ReferenceGPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, ffn: int, rope_theta: float = 10000.0):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ReferenceLayer(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        head_dim = hidden // heads
        self.register_buffer("inverse_frequencies",
                             1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).float()
        angles = positions[:, None] * self.inverse_frequencies
        angles = torch.cat((angles, angles), dim=-1)
        x = self.embedding(input_ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.norm(x) @ self.embedding.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class ReferenceTrainer:
    """forward -> backward -> clip -> AdamW, with optional bf16 autocast."""

    def __init__(self, model: ReferenceGPT, dtype: str, lr: float = 3e-4, grad_clip: float = 1.0):
        self.model, self.dtype, self.grad_clip = model, dtype, grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                           foreach=True)

    def autocast(self):
        if self.dtype == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        with self.autocast():
            loss = self.model(input_ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()
