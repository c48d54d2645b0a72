"""Causal self-attention with grouped-query heads, RoPE, optional QK-norm and a KV cache.

    q = x W_q,  k = x W_k,  v = x W_v            (num_heads, num_kv_heads, num_kv_heads heads)
    q, k = rope(norm(q)), rope(norm(k))          (norm only with qk_norm; rope only with RoPE)
    o = softmax(q k^T / sqrt(d) + causal mask) v (each KV head serves heads/kv_heads query heads)
    y = o W_o

Grouped-query attention (Ainslie et al. 2023) shares each key/value head among a group of query
heads, cutting the KV cache by heads/kv_heads. The attention core (scores, softmax, weighted
sum) is its own function, ``attention_core``: it is the part selective recomputation
(Korthikanti et al. 2022) recomputes, and the part context parallelism replaces with ring
attention. Under tensor parallelism the heads are split across ranks: q/k/v are
column-parallel, o is row-parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from meshlm.models.cache import AttentionCache
from meshlm.models.norms import RMSNorm
from meshlm.models.rope import RotaryEmbedding, apply_rotary


def attention_core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [b, heads, t, d] over key/value [b, kv_heads, s, d], s >= t.

    The t queries are the last t of the s positions (s > t while decoding with a cache).
    ``key_mask`` [b, s] (True = real token) hides padded keys. A query may always see itself,
    so that a padded query row is never fully masked (its output is unused but stays finite).
    """
    query_len, key_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if key_mask is None and query_len == key_len:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=gqa)
    query_positions = torch.arange(key_len - query_len, key_len, device=query.device)[:, None]
    key_positions = torch.arange(key_len, device=query.device)[None, :]
    allowed = key_positions <= query_positions  # [t, s]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].bool()
        allowed = allowed | (key_positions == query_positions)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, enable_gqa=gqa)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.resolved_num_kv_heads
        self.head_dim = config.resolved_head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.rotary = (RotaryEmbedding(self.head_dim, config.rope_theta)
                       if config.position_embedding == "rope" else None)
        self.core = attention_core
        """The attention core; context parallelism replaces it with ring attention over its CP group
        (``meshlm.parallel.ring_attention.RingAttentionCore``, same call)."""
        self.recompute_core = False
        """Selective recomputation (set by training.recompute): keep only q, k, v for backward and
        recompute scores, softmax and the weighted sum from them."""

    def forward(self, x: torch.Tensor, context) -> torch.Tensor:
        batch, seq, _ = x.shape
        query = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        if self.rotary is not None:
            cos, sin = self.rotary(context.position_ids)
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)

        key_mask = context.token_mask
        if context.cache is not None:
            key, value = context.cache.state_for(self.layer_index, AttentionCache).append(key, value)
            key_mask = context.cache.token_mask
            if bool(key_mask.all()):
                key_mask = None
        if self.recompute_core and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(self.core, query, key, value, key_mask, use_reentrant=False)
        else:
            out = self.core(query, key, value, key_mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
