"""Soft-capping: scores and logits bounded smoothly by a tanh (Gemma 2).

    softcap(z) = cap * tanh(z / cap)          d softcap / dz = 1 - (softcap(z) / cap)^2

Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size", §2)
caps the attention scores at 50 (``model.attention_softcap``) and the output logits at 30
(``model.final_logit_softcap``), after Grok-1 and Bello et al. 2016. Near zero the map is the
identity (slope 1); it bends smoothly towards +-cap, so no score or logit leaves (-cap, cap) and
none can grow without bound during training; it is increasing, so a greedy argmax is unchanged.
Its slope is a function of its output, so a backward that kept the capped values needs nothing else
(``soft_cap_slope``, or ``soft_cap_slope_`` in the capped values' own storage: the attention core
below and the fused cross-entropy, meshlm/models/losses.py, use it on each chunk).

**Attention with capped scores.** The fused attention kernels (FlashAttention, cuDNN's, the CPU
flash kernel behind ``F.scaled_dot_product_attention``) take a mask but no function of the scores,
so a block with ``model.attention_softcap`` runs ``softcapped_attention``: the same contract as
SDPA (grouped KV heads, a boolean mask or causal, a scale), computed explicitly --

    S = cap * tanh(q k^T * scale / cap),  S = -inf where masked,  o = softmax(S) v

-- the scores, the tanh and the softmax in fp32 (fp64 for fp64), the matmuls in the inputs' dtype. Written the
obvious way, autograd would keep the [t, s] scores, their tanh and the probabilities of every head
for backward: at 8192 tokens, 3 x 256 MiB per head. Instead an autograd function of its own cuts
the queries into chunks of rows (``SCORES_PER_CHUNK`` scores per chunk over the whole batch and all
heads; a causal chunk skips the keys after its last row): a chunk's scores exist only while it is
computed, in forward and again in backward, which rebuilds the probabilities from each row's
log-sum-exp as FlashAttention's backward does. Between the two, the core holds q, k, v, its
output and one log-sum-exp per row, as a fused kernel does.
Sliding windows and packed documents keep their own structure above this core
(``meshlm/models/attention.py`` passes the cap down), and ring attention's blocks take the cap in
their reference path (``meshlm/parallel/context/block_attention.py``). On a GPU, FlexAttention's
``score_mod`` would fuse this into one kernel; it is not used here (the core is pure PyTorch).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

SCORES_PER_CHUNK = 2 ** 22
"""fp32 scores one chunk of ``softcapped_attention`` computes at once (16 MiB), over the whole batch
and all heads; a chunk has at least one query row."""


def soft_cap(values: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(values / cap), in the dtype of ``values``."""
    return torch.tanh(values / cap) * cap


def soft_cap_slope(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """The derivative of ``soft_cap`` at the point whose capped value is ``capped``: 1 - (capped / cap)^2."""
    return 1 - (capped / cap).square()


def soft_cap_slope_(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """``soft_cap_slope`` computed in the storage of ``capped`` (a buffer no longer needed)."""
    return capped.div_(cap).square_().neg_().add_(1)


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cap: float,
                         attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                         scale: float | None = None) -> torch.Tensor:
    """Attention of query [b, heads, t, d] over key [b, kv_heads, s, d] and value [b, kv_heads, s, d_v]
    with scores capped at
    ``cap`` (the module docstring): ``F.scaled_dot_product_attention(query, key, value, attn_mask,
    is_causal=is_causal, scale=scale, enable_gqa=True)`` with S -> cap * tanh(S / cap) before the mask.
    ``attn_mask``: boolean, True where a key is visible, broadcastable to [b, heads, t, s];
    ``is_causal``: query i sees keys 0..i (top-left aligned, as SDPA's). Returns [b, heads, t, d_v]."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError("softcapped_attention takes a boolean mask (True: visible)")
    batch, heads, queries, head_dim = query.shape
    kv_heads = key.shape[1]
    mask = None if attn_mask is None else _grouped_mask(attn_mask, kv_heads, heads)
    rows_per_chunk = max(1, SCORES_PER_CHUNK // (batch * heads * key.shape[2]))
    chunks = [(start, min(start + rows_per_chunk, queries)) for start in range(0, queries, rows_per_chunk)]
    grouped = query.unflatten(1, (kv_heads, heads // kv_heads))  # [b, kv, g, t, d]: query head h reads KV h // g
    out = _SoftcappedAttention.apply(grouped, key.unsqueeze(2), value.unsqueeze(2), mask,
                                     head_dim ** -0.5 if scale is None else scale, cap, is_causal, chunks)
    return out.flatten(1, 2)


def _grouped_mask(mask: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """A mask broadcastable to [b, heads, t, s] as one broadcastable to [b, kv_heads, group, t, s]."""
    if mask.dim() < 3 or mask.shape[-3] == 1:  # the same for every head
        return mask.unsqueeze(-3) if mask.dim() >= 3 else mask
    return mask.unflatten(-3, (kv_heads, heads // kv_heads))


class _SoftcappedAttention(torch.autograd.Function):
    """Grouped queries [b, kv, g, t, d] over key/value [b, kv, 1, s, d], one chunk of query rows at a
    time (``chunks``: (start, stop) rows), keeping only q, k, v, the output and each row's
    log-sum-exp for backward. Backward recomputes each chunk's capped scores and probabilities
    P = exp(S - lse) and forms FlashAttention's gradients (Dao et al. 2022, Alg. 4), the score
    gradient carried through the cap's slope:

        dV = P^T dO    dS = P * (dO V^T - rowsum(dO * O)) * (1 - (S / cap)^2)    dQ = dS K s    dK = dS^T Q s

    The matmuls run in the inputs' dtype; scores, softmax and their statistics in fp32 (fp64 for
    fp64), and dK, dV are summed over chunks and query groups in it."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, cap, causal, chunks):
        wide = torch.promote_types(query.dtype, torch.float32)
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # value heads may be narrower (MLA)
        lse = query.new_empty(query.shape[:-1], dtype=wide)
        for start, stop in chunks:
            keys = stop if causal else key.shape[-2]  # a causal chunk's later keys are hidden from every row
            scores = _masked_(_capped_scores(query[..., start:stop, :], key[..., :keys, :], scale, cap), mask, start,
                              stop, causal)
            chunk_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            lse[..., start:stop] = chunk_lse.squeeze(-1)
            probs = scores.sub_(chunk_lse.masked_fill_(chunk_lse == float("-inf"), 0)).exp_()  # in place: one buffer
            out[..., start:stop, :] = torch.matmul(probs.to(value.dtype), value[..., :keys, :])
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.scale, ctx.cap, ctx.causal, ctx.chunks = scale, cap, causal, chunks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse, mask = ctx.saved_tensors
        scale, cap, causal = ctx.scale, ctx.cap, ctx.causal
        wide = lse.dtype
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros(key.shape, dtype=wide, device=key.device)
        grad_value = torch.zeros(value.shape, dtype=wide, device=value.device)
        delta = (grad_out.to(wide) * out.to(wide)).sum(-1, keepdim=True)  # rowsum(dO * O)
        for start, stop in ctx.chunks:
            keys = stop if causal else key.shape[-2]
            rows_query, rows_grad = query[..., start:stop, :], grad_out[..., start:stop, :]
            capped = _capped_scores(rows_query, key[..., :keys, :], scale, cap)
            probs = _masked_(capped.clone(), mask, start, stop, causal).sub_(lse[..., start:stop, None]).exp_()
            grad_value[..., :keys, :] += torch.matmul(probs.to(value.dtype).transpose(-1, -2), rows_grad).sum(
                2, keepdim=True, dtype=wide)
            grad_scores = torch.matmul(rows_grad, value[..., :keys, :].transpose(-1, -2)).to(wide)  # dP
            slope = soft_cap_slope_(capped, cap)  # in the scores' buffer
            grad_scores = grad_scores.sub_(delta[..., start:stop, :]).mul_(probs).mul_(slope).mul_(scale)
            grad_scores = grad_scores.to(query.dtype)
            grad_query[..., start:stop, :] = torch.matmul(grad_scores, key[..., :keys, :])
            grad_key[..., :keys, :] += torch.matmul(grad_scores.transpose(-1, -2), rows_query).sum(
                2, keepdim=True, dtype=wide)
        return (grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None, None, None)


def _capped_scores(query: torch.Tensor, key: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """cap * tanh(q k^T * scale / cap), a new tensor in fp32 (fp64 for fp64): [b, kv, g, r, keys]."""
    wide = torch.promote_types(query.dtype, torch.float32)
    return torch.matmul(query, key.transpose(-1, -2)).to(wide).mul_(scale / cap).tanh_().mul_(cap)


def _masked_(scores: torch.Tensor, mask: torch.Tensor | None, start: int, stop: int, causal: bool) -> torch.Tensor:
    """Rows ``start:stop`` of the scores, in place, with -inf where hidden: by ``mask`` (its rows and
    the scores' key columns), and with ``causal`` where a key comes after the row (made per chunk,
    so no [t, s] mask is ever held)."""
    keys = scores.shape[-1]
    if causal:
        rows = torch.arange(start, stop, device=scores.device)[:, None]
        scores.masked_fill_(torch.arange(keys, device=scores.device) > rows, float("-inf"))
    if mask is not None:
        rows = mask[..., start:stop, :] if mask.shape[-2] > 1 else mask
        scores.masked_fill_(~rows[..., :keys], float("-inf"))
    return scores


__all__ = ["SCORES_PER_CHUNK", "soft_cap", "soft_cap_slope", "soft_cap_slope_", "softcapped_attention"]
