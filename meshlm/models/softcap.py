"""Soft-capping: scores and logits bounded smoothly by a tanh (Gemma 2).

    softcap(z) = cap * tanh(z / cap)          d softcap / dz = 1 - (softcap(z) / cap)^2

Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size", §2)
caps the attention scores at 50 (``model.attention_softcap``) and the output logits at 30
(``model.final_logit_softcap``), after Grok-1 and Bello et al. 2016. Near zero the map is the
identity (slope 1); it bends smoothly towards +-cap, so no score or logit leaves (-cap, cap) and
none can grow without bound during training; it is increasing, so a greedy argmax is unchanged.
Its slope is a function of its output, so a backward that kept the capped values needs nothing else
(``soft_cap_slope``: the fused cross-entropy, meshlm/models/losses.py, uses it on each chunk).

**Attention with capped scores.** The fused attention kernels (FlashAttention, cuDNN's, the CPU
flash kernel behind ``F.scaled_dot_product_attention``) take a mask but no function of the scores,
so a block with ``model.attention_softcap`` runs ``softcapped_attention``: the same contract as
SDPA (grouped KV heads, a boolean mask or causal, a scale), computed explicitly --

    S = cap * tanh(q k^T * scale / cap),  S = -inf where masked,  o = softmax(S) v

-- the scores, the tanh and the softmax in fp32 (fp64 for fp64), the matmuls in the inputs' dtype. Written the
obvious way, autograd would keep the [t, s] scores, their tanh and the probabilities of every head
for backward: at 8192 tokens, 3 x 256 MiB per head. Instead the queries are cut into chunks of
rows (``SCORES_PER_CHUNK`` scores per chunk over the whole batch and all heads) and each chunk runs
under activation checkpointing: its scores exist only while the chunk is computed, in forward and
again in backward. Between the two, the core holds q, k, v and its output, as a fused kernel
does, at the price of computing the scores twice (a fused kernel's backward recomputes them too).
Sliding windows and packed documents keep their own structure above this core
(``meshlm/models/attention.py`` passes the cap down), and ring attention's blocks take the cap in
their reference path (``meshlm/parallel/context/block_attention.py``). On a GPU, FlexAttention's
``score_mod`` would fuse this into one kernel; it is not used here (the core is pure PyTorch).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

SCORES_PER_CHUNK = 2 ** 22
"""fp32 scores one chunk of ``softcapped_attention`` computes at once (16 MiB), over the whole batch
and all heads; a chunk has at least one query row."""


def soft_cap(values: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(values / cap), in the dtype of ``values``."""
    return torch.tanh(values / cap) * cap


def soft_cap_slope(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """The derivative of ``soft_cap`` at the point whose capped value is ``capped``: 1 - (capped / cap)^2."""
    return 1 - (capped / cap).square()


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cap: float,
                         attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None) -> torch.Tensor:
    """Attention of query [b, heads, t, d] over key/value [b, kv_heads, s, d] with scores capped at
    ``cap`` (the module docstring): ``F.scaled_dot_product_attention(query, key, value, attn_mask,
    is_causal=is_causal, scale=scale, enable_gqa=True)`` with S -> cap * tanh(S / cap) before the mask.
    ``attn_mask``: boolean, True where a key is visible, broadcastable to [b, heads, t, s];
    ``is_causal``: query i sees keys 0..i (top-left aligned, as SDPA's). Returns [b, heads, t, d]."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError("softcapped_attention takes a boolean mask (True: visible)")
    batch, heads, queries, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    grouped = query.unflatten(1, (kv_heads, heads // kv_heads))  # [b, kv, g, t, d]: query head h reads KV h // g
    mask = None if attn_mask is None else _grouped_mask(attn_mask, kv_heads, heads)
    key, value = key.unsqueeze(2), value.unsqueeze(2)  # [b, kv, 1, s, d]
    rows_per_chunk = max(1, SCORES_PER_CHUNK // (batch * heads * keys))
    checkpointed = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    pieces = []
    for start in range(0, queries, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, queries))
        chunk_mask = None if mask is None else (mask[..., rows, :] if mask.shape[-2] > 1 else mask)
        arguments = (grouped[..., rows, :], key, value, chunk_mask, scale, cap, start if is_causal else None)
        pieces.append(torch.utils.checkpoint.checkpoint(_attend, *arguments, use_reentrant=False)
                      if checkpointed else _attend(*arguments))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)
    return out.flatten(1, 2)


def _grouped_mask(mask: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """A mask broadcastable to [b, heads, t, s] as one broadcastable to [b, kv_heads, group, t, s]."""
    if mask.dim() < 3 or mask.shape[-3] == 1:  # the same for every head
        return mask.unsqueeze(-3) if mask.dim() >= 3 else mask
    return mask.unflatten(-3, (kv_heads, heads // kv_heads))


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
            scale: float, cap: float, causal_from: int | None) -> torch.Tensor:
    """One chunk: grouped queries [b, kv, g, r, d] over key/value [b, kv, 1, s, d]; ``causal_from``:
    the chunk's first query row, when queries see only keys up to their own row (the chunk's causal
    mask is made here, so it is never held whole)."""
    wide = torch.promote_types(query.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    scores = soft_cap(torch.matmul(query, key.transpose(-1, -2)).to(wide) * scale, cap)
    if causal_from is not None:
        rows = torch.arange(causal_from, causal_from + query.shape[-2], device=query.device)[:, None]
        scores = scores.masked_fill(torch.arange(key.shape[-2], device=query.device) > rows, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


__all__ = ["SCORES_PER_CHUNK", "soft_cap", "soft_cap_slope", "softcapped_attention"]
