"""Attention sinks on a fused kernel: causal attention over whole sequences, the sink merged after.

A sink (``model.attention_sinks``, ``meshlm/models/explicit_attention.py``) is one more column of
every row's softmax, with a zero value. The fused attention kernels take no such column, but some
return each row's log-sum-exp over its real keys, lse, beside the output o (FlashAttention-2's row
statistic; the aten ops ``meshlm/parallel/context/block_attention.py`` calls, the CPU flash kernel
and CUDA's flash and memory-efficient ones). The sink then merges into the finished row exactly,
as ring attention merges a block (``meshlm/parallel/context/ring_attention.py``):

    lse' = logaddexp(lse, sink)        o' = exp(lse - lse') o

and the kernel's own backward, given o' and lse', recomputes P' = exp(S - lse') -- the sink
softmax's columns -- and D = rowsum(dO * o') of the whole row, so it returns the exact dq, dk, dv;
the sink's gradient is its column's dS = -exp(sink - lse') D, summed over the rows. Between forward
and backward only q, k, v, o' and lse' are kept, as for plain fused attention.

``causal_attention`` takes this path for causal attention over a whole sequence (training and
prefill without padding), the hot path; where no fused kernel takes the inputs, and for windows,
masks and caches, the sinks go through the explicit core. Measured on a 2-core CPU (fp32, 8 heads
over 2 KV heads of 64, forward and backward, ``python -m bench.softcap``, medians of 5): 1.06x and
1.07x plain SDPA's time at 1024 and 4096 tokens, against 1.6x and 2.2x for the explicit core; a
sliding-window layer (1024 of 4096) still runs the explicit core, 2.5x SDPA's time (its chunk pairs'
band masks would need the previous chunk as a shifted causal block of its own, merged like ring
attention's blocks: not done).
"""

from __future__ import annotations

import torch

from meshlm.parallel.context.block_attention import accumulation_dtype, block_backward, block_forward, fused_kernel


def fused_sinks_supported(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether a fused kernel returning lse takes these queries and keys (``block_attention.fused_kernel``)."""
    return fused_kernel(query, key) is not None


class _FusedSinkAttention(torch.autograd.Function):
    """Causal attention of query [b, heads, s, d] over key/value [b, kv_heads, s, d] with ``sinks``
    [heads], through a fused kernel (the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, scale):
        out, lse = block_forward(query, key, value, True, scale)
        wide = accumulation_dtype(query.dtype)
        with_sink = torch.logaddexp(lse.to(wide), sinks.to(wide)[:, None])
        output = (out.to(wide) * torch.exp(lse.to(wide) - with_sink).unsqueeze(-1)).to(query.dtype)
        ctx.save_for_backward(query, key, value, output, with_sink, sinks)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse, sinks = ctx.saved_tensors
        grad_query, grad_key, grad_value = block_backward(grad_output, query, key, value, output, lse, True, ctx.scale)
        delta = (grad_output.to(lse.dtype) * output.to(lse.dtype)).sum(-1)  # rowsum(dO * O')
        grad_sinks = -(torch.exp(sinks.to(lse.dtype)[:, None] - lse) * delta).sum((0, 2))
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                grad_sinks.to(sinks.dtype), None)


def fused_sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Causal attention over whole sequences with ``sinks`` [heads] in the denominators, through a
    fused kernel (``fused_sinks_supported`` must hold); ``scale`` None: 1/sqrt(d)."""
    return _FusedSinkAttention.apply(query, key, value, sinks, query.shape[-1] ** -0.5 if scale is None else scale)


__all__ = ["fused_sink_attention", "fused_sinks_supported"]
