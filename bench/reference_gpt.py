"""A plain-PyTorch GPT and training step: the baseline meshlm's trainer is measured against.

The same architecture as a meshlm model with pattern ``"*-" * layers`` (pre-norm RMSNorm,
multi-head attention with rotate-half RoPE through ``scaled_dot_product_attention``, SwiGLU
MLP, tied embeddings), written the way one would write it by hand in a single file, with no
meshlm code. Grouped-query attention (``kv_heads`` < ``heads``, SDPA's ``enable_gqa``) and an
untied output head are options, for the Llama-style shapes of ``bench/gpu_throughput.py``. Its
training step is the textbook one: forward, cross-entropy, backward, global-norm clipping,
AdamW (torch's fused kernel on CUDA, the multi-tensor one elsewhere). In bf16 it uses
``torch.autocast`` over fp32 weights on the model's device, the usual plain-PyTorch recipe.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


class ReferenceLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, kv_heads: int | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads or heads, hidden // heads
        self.attention_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        h = self.attention_norm(x)
        q, k, v = (proj(h).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, seq, hidden))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class ReferenceGPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, ffn: int, rope_theta: float = 10000.0,
                 kv_heads: int | None = None, tie_embeddings: bool = True):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ReferenceLayer(hidden, heads, ffn, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.output = None if tie_embeddings else nn.Linear(hidden, vocab, bias=False)
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
        head = self.embedding if self.output is None else self.output
        logits = self.norm(x) @ head.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class ReferenceTrainer:
    """forward -> backward -> clip -> AdamW, with optional bf16 autocast on the model's device."""

    def __init__(self, model: ReferenceGPT, dtype: str, lr: float = 3e-4, grad_clip: float = 1.0):
        self.model, self.dtype, self.grad_clip = model, dtype, grad_clip
        self.device_type = next(model.parameters()).device.type
        fused = self.device_type == "cuda"  # one kernel per tensor on the GPU; CPU keeps the multi-tensor path
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                                           fused=fused or None, foreach=None if fused else True)

    def autocast(self):
        if self.dtype == "bf16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        with self.autocast():
            loss = self.model(input_ids, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()
