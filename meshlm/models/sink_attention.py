"""Attention sinks, and sliding windows, on a fused kernel: the sink merged after the rows' lse.

A sink (``model.attention_sinks``, ``meshlm/models/explicit_attention.py``) is one more column of
every row's softmax, with a zero value. The fused attention kernels take no such column, but some
return each row's log-sum-exp over its real keys, lse, beside the output o (FlashAttention-2's row
statistic; the aten ops ``meshlm/models/block_attention.py`` calls, the CPU flash kernel
and CUDA's flash and memory-efficient ones). The sink then merges into the finished row exactly,
as ring attention merges a block (``meshlm/parallel/context/ring_attention.py``):

    lse' = logaddexp(lse, sink)        o' = exp(lse - lse') o

and the kernel's own backward, given o' and lse', recomputes P' = exp(S - lse') -- the sink
softmax's columns -- and D = rowsum(dO * o') of the whole row, so it returns the exact dq, dk, dv;
the sink's gradient is its column's dS = -exp(sink - lse') D, summed over the rows. Between forward
and backward only q, k, v, o' and lse' are kept, as for plain fused attention.

``causal_attention`` takes this path for causal attention over whole sequences (training and
prefill without padding), the hot path, with or without a sliding window: a window's chunks of w
queries are two causal blocks each, their own chunk and the previous one's later keys with both
chunks' rows reversed (``fused_windowed_attention``), merged by their lse before the sink. Where no
fused kernel takes the inputs, and for masks and caches, the sinks go through the explicit core.
Measured on a 2-core CPU (fp32, 8 heads over 2 KV heads of 64, forward and backward, ``python -m
bench.softcap``, medians of 5, ``bench/results/softcap_cpu.json``): 1.06x and 1.01x plain causal
SDPA's time at 1024 and 4096 tokens (the explicit core took 1.6x and 2.2x), and with a window of
1024 of 4096 tokens 0.79x the time of windowed attention without sinks (SDPA over chunk pairs under
a band mask, which the CPU's flash kernel does not take), keeping 8.5 MB for backward against its
23 MB.

Plain sliding windows (no sinks, no cap) take the same two blocks a chunk
(``fused_windowed_attention`` with ``sinks=None``; ``attention.causal_attention`` chooses it on a
GPU, and on the CPU for windows from ``attention.FUSED_WINDOW_MIN_ON_CPU``): measured on the same
CPU (``python -m bench.sliding_window``, 8192 tokens, medians of 9) 1.28x the band-masked chunks'
speed with a window of 1024 and half their bytes kept for backward, but 0.71x with a window of 256,
where the CPU's flash kernel runs small blocks slowly.
"""

from __future__ import annotations

import torch

from meshlm.models.block_attention import accumulation_dtype, block_backward, block_forward, fused_kernel


def merged_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(o', lse') of finished rows (out [b, heads, t, d], lse [b, heads, t], in the accumulation
    dtype) with each head's sink merged in: lse' = logaddexp(lse, sink), o' = exp(lse - lse') o."""
    with_sink = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])
    return out * torch.exp(lse - with_sink).unsqueeze(-1), with_sink


def sink_gradient(grad_output: torch.Tensor, output: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
                  ) -> torch.Tensor:
    """The sinks' gradient [heads], given the rows' gradient, final output o' and lse': the sink
    column's dS = -exp(sink - lse') rowsum(dO * o'), summed over the rows (over this rank's rows,
    under context parallelism: the ranks' shares are summed with the other dense gradients)."""
    delta = (grad_output.to(lse.dtype) * output.to(lse.dtype)).sum(-1)
    return (-(torch.exp(sinks.to(lse.dtype)[:, None] - lse) * delta).sum((0, 2))).to(sinks.dtype)


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
        merged, with_sink = merged_sink(out.to(wide), lse.to(wide), sinks)
        output = merged.to(query.dtype)
        ctx.save_for_backward(query, key, value, output, with_sink, sinks)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse, sinks = ctx.saved_tensors
        grad_query, grad_key, grad_value = block_backward(grad_output, query, key, value, output, lse, True, ctx.scale)
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                sink_gradient(grad_output, output, lse, sinks), None)


# --- sliding windows: each chunk of w queries over its own chunk (causal) and the one before it ----------

def _chunks(tensor: torch.Tensor, window: int) -> torch.Tensor:
    """[b, n, P, ...] (P = chunks * window) -> [b, chunks, n, window, ...]."""
    return tensor.unflatten(2, (tensor.shape[2] // window, window)).transpose(1, 2)


def _unchunked(tensor: torch.Tensor) -> torch.Tensor:
    """``_chunks`` undone: [b, chunks, n, window, ...] -> [b, n, P, ...]."""
    return tensor.transpose(1, 2).flatten(2, 3)


def _previous_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The query side of the previous-chunk block: chunks 1.. of [b, chunks, n, w, ...], rows reversed,
    the first reversed row (the chunk's last query, which sees no earlier chunk's key) dropped,
    folded to [b (chunks - 1), n, w - 1, ...]."""
    return tensor[:, 1:].flip(3)[:, :, :, 1:].flatten(0, 1)


def _previous_keys(tensor: torch.Tensor) -> torch.Tensor:
    """The key side of the previous-chunk block: chunks ..-1, rows reversed, the last reversed row
    (the chunk's first key, out of every later query's window) dropped, folded."""
    return tensor[:, :-1].flip(3)[:, :, :, :-1].flatten(0, 1)


def _previous_rows_back(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """``_previous_rows`` undone for a result [b (chunks - 1), n, w - 1, ...]: [b, chunks - 1, n, w, ...]
    in the original row order, a zero row for each chunk's last query."""
    rows = tensor.unflatten(0, (batch, -1))
    return torch.cat((rows.new_zeros(*rows.shape[:3], 1, *rows.shape[4:]), rows), dim=3).flip(3)


def _previous_keys_back(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """``_previous_keys`` undone for a gradient [b (chunks - 1), n, w - 1, ...]."""
    rows = tensor.unflatten(0, (batch, -1))
    return torch.cat((rows, rows.new_zeros(*rows.shape[:3], 1, *rows.shape[4:])), dim=3).flip(3)


class _FusedWindowedAttention(torch.autograd.Function):
    """Sliding-window causal attention (query p sees keys p - w < q <= p), with ``sinks`` or without
    (None), through the fused kernel, as two causal blocks per chunk of w queries
    (``fused_windowed_attention``)."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, window, scale):
        length = query.shape[2]
        padding = -length % window
        q, k, v = (torch.nn.functional.pad(tensor, (0, 0, 0, padding)) for tensor in (query, key, value))
        batch, wide = q.shape[0], accumulation_dtype(query.dtype)
        q5, k5, v5 = _chunks(q, window), _chunks(k, window), _chunks(v, window)
        own_out, own_lse = block_forward(q5.flatten(0, 1), k5.flatten(0, 1), v5.flatten(0, 1), True, scale)
        out = own_out.to(wide).unflatten(0, (batch, -1))
        lse = own_lse.to(wide).unflatten(0, (batch, -1))
        if q5.shape[1] > 1 and window > 1:  # the previous chunk's keys after each query's own position
            prev_out, prev_lse = block_forward(_previous_rows(q5), _previous_keys(k5), _previous_keys(v5), True,
                                               scale)
            prev_out = _previous_rows_back(prev_out.to(wide), batch)
            prev_lse = _previous_rows_back(prev_lse.to(wide).unsqueeze(-1), batch).squeeze(-1)
            prev_lse[..., -1] = float("-inf")  # each chunk's last query sees none of them
            merged = torch.logaddexp(lse[:, 1:], prev_lse)
            out[:, 1:] = (out[:, 1:] * torch.exp(lse[:, 1:] - merged).unsqueeze(-1)
                          + prev_out * torch.exp(prev_lse - merged).unsqueeze(-1))
            lse[:, 1:] = merged
        out, lse = _unchunked(out)[:, :, :length], _unchunked(lse)[:, :, :length]
        # without sinks the rows' lse is kept as it is, cut to the real rows (not a view of the padded ones)
        merged, with_sink = (out, lse.contiguous()) if sinks is None else merged_sink(out, lse, sinks)
        # laid out [b, t, heads, d] in memory, as SDPA's output is: o_proj's input is then a view of it
        output = query.new_empty((query.shape[0], length, query.shape[1], value.shape[-1])).transpose(1, 2)
        output.copy_(merged)
        ctx.save_for_backward(query, key, value, output, with_sink, sinks)
        ctx.window, ctx.scale = window, scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse, sinks = ctx.saved_tensors
        window, scale = ctx.window, ctx.scale
        length, batch = query.shape[2], query.shape[0]
        padding = -length % window
        # padded rows: zero gradient and output, lse 0 -- they contribute nothing to any gradient
        q, k, v, grad, out = (torch.nn.functional.pad(tensor, (0, 0, 0, padding))
                              for tensor in (query, key, value, grad_output, output))
        lse_padded = torch.nn.functional.pad(lse, (0, padding))
        q5, k5, v5, grad5, out5 = (_chunks(tensor, window) for tensor in (q, k, v, grad, out))
        lse5 = _chunks(lse_padded.unsqueeze(-1), window).squeeze(-1)
        dq, dk, dv = block_backward(grad5.flatten(0, 1), q5.flatten(0, 1), k5.flatten(0, 1), v5.flatten(0, 1),
                                    out5.flatten(0, 1), lse5.flatten(0, 1), True, scale)
        wide = lse.dtype
        dq, dk, dv = (tensor.to(wide).unflatten(0, (batch, -1)) for tensor in (dq, dk, dv))
        if q5.shape[1] > 1 and window > 1:
            pdq, pdk, pdv = block_backward(_previous_rows(grad5), _previous_rows(q5), _previous_keys(k5),
                                           _previous_keys(v5), _previous_rows(out5),
                                           _previous_rows(lse5.unsqueeze(-1)).squeeze(-1), True, scale)
            dq[:, 1:] += _previous_rows_back(pdq.to(wide), batch)
            dk[:, :-1] += _previous_keys_back(pdk.to(wide), batch)
            dv[:, :-1] += _previous_keys_back(pdv.to(wide), batch)
        dq, dk, dv = (_unchunked(tensor)[:, :, :length] for tensor in (dq, dk, dv))
        grad_sinks = None if sinks is None else sink_gradient(grad_output, output, lse, sinks)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), grad_sinks, None, None


def fused_windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                             scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Sliding-window causal attention over whole sequences, with ``sinks`` [heads] or without (None),
    through a fused kernel (``fused_sinks_supported`` must hold). The sequence is cut into chunks of
    ``window`` queries, as ``attention.windowed_attention`` cuts it; chunk a's queries see their own
    chunk's keys causally -- one causal block -- and the keys of chunk a - 1 after their own offset,
    key j visible from query i when j > i. Reversing both chunks' rows turns that into j' < i',
    causal attention of rows 1..w-1 over keys 0..w-2: a second causal block, the last query of each
    chunk left out (it sees none of them). The two blocks' rows merge by their lse, as ring
    attention's blocks do, the sink after; backward gives each block the final output and lse (the
    module docstring). Both blocks are causal, so the kernels skip their upper triangles, and no
    band mask is built: the masked SDPA call ``windowed_attention`` makes runs no fused kernel."""
    return _FusedWindowedAttention.apply(query, key, value, sinks, window,
                                         query.shape[-1] ** -0.5 if scale is None else scale)


def fused_sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """Causal attention over whole sequences with ``sinks`` [heads] in the denominators, through a
    fused kernel (``fused_sinks_supported`` must hold); ``scale`` None: 1/sqrt(d)."""
    return _FusedSinkAttention.apply(query, key, value, sinks, query.shape[-1] ** -0.5 if scale is None else scale)


__all__ = ["fused_sink_attention", "fused_sinks_supported", "fused_windowed_attention", "merged_sink",
           "sink_gradient"]
