"""Ring attention: causal attention over a sequence whose chunks live on the ranks of a CP group.

Under context parallelism (``context_parallel.py``) rank i holds the queries, keys and values
of two chunks of every sequence, i and 2cp-1-i. Its queries must attend to the keys and values
of every earlier chunk, wherever they live. Ring attention (Liu et al. 2023, "Ring Attention
with Blockwise Transformers for Near-Infinite Context") never gathers them: in cp steps, each
rank computes attention against the K/V block it holds, while passing that block on to the next
rank of the ring and receiving the previous rank's (batched isend/irecv, so the transfer runs
during the computation). After cp steps every query has seen every key once.

**Masks per chunk pair.** Query chunk a and key chunk b interact fully when b < a, causally
(lower triangle) when b = a, and not at all when b > a. With the pairing, step 0 (own K/V) is
the two diagonal blocks plus one full block; every later step is exactly two full blocks (the
sender's front chunk for all local queries, or all its keys for the local back chunk) -- the
same work on every rank and every step.

**One block, through a fused kernel** (``block_attention.py``). Each block is computed by a
fused attention kernel that also returns the log-sum-exp of its rows (FlashAttention-2, Dao
2023; the CPU flash kernel on CPU, FlashAttention-2 or the memory-efficient kernel on CUDA), in
the run's dtype: bf16 blocks stay bf16. The [c x c] scores exist only a tile at a time inside
the kernel. Shapes or dtypes no kernel takes (e.g. fp64 on CUDA) use the explicit-matmul
reference of the same equations.

**Merging partial results (online softmax).** Each block b gives, per query row, the softmax
over its keys only: out_b = softmax(S_b) V_b and lse_b = log sum_j exp(S_b,j). Two partial
results of the same row combine exactly (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; the rescaling inside FlashAttention, Dao et al. 2022):

    lse = log(exp(lse_1) + exp(lse_2))
    out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

The running out and lse are fp32 accumulators (fp64 for fp64 inputs), so the blocks may arrive
in any order, bf16 partial results are summed without bf16 rounding, and nothing of size
[queries x all keys] is ever held.

**Backward.** A custom autograd function calls the kernel's backward per block (FlashAttention-2,
Alg. 2) with the FINAL output O and lse of the query rows: the kernel recomputes
P = exp(S_block - lse) -- exactly the block's columns of the full softmax -- and uses
D = rowsum(dO * O) of the whole row, so each block's (dq, dk, dv) is its exact share:

    dV = P^T dO     dS = P * (dO V^T - D)     dQ = dS K / sqrt(d)     dK = dS^T Q / sqrt(d)

The K/V blocks travel the ring again, and with each travels the fp32 accumulator of ITS dK/dV:
a rank adds its queries' contribution and passes the accumulator on with the block, so after cp
steps (one more hop than the K/V) every block's dK/dV arrives, complete, at its owner; dQ is
accumulated in fp32 at home. Forward saves only q, k, v, the output (in the run's dtype: the
very tensor it returns) and the fp32 lse -- O(local sequence) memory, no [c x c] tensor.

Grouped-query attention: query head h reads KV head h // (heads / kv_heads) (the rule of
``F.scaled_dot_product_attention(enable_gqa=True)``); K/V travel with their own kv_heads, and
only inside one block's kernel call are they repeated per query head (see
``block_attention.py``). Tensor parallelism splits heads, so each TP rank rings its own heads
over its CP group; sequence parallelism has gathered the CP-local sequence before q/k/v are
computed, so nothing changes. The output and gradients come back in the inputs' dtype.

**Packed documents** (``document_ids``, ``data.document_boundaries``): a query attends only to
keys of its own document. Documents are contiguous, so within a chunk pair the allowed keys of
one query document are a contiguous run of the key chunk: each block splits, per sequence of the
batch, into one sub-block per document the two chunks share -- whole when the key chunk is
earlier, causal on the diagonal -- computed and merged exactly like whole blocks (a query row
always has its own key, so no row ends empty). Each rank learns every chunk's document ids with
one small all-gather of the (integer) ids per attention call; nothing of size [s x s] is built.

**Sliding window** (``window`` w, ``model.sliding_window``): query position p sees keys p - w < q
<= p. A block whose every key is at least w before every query is skipped (it still travels the
ring: later ranks may need it), a block whose every key is within w of every query is computed
as before, and a block the window's edge crosses gets a band mask: with the block's first query
at global position Q and first key at K, key j is hidden from query i when j - i <= Q - K - w.
Those edge blocks take the reference path (``block_attention.py``: explicit [c x c] scores in
fp32), as no fused kernel here takes a mask; at most two per query chunk cross an edge.

**Soft-capped scores** (``softcap``, ``model.attention_softcap``): the merge is unchanged, since
each block's partial softmax is over its capped scores; every block takes the reference path, whose
backward carries dS through the cap's slope.

**Attention sinks** (``sinks``, ``model.attention_sinks``): a sink is one more column of every row's
softmax, with a zero value, so it is merged once after the ring like one more block with no output:
lse' = logaddexp(lse, sink), out' = exp(lse - lse') out. The backward runs as before with the final
out' and lse' (P = exp(S - lse') are then the sink softmax's columns), and the sink's gradient is
its column's dS = -exp(sink - lse') rowsum(dO * O), summed over the rows: summed over the CP ranks
(each holds its own rows) with the other dense gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from meshlm.parallel.collectives import all_gather_into_, send_and_receive
from meshlm.models.block_attention import accumulation_dtype, block_backward, block_forward
from meshlm.models.sink_attention import merged_sink, sink_gradient
from meshlm.parallel.context.chunks import chunk_owner, paired_chunks

KV_TAG, GRAD_TAG = 0, 1
"""Point-to-point tags: the K/V blocks and their gradient accumulators travel separately."""


# --- which blocks a query chunk attends to -----------------------------------------------------------

def attention_blocks(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...]) -> list[tuple[int, int, bool]]:
    """(query slot, key slot, causal) for every pair of chunks that interact: key chunk before the
    query chunk (full block) or the same chunk (causal block); later key chunks are skipped."""
    return [(q_slot, k_slot, key == query)
            for q_slot, query in enumerate(query_chunks) for k_slot, key in enumerate(key_chunks) if key <= query]


# --- merging blocks ------------------------------------------------------------------------------------

def merge_into(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
               block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's partial result into rows ``rows`` of (out, lse), in place."""
    old_lse = lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    divisor = new_lse.masked_fill(new_lse == float("-inf"), 0)  # a row no key has reached yet stays 0
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old_lse - divisor).unsqueeze(-1)
                         + block_out * torch.exp(block_lse - divisor).unsqueeze(-1))
    lse[..., rows] = new_lse


# --- the ring ------------------------------------------------------------------------------------------

class Ring:
    """The CP group as a ring: rank i sends to i+1 and receives from i-1 (global ranks)."""

    def __init__(self, context, layout=paired_chunks):
        self.size, self.rank, self.layout, self.group = context.cp_size, context.cp_rank, layout, context.cp_group
        ranks = context.cp_ranks
        self.next_rank, self.previous_rank = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def chunks(self, step: int) -> tuple[int, ...]:
        """The chunks of the K/V block this rank holds at ``step`` (its own at step 0)."""
        return self.layout((self.rank - step) % self.size, self.size)

    def start_pass(self, tensor: torch.Tensor, tag: int):
        """Send ``tensor`` to the next rank and receive the previous rank's into a new buffer;
        returns (buffer, requests) -- wait on the requests before reading the buffer."""
        received = torch.empty_like(tensor)
        requests = send_and_receive([(tensor, self.next_rank, tag)], [(received, self.previous_rank, tag)], self.group)
        return received, requests


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, sinks, context, layout, chunk_documents, window, scale, softcap):
        ring = Ring(context, layout)
        scale, slot = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale, query.shape[2] // 2
        wide = accumulation_dtype(query.dtype)
        out = torch.zeros(query.shape, dtype=wide, device=query.device)
        lse = torch.full(query.shape[:-1], float("-inf"), dtype=wide, device=query.device)
        kv = torch.stack((key, value)).contiguous()
        for step in range(ring.size):
            incoming, requests = ring.start_pass(kv, KV_TAG) if step < ring.size - 1 else (None, [])
            for batch, rows, cols, causal, band in _block_slices(ring, step, slot, chunk_documents, window):
                block_out, block_lse = block_forward(query[batch, :, rows], kv[0][batch, :, cols], kv[1][batch, :, cols],
                                                     causal, scale, band, softcap)
                merge_into(out[batch], lse[batch], rows, block_out, block_lse)
            _wait(requests)
            kv = incoming
        if sinks is not None:  # one more column of every row's softmax, with no value
            out, lse = merged_sink(out, lse, sinks)
        output = out.to(query.dtype)  # the same tensor when the run is fp32 or fp64
        ctx.save_for_backward(query, key, value, output, lse, sinks)
        ctx.ring, ctx.scale, ctx.chunk_documents, ctx.window, ctx.softcap = ring, scale, chunk_documents, window, softcap
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse, sinks = ctx.saved_tensors
        ring, scale, slot = ctx.ring, ctx.scale, query.shape[2] // 2
        grad_query = torch.zeros(query.shape, dtype=lse.dtype, device=query.device)
        kv = torch.stack((key, value)).contiguous()
        grad_kv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)  # dK/dV of the block held
        for step in range(ring.size):
            incoming, requests = ring.start_pass(kv, KV_TAG) if step < ring.size - 1 else (None, [])
            for batch, rows, cols, causal, band in _block_slices(ring, step, slot, ctx.chunk_documents, ctx.window):
                dq, dk, dv = block_backward(grad_output[batch, :, rows], query[batch, :, rows], kv[0][batch, :, cols],
                                            kv[1][batch, :, cols], output[batch, :, rows], lse[batch, :, rows],
                                            causal, scale, band, ctx.softcap)
                grad_query[batch, :, rows] += dq
                grad_kv[0][batch, :, cols] += dk
                grad_kv[1][batch, :, cols] += dv
            outgoing = grad_kv  # on with its block; home, complete, after cp hops
            grad_kv, grad_requests = ring.start_pass(outgoing, GRAD_TAG)
            _wait(requests)
            _wait(grad_requests)
            kv = incoming
        grad_sinks = None if sinks is None else sink_gradient(grad_output, output, lse, sinks)
        return (grad_query.to(query.dtype), grad_kv[0].to(key.dtype), grad_kv[1].to(value.dtype), grad_sinks, None,
                None, None, None, None, None)


EVERY_SEQUENCE = slice(None)


def _block_slices(ring: Ring, step: int, slot: int, chunk_documents: dict[int, list[list[int]]] | None,
                  window: int | None = None) -> list[tuple[slice, slice, slice, bool, int | None]]:
    """(sequences of the batch, query rows, key rows, causal, band) of the blocks this rank computes
    at ``step``; ``slot`` tokens a chunk. With packed documents, the per-document sub-blocks; with a
    sliding ``window``, only the blocks it reaches, and a band (``window_band``) where its edge
    crosses one."""
    blocks = []
    query_chunks, key_chunks = ring.chunks(0), ring.chunks(step)

    def add(batch: slice, q_first: int, q_stop: int, k_first: int, k_stop: int, q_slot: int, k_slot: int,
            causal: bool) -> None:
        band = None
        if window is not None:
            reach = window_band(query_chunks[q_slot] * slot + q_first, key_chunks[k_slot] * slot + k_first,
                                q_stop - q_first, k_stop - k_first, window)
            if reach is SKIP:
                return
            band = reach
        q_start, k_start = q_slot * slot, k_slot * slot
        blocks.append((batch, slice(q_start + q_first, q_start + q_stop), slice(k_start + k_first, k_start + k_stop),
                       causal, band))

    for q_slot, k_slot, causal in attention_blocks(query_chunks, key_chunks):
        if chunk_documents is None:
            add(EVERY_SEQUENCE, 0, slot, 0, slot, q_slot, k_slot, causal)
            continue
        per_sequence = zip(chunk_documents[query_chunks[q_slot]], chunk_documents[key_chunks[k_slot]])
        for sequence, (query_ids, key_ids) in enumerate(per_sequence):
            key_spans = _document_spans(key_ids)
            for document, (q_first, q_stop) in _document_spans(query_ids).items():
                if document in key_spans:
                    k_first, k_stop = key_spans[document]
                    add(slice(sequence, sequence + 1), q_first, q_stop, k_first, k_stop, q_slot, k_slot, causal)
    return blocks


SKIP = object()
"""``window_band``'s answer for a block the window does not reach."""


def window_band(query_start: int, key_start: int, queries: int, keys: int, window: int):
    """How a sliding ``window`` cuts a block of ``queries`` rows from global position ``query_start``
    against ``keys`` keys from ``key_start`` (keys before queries or the same positions): None
    when every key is within the window of every query, ``SKIP`` when none is, else the band: key
    j is hidden from query i when j - i <= band (query_start + i - key_start - j >= window)."""
    band = query_start - key_start - window
    if -(queries - 1) > band:  # even the farthest pair (last query, first key) is within the window
        return None
    if keys - 1 <= band:  # even the nearest pair (first query, last key) is out of it
        return SKIP
    return band


def _document_spans(ids: list[int]) -> dict[int, tuple[int, int]]:
    """document id -> (first, stop) of its run in a chunk's (non-decreasing) ids."""
    spans = {}
    for index, document in enumerate(ids):
        first = spans.get(document, (index, index))[0]
        spans[document] = (first, index + 1)
    return spans


def chunk_document_ids(document_ids: torch.Tensor, context, layout=paired_chunks) -> dict[int, list[list[int]]]:
    """Every chunk's document ids (global chunk index -> per sequence a list), from this rank's
    ids [b, 2c]: one all-gather of the integers over the CP group."""
    gathered = document_ids.new_empty((context.cp_size, *document_ids.shape))
    all_gather_into_(gathered.flatten(0, 1), document_ids.contiguous(), context.cp_group)
    slot = document_ids.shape[1] // 2
    by_chunk = {}
    for chunk in range(2 * context.cp_size):
        owner, position = chunk_owner(chunk, context.cp_size, layout)
        by_chunk[chunk] = gathered[owner, :, position * slot:(position + 1) * slot].tolist()
    return by_chunk


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context,
                   layout=paired_chunks, document_ids: torch.Tensor | None = None,
                   window: int | None = None, scale: float | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries [b, heads, 2c, d] over the whole sequence, whose
    keys/values [b, kv_heads, 2c, d] are spread over the CP group as ``layout`` says (each rank's
    two chunks of c tokens, concatenated). Returns [b, heads, 2c, d], equal to the rows of full
    causal attention at this rank's positions. Collective over the CP group. ``document_ids``
    [b, 2c] (this rank's tokens' packed documents): attend within each document only. ``window``:
    each query sees only itself and the window - 1 positions before it. ``scale``: the factor on
    q k^T (None: 1/sqrt(d)). ``softcap``: the scores capped at it (every block then takes the
    reference path). ``sinks`` [heads]: each head's sink logit in its softmax denominators (applied
    once the blocks are merged; ``meshlm/models/explicit_attention.py``). Value heads narrower or
    wider than the query and key heads (multi-head latent attention's d_v) travel zero-padded to the
    wider width, which changes no score and no output channel; the output has the values' width."""
    if query.shape[2] % 2 or key.shape[2] != query.shape[2]:
        raise ValueError(f"ring attention needs two equal chunks of queries and keys per rank, got "
                         f"{query.shape[2]} queries and {key.shape[2]} keys")
    chunk_documents = None if document_ids is None else chunk_document_ids(document_ids, context, layout)
    key_width, value_width = key.shape[-1], value.shape[-1]
    if key_width == value_width:
        return _RingAttention.apply(query, key, value, sinks, context, layout, chunk_documents, window, scale, softcap)
    scale = key_width ** -0.5 if scale is None else scale  # of the unpadded heads
    width = max(key_width, value_width)
    query, key, value = (tensor if tensor.shape[-1] == width else F.pad(tensor, (0, width - tensor.shape[-1]))
                         for tensor in (query, key, value))  # only the narrower side is copied
    out = _RingAttention.apply(query, key, value, sinks, context, layout, chunk_documents, window, scale, softcap)
    return out[..., :value_width]


class RingAttentionCore:
    """The attention core of ``SelfAttention`` under context parallelism (set by
    ``apply_context_parallel``): same call as ``attention_core``, without padding masks or caches."""

    def __init__(self, context, layout=paired_chunks):
        self.context, self.layout = context, layout

    def __call__(self, query, key, value, key_mask=None, document_ids=None, window=None, scale=None, softcap=None,
                 sinks=None):
        if key_mask is not None or key.shape[2] != query.shape[2]:
            raise ValueError("context parallelism runs training forwards only: no padding mask and no KV cache "
                             "(generate with a single-process or tensor-parallel model).")
        return ring_attention(query, key, value, self.context, self.layout, document_ids, window, scale, softcap,
                              sinks)


__all__ = ["Ring", "RingAttentionCore", "SKIP", "attention_blocks", "chunk_document_ids", "merge_into",
           "ring_attention", "window_band"]
