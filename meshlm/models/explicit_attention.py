"""Attention computed explicitly, a chunk of queries at a time: for scores no fused kernel takes.

The fused attention kernels (FlashAttention, cuDNN's, the CPU flash kernel behind
``F.scaled_dot_product_attention``) take a mask, but neither a function of the scores nor an extra
term in the softmax. Two model features need one, and their blocks run ``explicit_attention``: the
same contract as SDPA (grouped KV heads, a boolean mask or causal, a scale), computed explicitly --

    S = q k^T * scale                        the scores
    S = cap * tanh(S / cap)                  soft-capping (``model.attention_softcap``, Gemma 2;
                                             ``meshlm/models/softcap.py``)
    S = -inf where masked
    o = sum_j exp(S_j) v_j / (exp(sink) + sum_j exp(S_j))
                                             with an attention sink (``model.attention_sinks``)

**Attention sinks.** A learned logit per query head, ``sink``, joins every row's softmax
denominator as a key that every query sees and whose value is zero (gpt-oss, OpenAI 2025; the
"off-by-one" softmax of Miller 2023). A head can then put weight "nowhere" -- its output shrinks
towards zero -- instead of spending it on the first tokens, the sinks Xiao et al. 2023
("Efficient Streaming Language Models with Attention Sinks") observed trained models make of
them. In terms of each row's log-sum-exp over its real keys, lse, it is the plain softmax output
scaled by sigmoid(lse - sink), and the row's log-sum-exp becomes lse' = logaddexp(lse, sink).

**Memory.** The scores, the tanh and the softmax run in fp32 (fp64 for fp64), the matmuls in the
inputs' dtype. Written the obvious way, autograd would keep the [t, s] scores, their tanh and the
probabilities of every head for backward: at 8192 tokens, 3 x 256 MiB per head. Instead an autograd
function of its own cuts the queries into chunks of rows (``SCORES_PER_CHUNK`` scores per chunk over
the whole batch and all heads; a causal chunk skips the keys after its last row): a chunk's scores
exist only while it is computed, in forward and again in backward, which rebuilds the
probabilities from each row's log-sum-exp as FlashAttention's backward does. Between the two, the
core holds q, k, v, its output and one log-sum-exp per row, as a fused kernel does.

Sliding windows, packed documents, padding and caches keep their own structure above this core
(``meshlm/models/attention.py`` passes the cap and the sinks down); ring attention applies the
sinks once its blocks are merged (``meshlm/parallel/context/ring_attention.py``). On a GPU,
FlexAttention's ``score_mod`` would fuse the cap into one kernel, and FlashAttention-3 takes
sinks; neither is used here (the core is pure PyTorch).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from meshlm.models.softcap import soft_cap_slope_

SCORES_PER_CHUNK = 2 ** 22
"""fp32 scores one chunk of ``explicit_attention`` computes at once (16 MiB), over the whole batch
and all heads; a chunk has at least one query row."""


def explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                       scale: float | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query [b, heads, t, d] over key [b, kv_heads, s, d] and value [b, kv_heads, s, d_v]
    (the module docstring): ``F.scaled_dot_product_attention(query, key, value, attn_mask,
    is_causal=is_causal, scale=scale, enable_gqa=True)`` with the scores capped at ``softcap`` (None:
    uncapped) and ``sinks`` in the denominators (None: none). ``attn_mask``: boolean, True where a key
    is visible, broadcastable to [b, heads, t, s]; ``is_causal``: query i sees keys 0..i (top-left
    aligned, as SDPA's); ``sinks``: one logit per query row, broadcastable to [b, heads, t] (a head's
    logit as [heads, 1]). Returns [b, heads, t, d_v]."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError("explicit_attention takes a boolean mask (True: visible)")
    batch, heads, queries, head_dim = query.shape
    kv_heads = key.shape[1]
    mask = None if attn_mask is None else _grouped_mask(attn_mask, kv_heads, heads)
    rows_per_chunk = max(1, SCORES_PER_CHUNK // (batch * heads * key.shape[2]))
    chunks = [(start, min(start + rows_per_chunk, queries)) for start in range(0, queries, rows_per_chunk)]
    grouped = query.unflatten(1, (kv_heads, heads // kv_heads))  # [b, kv, g, t, d]: query head h reads KV h // g
    if sinks is not None:  # one logit per row, [b, kv, g, t] (the expand's backward sums the rows' gradients)
        sinks = sinks.expand(batch, heads, queries).unflatten(1, (kv_heads, heads // kv_heads))
    out = _ExplicitAttention.apply(grouped, key.unsqueeze(2), value.unsqueeze(2), mask, sinks,
                                   head_dim ** -0.5 if scale is None else scale, softcap, is_causal, chunks)
    return out.flatten(1, 2)


def _grouped_mask(mask: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """A mask broadcastable to [b, heads, t, s] as one broadcastable to [b, kv_heads, group, t, s]."""
    if mask.dim() < 3 or mask.shape[-3] == 1:  # the same for every head
        return mask.unsqueeze(-3) if mask.dim() >= 3 else mask
    return mask.unflatten(-3, (kv_heads, heads // kv_heads))


class _ExplicitAttention(torch.autograd.Function):
    """Grouped queries [b, kv, g, t, d] over key/value [b, kv, 1, s, d], one chunk of query rows at a
    time (``chunks``: (start, stop) rows), keeping only q, k, v, the output and each row's
    log-sum-exp for backward. Backward recomputes each chunk's scores and probabilities
    P = exp(S - lse) and forms FlashAttention's gradients (Dao et al. 2022, Alg. 4), the score
    gradient carried through the cap's slope when capped:

        dV = P^T dO    dS = P * (dO V^T - rowsum(dO * O)) * (1 - (S / cap)^2)    dQ = dS K s    dK = dS^T Q s

    A sink is one more column of the softmax with a zero value, so its lse is part of each row's
    lse and its gradient is that column's dS: d sink = -exp(sink - lse) rowsum(dO * O).
    The matmuls run in the inputs' dtype; scores, softmax and their statistics in fp32 (fp64 for
    fp64), and dK, dV are summed over chunks and query groups in it."""

    @staticmethod
    def forward(ctx, query, key, value, mask, sinks, scale, cap, causal, chunks):
        wide = torch.promote_types(query.dtype, torch.float32)
        # value heads may be narrower (MLA); laid out [b, t, heads, d_v] in memory, as SDPA's output is, so
        # that the heads' outputs side by side (o_proj's input) are a view of it, not a copy
        batch, kv_heads, group, rows = query.shape[:4]
        out = query.new_empty((batch, rows, kv_heads, group, value.shape[-1])).permute(0, 2, 3, 1, 4)
        lse = query.new_empty(query.shape[:-1], dtype=wide)
        for start, stop in chunks:
            keys = stop if causal else key.shape[-2]  # a causal chunk's later keys are hidden from every row
            scores = _masked_(_scores(query[..., start:stop, :], key[..., :keys, :], scale, cap), mask, start,
                              stop, causal)
            chunk_lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            if sinks is not None:
                chunk_lse = torch.logaddexp(chunk_lse, sinks[..., start:stop, None].to(wide))
            lse[..., start:stop] = chunk_lse.squeeze(-1)
            probs = scores.sub_(chunk_lse.masked_fill_(chunk_lse == float("-inf"), 0)).exp_()  # in place: one buffer
            out[..., start:stop, :] = torch.matmul(probs.to(value.dtype), value[..., :keys, :])
        ctx.save_for_backward(query, key, value, out, lse, mask, sinks)
        ctx.scale, ctx.cap, ctx.causal, ctx.chunks = scale, cap, causal, chunks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse, mask, sinks = ctx.saved_tensors
        scale, cap, causal = ctx.scale, ctx.cap, ctx.causal
        wide = lse.dtype
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros(key.shape, dtype=wide, device=key.device)
        grad_value = torch.zeros(value.shape, dtype=wide, device=value.device)
        delta = (grad_out.to(wide) * out.to(wide)).sum(-1, keepdim=True)  # rowsum(dO * O)
        for start, stop in ctx.chunks:
            keys = stop if causal else key.shape[-2]
            rows_query, rows_grad = query[..., start:stop, :], grad_out[..., start:stop, :]
            scores = _scores(rows_query, key[..., :keys, :], scale, cap)
            probs = _masked_(scores.clone(), mask, start, stop, causal).sub_(lse[..., start:stop, None]).exp_()
            grad_value[..., :keys, :] += torch.matmul(probs.to(value.dtype).transpose(-1, -2), rows_grad).sum(
                2, keepdim=True, dtype=wide)
            grad_scores = torch.matmul(rows_grad, value[..., :keys, :].transpose(-1, -2)).to(wide)  # dP
            grad_scores = grad_scores.sub_(delta[..., start:stop, :]).mul_(probs)
            if cap is not None:
                grad_scores = grad_scores.mul_(soft_cap_slope_(scores, cap))  # in the scores' buffer
            grad_scores = grad_scores.mul_(scale).to(query.dtype)
            grad_query[..., start:stop, :] = torch.matmul(grad_scores, key[..., :keys, :])
            grad_key[..., :keys, :] += torch.matmul(grad_scores.transpose(-1, -2), rows_query).sum(
                2, keepdim=True, dtype=wide)
        grad_sinks = None
        if sinks is not None:
            grad_sinks = (-(sinks.to(wide) - lse).exp() * delta.squeeze(-1)).to(sinks.dtype)
        return (grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), None, grad_sinks, None, None, None,
                None)


def _scores(query: torch.Tensor, key: torch.Tensor, scale: float, cap: float | None) -> torch.Tensor:
    """q k^T * scale, capped as cap * tanh(. / cap) when ``cap`` is given: a new tensor in fp32 (fp64 for
    fp64), [b, kv, g, r, keys]."""
    wide = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query, key.transpose(-1, -2)).to(wide)
    if cap is None:
        return scores.mul_(scale)
    return scores.mul_(scale / cap).tanh_().mul_(cap)


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


__all__ = ["SCORES_PER_CHUNK", "explicit_attention"]
