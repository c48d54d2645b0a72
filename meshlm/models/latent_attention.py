"""Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", §2.1; used again by
DeepSeek-V3, Moonlight and Kimi K2).

Grouped-query attention shrinks the KV cache by sharing key/value heads among query heads. MLA
keeps a key and a value head per query head but makes them all from one small *latent*:

    c_kv, k_rope = split(x W_kva)                      c_kv: r channels, k_rope: d_r channels
    [k_nope_h, v_h] = norm(c_kv) W_kvb (per head h)   k_nope_h: d_n, v_h: d_v channels
    q_h = [q_nope_h, q_rope_h] = norm(x W_qa) W_qb    (or x W_q without a query latent)
    q_rope_h, k_rope = rope(q_rope_h), rope(k_rope)   one rotary key, shared by every head
    o_h = softmax([q_nope_h, q_rope_h] . [k_nope_h, k_rope] / sqrt(d_n + d_r)) v_h
    y = [o_1 ... o_H] W_o

RoPE cannot act on keys made from a cached latent (the rotation would have to pass through
W_kvb), so position lives in a separate, *decoupled* set of d_r rotary channels: a slice of
every query head, and one key slice shared by all heads, computed from x directly. Per token a
cache then needs only c_kv and k_rope -- r + d_r = 576 numbers in DeepSeek-V3, against
2 x 128 heads x 128 = 32768 for its multi-head equivalent.

**The latent cache.** A forward with a KV cache (generation) attends in latent space, as
DeepSeek-V2 §2.1.2 describes: W_kvb's key part W_k,h [d_n, r] is absorbed into the queries and its
value part W_v,h [d_v, r] into the output,

    q_nope_h . k_nope_h = (q_nope_h W_k,h) . norm(c_kv)       o_h = (softmax(...) norm(c_kv)) W_v,h^T

so every head attends, with scores [q_nope_h W_k,h, q_rope_h] . [norm(c_kv), k_rope], to one
cached key head of r + d_r channels and one value head of r (the same latent, held twice by the
cache: 2r + d_r numbers per token and layer, 1088 in DeepSeek-V3's shapes). The function is the
same, the rounding differs. When W_kvb carries a LoRA adapter or a low-precision recipe, its
effective weight is not the stored one, and the cache holds the expanded keys and values instead.

Everything after the projections is ``SelfAttention``'s: the same core (so SDPA, the causal and
sliding-window paths, packed documents, dropout, selective recompute and the KV cache), with
value heads of their own width d_v. The scale is 1/sqrt(d_n + d_r) unless ``model.attention_scale``
says otherwise (DeepSeek's YaRN models multiply it by mscale^2; the importer sets it).

**Tensor parallelism** splits the heads: W_qb (or W_q) and W_kvb are column-parallel, W_o
row-parallel (``meshlm/parallel/tensor/attention.py``). The down-projections W_qa and W_kva and
the two latent norms are replicated: every rank computes the latents of the whole sequence (a few
hundred channels), and since each rank's heads send back only their share of the latents'
gradient, those weights' gradients are partial, summed over the group after backward.

The layer names are the Hugging Face ones (``q_a_proj``, ``kv_a_proj`` for
``kv_a_proj_with_mqa``, ...), so ``model.lora_targets`` may name them.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.models.attention import SelfAttention
from meshlm.models.lora import ADAPTER_MODULE, adapted
from meshlm.models.norms import RMSNorm
from meshlm.models.rope import apply_rotary


class LatentAttention(SelfAttention):
    """``SelfAttention`` whose queries, keys and values come from MLA's latents (module docstring)."""

    def __init__(self, config, layer_index: int):
        nn.Module.__init__(self)
        self.layer_index = layer_index
        self.num_heads = self.num_kv_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.mla_qk_nope_head_dim, config.mla_qk_rope_head_dim
        self.head_dim = self.nope_dim + self.rope_dim
        """The width of a query and key head: its unrotated and its rotary channels."""
        self.value_dim = config.mla_v_head_dim
        self.kv_lora_rank = config.mla_kv_lora_rank
        hidden, heads = config.hidden_size, self.num_heads
        eps = config.norm_eps if config.mla_latent_norm_eps is None else config.mla_latent_norm_eps
        zero_centered = config.norm_zero_centered
        if config.mla_q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, config.mla_q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(config.mla_q_lora_rank, eps, zero_centered)
            self.q_b_proj = nn.Linear(config.mla_q_lora_rank, heads * self.head_dim, bias=False)
        self.kv_a_proj = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, eps, zero_centered)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, heads * (self.nope_dim + self.value_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.value_dim, hidden, bias=False)
        self.qk_norm_all, self.q_norm, self.k_norm = False, None, None
        self.init_core(config, layer_index)  # the rotary table of the mla_qk_rope_head_dim channels
        self.latent_cache = True
        """Cache latents in generation (the module docstring); False caches the expanded heads, as
        ``bench/latent_attention.py`` does to compare the two."""

    def latents(self, x: torch.Tensor, rotary_positions: torch.Tensor,
                rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, coordinates=None):
        """What both projections start from: the queries' unrotated part [b, heads, t, d_n] and rotated
        part [b, heads, t, d_r], the normalized KV latent [b, t, r] and the rotated shared key [b, 1, t, d_r]
        (``coordinates``: x's tokens', for the adapters' dropout)."""
        batch, seq, _ = x.shape
        if self.q_proj is not None:
            query = adapted(self.q_proj, x, coordinates)
        else:
            query = adapted(self.q_b_proj, self.q_a_norm(adapted(self.q_a_proj, x, coordinates)), coordinates)
        latent, rotary_key = adapted(self.kv_a_proj, x, coordinates).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        query_nope, query_rope = query.view(batch, seq, -1, self.head_dim).transpose(1, 2).split(
            (self.nope_dim, self.rope_dim), dim=-1)
        cos, sin = rotary_cos_sin if rotary_cos_sin is not None else self.rotary(rotary_positions)
        return (query_nope, apply_rotary(query_rope, cos, sin), self.kv_a_norm(latent),
                apply_rotary(rotary_key[:, None], cos, sin))

    def project(self, x: torch.Tensor, rotary_positions: torch.Tensor,
                rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, coordinates=None):
        """Queries and keys [b, heads, t, d_n + d_r] and values [b, heads, t, d_v] of x [b, t, hidden]."""
        batch, seq, _ = x.shape
        query_nope, query_rope, latent, rotary_key = self.latents(x, rotary_positions, rotary_cos_sin, coordinates)
        key_value = adapted(self.kv_b_proj, latent, coordinates).view(batch, seq, -1, self.nope_dim + self.value_dim)
        key_nope, value = key_value.transpose(1, 2).split((self.nope_dim, self.value_dim), dim=-1)
        query = torch.cat((query_nope, query_rope), dim=-1)
        key = torch.cat((key_nope, rotary_key.expand(-1, key_nope.shape[1], -1, -1)), dim=-1)
        # the values' own storage: a slice of the expanded latent, saved for backward (selective
        # recompute saves the core's inputs), would keep the unrotated keys alive too
        return query, key, value.contiguous()

    @property
    def caches_latents(self) -> bool:
        """Whether a cached forward attends in latent space (the module docstring). Not when W_kvb
        carries a LoRA adapter or a low-precision recipe: its effective weight is then not the stored
        one, and the cache holds expanded keys and values instead."""
        layer = self.kv_b_proj
        return (self.latent_cache and getattr(layer, ADAPTER_MODULE, None) is None
                and getattr(layer, "quantization", None) is None)

    def latent_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_kvb as this module's heads' key part [heads, d_n, r] and value part [heads, d_v, r]."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.value_dim, self.kv_lora_rank)
        return weight[:, :self.nope_dim], weight[:, self.nope_dim:]

    def cached_projection(self, x: torch.Tensor, rotary_positions: torch.Tensor,
                          rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, coordinates=None):
        """Queries [b, heads, t, r + d_r] in latent space, and one key head [b, 1, t, r + d_r] (the
        normalized latent and the rotary key) and one value head [b, 1, t, r] (the latent) to cache."""
        if not self.caches_latents:
            return self.project(x, rotary_positions, rotary_cos_sin, coordinates)
        query_nope, query_rope, latent, rotary_key = self.latents(x, rotary_positions, rotary_cos_sin, coordinates)
        latent = latent[:, None]  # one head for all
        query_latent = torch.einsum("bhtn,hnr->bhtr", query_nope, self.latent_weights()[0])
        return torch.cat((query_latent, query_rope), dim=-1), torch.cat((latent, rotary_key), dim=-1), latent

    @property
    def cached_scale(self) -> float | None:
        """1/sqrt(d_n + d_r), as uncached, though the latent queries are wider."""
        if not self.caches_latents or self.scale is not None:
            return self.scale
        return self.head_dim ** -0.5

    def from_cached_output(self, out: torch.Tensor) -> torch.Tensor:
        """Each head's attention-weighted latent [b, heads, t, r] through its value part of W_kvb."""
        if not self.caches_latents:
            return out
        return torch.einsum("bhtr,hvr->bhtv", out, self.latent_weights()[1])


__all__ = ["LatentAttention"]
