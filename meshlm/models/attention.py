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

Attention dropout (``model.attention_dropout``, training only) zeroes attention probabilities
with a mask keyed by each probability's global coordinates -- sample, head, query and key
positions (``meshlm/models/dropout.py``) -- so it does not depend on how heads or tokens are
split. SDPA's built-in dropout draws from a stateful generator, so with dropout on the core is
``attention_with_dropout``, an explicit softmax (it materializes the [t, s] probabilities).

**Packed documents kept apart** (``context.document_ids``, ``data.document_boundaries``): a query
attends only to earlier keys of its own document, a block-diagonal causal mask. It is never
built as a dense [s, s] mask: ``document_attention`` runs one causal SDPA call per document span
(rows with the same spans share the calls), so the memory and the work are those of attending
over each document on its own -- sum of length^2, not seq^2. The no-documents path is unchanged.
Measured on CPU (torch 2.13, one thread, 4 heads of 32, 8192 tokens in 16 documents, forward and
backward): 0.29 s and no extra memory, against 2.5 s for causal attention over the whole row and
4.7 s plus 300 MB for SDPA with the dense mask. (FlexAttention's block masks would do the same in
one kernel on GPUs; in torch 2.13 it has no backward on CPU, so it is not used here.)

**Sliding-window attention** (``model.sliding_window`` w; Beltagy et al. 2020, "Longformer";
Child et al. 2019; Mistral 7B, Jiang et al. 2023): a query attends to itself and the w - 1 keys
before it, so a layer's work and KV reads grow with w, not with the sequence, while stacked layers
still pass information further back (L layers reach L (w - 1) tokens). Which attention blocks
slide and which stay full is ``model.sliding_window_pattern`` (Gemma 2 alternates, Gemma 3 has
five sliding to one full). The key at position j is visible from query i when 0 <= i - j < w:
the rule of transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``), so
imported Mistral and Qwen checkpoints compute what they were trained to. ``windowed_attention``
computes it without an [s, s] mask: the sequence is cut into chunks of w queries, and chunk a
attends to the 2w keys of chunks a - 1 and a under one [w, 2w] band mask shared by every chunk
(key j of the pair is visible from query i when i < j <= i + w), all chunks in one SDPA call with
the chunks folded into the batch; chunk 0 has no predecessor and is plain causal attention. That
is 2 s w scores instead of s^2 (a win once s > 4w; a sequence no longer than w is plain causal
attention). Packed documents run it per document span; a KV cache reads only the last
t + w - 1 keys. Whole sequences without a cap take another form of the same chunking where a
fused kernel returning each row's log-sum-exp takes the inputs (``block_attention.fused_kernel``:
CPU flash; CUDA flash and memory-efficient, head dims up to 128): each chunk's two parts are two
*causal* blocks -- its own keys, and the previous chunk's with both chunks' rows reversed --
merged by their lse (``sink_attention.fused_windowed_attention``), so no band mask is built, the
kernels skip what the mask would have hidden, and half the bytes are kept for backward. On a GPU
always; on the CPU, whose flash kernel is slow on small blocks, from windows of
``FUSED_WINDOW_MIN_ON_CPU`` on. (Its second block scores (w - 1)^2 pairs a chunk where the band
scores w^2; the FLOP count keeps the band's, within 1/w.)

**Soft-capped scores and attention sinks** (``model.attention_softcap``, Gemma 2;
``model.attention_sinks``, gpt-oss): every path above makes its SDPA call through
``scaled_dot_product``, which with a cap or sinks runs the explicit, query-chunked core of
``meshlm/models/explicit_attention.py`` under the same mask instead, so windows, documents, padding
and the cache keep their structure. Causal attention with sinks over whole sequences, with or
without a window, runs the fused kernels too, the sink merged after the rows' lse
(``meshlm/models/sink_attention.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.cache import AttentionCache
from meshlm.models.dropout import apply_keep_mask, attention_keep_mask, dropout_site, required_key
from meshlm.models.fused_linear import project_together
from meshlm.models.init import constant
from meshlm.models.lora import adapted, lora_coordinates
from meshlm.models.norms import HeadNorm, RMSNorm
from meshlm.models.rope import RopeScaling, RotaryEmbedding, apply_rotary
from meshlm.models.sink_attention import fused_sink_attention, fused_sinks_supported, fused_windowed_attention
from meshlm.models.explicit_attention import explicit_attention
from meshlm.models.softcap import soft_cap


def attention_core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   key_mask: torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                   window: int | None = None, scale: float | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [b, heads, t, d] over key/value [b, kv_heads, s, d], s >= t.

    The t queries are the last t of the s positions (s > t while decoding with a cache).
    ``key_mask`` [b, s] (True = real token) hides padded keys. A query may always see itself,
    so that a padded query row is never fully masked (its output is unused but stays finite).
    ``document_ids`` [b, s] (t = s, no key mask): attend within each document only.
    ``window``: each query sees only itself and the window - 1 positions before it (by key slot,
    which is the position where padding is on the left, as generation pads); None: every earlier one.
    ``scale``: the factor on q k^T (``model.attention_scale``); None: 1/sqrt(d).
    ``softcap``: scores become softcap * tanh(score / softcap) (``model.attention_softcap``,
    ``meshlm/models/softcap.py``); None: uncapped.
    ``sinks`` [heads]: each head's sink logit joins its softmax denominators (``model.attention_sinks``,
    ``meshlm/models/explicit_attention.py``); None: none.
    """
    query_len, key_len = query.shape[2], key.shape[2]
    head_sinks = None if sinks is None else sinks[:, None]  # a logit per row of each head's [t, s] scores
    if window is not None and window >= key_len:
        window = None  # every query sees all its keys anyway
    if document_ids is not None:
        if key_mask is not None or query_len != key_len:
            raise ValueError("attention over packed documents takes whole sequences without padding or a cache")
        return document_attention(query, key, value, document_ids, window, scale, softcap, sinks)
    if key_mask is None and query_len == key_len:
        return causal_attention(query, key, value, window, scale, softcap, sinks)
    if window is not None:  # keys before the first query's window are never read
        first = max(key_len - query_len - window + 1, 0)
        key, value = key[:, :, first:], value[:, :, first:]
        key_mask = None if key_mask is None else key_mask[:, first:]
        key_len = key.shape[2]
    if query_len == 1 and key.shape[1] == 1 < query.shape[1]:
        # decoding with one key/value head for every query head (MQA; latent attention's cache): the
        # heads are the rows of one head's attention -- one GEMM over the keys, none repeated per head
        # (values as they are: a few rows of scores, and padding would copy the whole cache every step)
        allowed = None if key_mask is None else allowed_keys(1, key_len, key_mask, query.device, window=window)
        out = scaled_dot_product(query.transpose(1, 2), key, value, allowed, scale=scale, softcap=softcap,
                                 pad_values=False, sinks=sinks)  # the heads are the rows here
        return out.transpose(1, 2)
    if key_mask is None and query_len == 1:  # decoding: the newest position sees every key left, no mask to build
        return scaled_dot_product(query, key, value, scale=scale, softcap=softcap, sinks=head_sinks)
    allowed = allowed_keys(query_len, key_len, key_mask, query.device, window=window)
    return scaled_dot_product(query, key, value, allowed, scale=scale, softcap=softcap, sinks=head_sinks)


def scaled_dot_product(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                       softcap: float | None = None, pad_values: bool = True,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (grouped KV heads allowed), or with ``softcap`` or ``sinks``
    (a logit per row, broadcastable to [b, heads, t]) its explicit counterpart with capped scores or
    sinks in the denominators (``explicit_attention``): the one call every path here makes.

    Value heads narrower than the query and key heads (multi-head latent attention's) are
    zero-padded to their width (unless ``pad_values`` is false) and the output's padded channels
    (zeros) cut off again: the fused kernels want one width for q, k and v, and without one SDPA
    would take its math path, which keeps the [t, s] probabilities. The scale is q's width's either way."""
    if softcap is not None or sinks is not None:
        return explicit_attention(query, key, value, attn_mask, is_causal, scale, softcap, sinks)
    value_width = value.shape[-1]
    if pad_values and value_width < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - value_width))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out if out.shape[-1] == value_width else out[..., :value_width]


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     window: int | None = None, scale: float | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of s queries over their own s keys: whole, or within ``window`` (``sinks``:
    [heads], as ``attention_core``'s)."""
    head_sinks = None if sinks is None else sinks[:, None]
    whole = window is None or window >= query.shape[2]
    fused = fused_core_applies(softcap is not None, value.shape[-1] == query.shape[-1], sinks is not None,
                               None if whole else window, query.device.type) and fused_sinks_supported(query, key)
    if fused and not whole:  # two causal blocks per chunk of w queries, merged by lse (and the sinks)
        return fused_windowed_attention(query, key, value, window, scale, sinks)
    if fused:  # the sinks merged into a fused kernel's rows
        return fused_sink_attention(query, key, value, sinks, scale)
    if whole:
        return scaled_dot_product(query, key, value, is_causal=True, scale=scale, softcap=softcap, sinks=head_sinks)
    return windowed_attention(query, key, value, window, scale, softcap, sinks)


FUSED_WINDOW_MIN_ON_CPU = 1024
"""The smallest sliding window the CPU runs as two causal blocks a chunk on its flash kernel
(``fused_windowed_attention``) rather than as ``windowed_attention``'s band-masked chunks. Both
keep one output and lse per row, the fused form about half the bytes for backward (no padded
copies, no chunk pairs), but the CPU's flash kernel is slow on small blocks: measured (``python
-m bench.sliding_window``, fp32, 8 heads over 2 KV heads of 64, a 2-core CPU, medians of 9) at
0.71x-0.83x the band core's speed for windows of 256, 0.81x-0.90x for 384 and 512, and 1.20x-1.28x
for 1024, at 2048 to 8192 tokens. Other devices run every window fused (there the band mask
keeps SDPA off its flash and cuDNN kernels); sinks run fused whatever the window."""


def fused_window_applies(window: int, device_type: str) -> bool:
    """Whether a sliding ``window`` without sinks runs fused on ``device_type`` (``FUSED_WINDOW_MIN_ON_CPU``)."""
    return device_type != "cpu" or window >= FUSED_WINDOW_MIN_ON_CPU


def fused_core_applies(softcap: bool, equal_widths: bool, sinks: bool, window: int | None, device_type: str) -> bool:
    """Whether ``causal_attention`` runs sinks or a sliding ``window`` (None: the whole sequence) on a
    fused kernel merged by log-sum-exp (``sink_attention.py``), given a kernel that takes the
    tensors: not with soft-capped scores, only where values are as wide as queries and keys, and
    for a window without sinks only where ``fused_window_applies``. The memory estimate follows the
    same rule (``meshlm/training/memory_estimate.py``)."""
    if softcap or not equal_widths:
        return False
    return sinks or (window is not None and fused_window_applies(window, device_type))


def window_chunks(seq_len: int, window: int) -> int:
    """How many chunks of ``window`` queries ``windowed_attention`` cuts ``seq_len`` tokens into
    (the last one zero-padded): one when the whole sequence fits in the window."""
    return 1 if window >= seq_len else -(-seq_len // window)


def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int,
                       scale: float | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Sliding-window causal attention of query [b, heads, s, d] over key/value [b, kv_heads, s, d]
    (query i sees keys i - window + 1 .. i), chunk by chunk with one band mask (the module docstring)."""
    batch, heads, length, head_dim = query.shape
    chunks = window_chunks(length, window)
    padding = chunks * window - length
    if padding:  # padded keys come after every real query, so no real query sees them
        query, key, value = (F.pad(tensor, (0, 0, 0, padding)) for tensor in (query, key, value))
    head_sinks = None if sinks is None else sinks[:, None]
    first = scaled_dot_product(query[:, :, :window], key[:, :, :window], value[:, :, :window], is_causal=True,
                               scale=scale, softcap=softcap, sinks=head_sinks)

    def chunked(tensor: torch.Tensor) -> torch.Tensor:  # [b, n, c, d] per head -> [b, heads, n, c, d]
        return tensor.unflatten(2, (chunks, window))

    def folded(tensor: torch.Tensor) -> torch.Tensor:  # [b, heads, m, c, d] -> [b * m, heads, c, d]
        return tensor.transpose(1, 2).flatten(0, 1)

    key_chunks, value_chunks = chunked(key), chunked(value)
    pair_keys = torch.cat((key_chunks[:, :, :-1], key_chunks[:, :, 1:]), dim=3)  # chunks a - 1 and a
    pair_values = torch.cat((value_chunks[:, :, :-1], value_chunks[:, :, 1:]), dim=3)
    rows = torch.arange(window, device=query.device)[:, None]
    columns = torch.arange(2 * window, device=query.device)[None, :]
    band = (columns > rows) & (columns <= rows + window)  # [w, 2w]: 0 <= (w + i) - j < w
    rest = scaled_dot_product(folded(chunked(query)[:, :, 1:]), folded(pair_keys), folded(pair_values), band,
                              scale=scale, softcap=softcap, sinks=head_sinks)
    rest = rest.unflatten(0, (batch, chunks - 1)).transpose(1, 2).flatten(2, 3)
    return torch.cat((first, rest), dim=2)[:, :, :length]


def document_spans(document_ids: torch.Tensor) -> list[tuple[tuple[int, int], ...]]:
    """Per row of ``document_ids`` [b, s] (non-decreasing), its documents as (start, stop) spans."""
    rows, columns = (document_ids[:, 1:] != document_ids[:, :-1]).nonzero(as_tuple=True)
    starts = [[0] for _ in range(document_ids.shape[0])]
    for row, column in zip(rows.tolist(), columns.tolist()):  # one host sync for the whole batch
        starts[row].append(column + 1)
    length = document_ids.shape[1]
    return [tuple(zip(row_starts, row_starts[1:] + [length])) for row_starts in starts]


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       document_ids: torch.Tensor, window: int | None = None,
                       scale: float | None = None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each document of ``document_ids`` [b, s]: one causal SDPA call per
    document span (``causal_attention``, within ``window`` if given), over all the rows that share
    the same spans (the module docstring)."""
    rows_by_spans: dict[tuple, list[int]] = {}
    for row, spans in enumerate(document_spans(document_ids)):
        rows_by_spans.setdefault(spans, []).append(row)
    outputs, order = [], []
    for spans, rows in rows_by_spans.items():
        if len(rows) == query.shape[0]:
            q, k, v = query, key, value
        else:
            index = torch.tensor(rows, device=query.device)
            q, k, v = query.index_select(0, index), key.index_select(0, index), value.index_select(0, index)
        pieces = [causal_attention(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], window, scale,
                                   softcap, sinks)
                  for start, stop in spans]
        outputs.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
        order += rows
    if len(outputs) == 1:
        return outputs[0]
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(outputs).index_select(0, inverse.to(query.device))


def allowed_keys(query_len: int, key_len: int, key_mask: torch.Tensor | None, device,
                 document_ids: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to: [t, s], or [b, 1, t, s] with a key mask or documents
    (see ``attention_core``)."""
    query_positions = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    key_positions = torch.arange(key_len, device=device)[None, :]
    allowed = key_positions <= query_positions  # [t, s]
    if window is not None:
        allowed = allowed & (key_positions > query_positions - window)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].bool()
        allowed = allowed | (key_positions == query_positions)
    if document_ids is not None:
        allowed = allowed & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    return allowed


def attention_with_dropout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           key_mask: torch.Tensor | None, keep: torch.Tensor, p: float,
                           document_ids: torch.Tensor | None = None, window: int | None = None,
                           scale: float | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``attention_core`` with dropout on the probabilities: softmax(q k^T / sqrt(d) + mask), then
    the ``keep`` mask [b, heads, t, s] and the 1/(1-p) scale, then times v. (It holds [t, s]
    probabilities anyway, so packed documents are a mask here.)"""
    group = query.shape[1] // key.shape[1]  # GQA: query head h reads KV head h // group
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query @ key.transpose(-2, -1)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    allowed = allowed_keys(query.shape[2], key.shape[2], key_mask, query.device, document_ids, window)
    scores = scores.float() if softcap is None else soft_cap(scores.float(), softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probabilities = torch.softmax(scores, dim=-1)
    else:  # the sink is one more column, with no value: dropped after the softmax
        sink_column = sinks.float()[:, None, None].expand(*scores.shape[:-1], 1)
        probabilities = torch.softmax(torch.cat((scores, sink_column), dim=-1), dim=-1)[..., :-1]
    return apply_keep_mask(probabilities.to(value.dtype), keep, p) @ value


def query_position_scale(positions: torch.Tensor, beta: float, length: int) -> torch.Tensor:
    """[b, 1, t, 1] fp32: 1 + beta * ln(1 + floor(p / length)) for the positions p [b, t] of the
    queries (``model.query_scale_beta``; Llama 4's attention temperature tuning). A temperature on
    each query's scores, exact under every layout: it reads the same global positions RoPE does."""
    steps = torch.floor(positions.to(torch.float32) / length)
    return (1.0 + beta * torch.log1p(steps))[:, None, :, None]


def qk_norms(config, heads: int, kv_heads: int, head_dim: int) -> tuple[nn.Module | None, nn.Module | None]:
    """The query and key norms ``config``'s ``qk_norm*`` fields ask for, (None, None) without QK-norm:
    one RMSNorm over all heads' channels (scope 'all'), else a ``HeadNorm`` of each head."""
    if not config.qk_norm:
        return None, None
    if config.qk_norm_scope == "all":
        return (RMSNorm(heads * head_dim, config.norm_eps, config.norm_zero_centered),
                RMSNorm(kv_heads * head_dim, config.norm_eps, config.norm_zero_centered))
    return tuple(HeadNorm(config.qk_norm_type, head_dim, config.norm_eps, count if config.qk_norm_per_head else None,
                          config.norm_zero_centered, config.qk_norm_bias) for count in (heads, kv_heads))


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
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.resolved_attention_output_bias)
        self.qk_norm_all = config.qk_norm and config.qk_norm_scope == "all"
        """QK-norm over all heads of the projection at once (OLMo 2), not over each head."""
        self.qk_norm_after_rope = config.qk_norm_after_rope
        """QK-norm of the rotated heads (Hunyuan), not before RoPE."""
        self.q_norm, self.k_norm = qk_norms(config, self.num_heads, self.num_kv_heads, self.head_dim)
        self.init_core(config, layer_index)

    def init_core(self, config, layer_index: int) -> None:
        """What every attention block holds besides its projections (latent attention's too): the
        rotary table of its ``config.rotary_dim`` channels, the core and its settings."""
        self.rotary = (RotaryEmbedding(config.rotary_dim, config.rope_theta, RopeScaling.from_config(config))
                       if config.position_embedding == "rope" else None)
        self.core = attention_core
        """The attention core; context parallelism replaces it with ring attention over its CP group
        (``meshlm.parallel.context.ring_attention.RingAttentionCore``, same call)."""
        self.recompute_core = False
        """Selective recomputation (set by training.recompute): keep only q, k, v for backward and
        recompute scores, softmax and the weighted sum from them."""
        self.scale = config.attention_scale
        """The factor on q k^T (``model.attention_scale``), None for 1/sqrt(head_dim)."""
        self.query_scale_beta, self.query_scale_length = config.query_scale_beta, config.query_scale_length
        """``model.query_scale_beta`` and its length: the queries' scale by position (``query_position_scale``)."""
        self.softcap = config.attention_softcap
        """Soft-capping of the scores (``model.attention_softcap``), None for none."""
        self.window = config.sliding_window
        """Sliding window (tokens a query sees, itself included) of this block, None for full causal
        attention (``config`` is the block's own: ``ModelConfig.for_block``)."""
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        """[heads]: each query head's sink logit (``model.attention_sinks``), None without sinks; under
        tensor parallelism the rank's heads' (split with them)."""
        self.dropout_p = config.attention_dropout
        self.dropout_site = dropout_site("attention_probs", layer_index)
        self.lora_dropout = config.lora_dropout
        """``model.lora_dropout``: whether the projections' adapters need the tokens' coordinates."""

    def init_rules(self, config) -> dict:
        """The sinks start at 0: each row's denominator gains exp(0) = 1, as if one more key scored 0."""
        return {"sinks": constant(0.0)}

    @property
    def head_offset(self) -> int:
        """Global index of this module's first query head (tensor parallelism holds a slice)."""
        return 0

    def project(self, x: torch.Tensor, rotary_positions: torch.Tensor,
                rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, coordinates=None):
        """Queries, keys and values [b, heads, t, head_dim] of x [b, t, hidden], QK-normed and rotated
        (by ``rotary_cos_sin`` when given, the forward's shared table, else by ``rotary_positions``;
        ``coordinates``: x's tokens', for the adapters' dropout)."""
        batch, seq, _ = x.shape
        layers = (self.q_proj, self.k_proj, self.v_proj)
        query, key, value = project_together(x, layers, coordinates)  # one GEMM where it can
        if self.qk_norm_all:
            query, key = self.q_norm(query), self.k_norm(key)
        if self.rotary is not None and (self.q_norm is None or self.qk_norm_after_rope or query.dtype != torch.float32):
            # RoPE makes new queries and keys, so the values take storage of their own: a slice of the
            # fused output, saved for the attention's backward, would keep the queries and keys
            # before RoPE alive with it (a no-op when unfused; without RoPE all three are the slices;
            # an fp32 QK-norm saves its input, the slices themselves, so there the copy would only add)
            value = value.contiguous()
        query, key, value = (part.view(batch, seq, -1, self.head_dim).transpose(1, 2) for part in (query, key, value))
        if self.q_norm is not None and not self.qk_norm_all and not self.qk_norm_after_rope:
            query, key = self.q_norm(query), self.k_norm(key)
        if self.rotary is not None:
            cos, sin = rotary_cos_sin if rotary_cos_sin is not None else self.rotary(rotary_positions)
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        if self.qk_norm_after_rope:  # Hunyuan's order
            query, key = self.q_norm(query), self.k_norm(key)
        if self.query_scale_beta:
            query = query * query_position_scale(rotary_positions, self.query_scale_beta,
                                                 self.query_scale_length).to(query.dtype)
        return query, key, value

    def cached_projection(self, x: torch.Tensor, rotary_positions: torch.Tensor,
                          rotary_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, coordinates=None):
        """What a forward with a KV cache attends with: queries, and the keys and values the cache
        holds (here ``project``'s; latent attention caches its latents instead)."""
        return self.project(x, rotary_positions, rotary_cos_sin, coordinates)

    @property
    def cached_scale(self) -> float | None:
        """The factor on the scores of ``cached_projection``'s queries and keys (None: 1/sqrt(width))."""
        return self.scale

    def from_cached_output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [b, heads, t, value width] from the core's over ``cached_projection``."""
        return out

    def prepare_context(self, context) -> None:
        """Called eagerly before the (possibly compiled) block: the forward's RoPE table, made once."""
        if self.rotary is not None:
            context.rotary_cos_sin(self.rotary)

    def forward(self, x: torch.Tensor, context) -> torch.Tensor:
        batch, seq, _ = x.shape
        rotary = None if self.rotary is None else context.rotary_cos_sin(self.rotary)
        cached = context.cache is not None
        project = self.cached_projection if cached else self.project
        coordinates = lora_coordinates(self, context)  # (None unless adapters drop their inputs)
        query, key, value = project(x, context.rotary_positions, rotary, coordinates)

        key_mask = context.token_mask
        if cached:
            state = context.cache.state_for(self.layer_index, AttentionCache, self.window)
            key, value = state.append(key, value)
            # the cache knows whether it ever saw padding: no look over every cached token per step;
            # a sliding-window cache holds the keys from slot ``start`` on
            key_mask = context.cache.token_mask[:, state.start:] if context.cache.has_padding else None
        core, dropout = self.core, ()
        if self.training and self.dropout_p > 0:
            core, dropout = attention_with_dropout, (self.dropout_keep_mask(context, key.shape[2]), self.dropout_p)
        options = {} if context.document_ids is None else {"document_ids": context.document_ids}
        if self.window is not None:
            options["window"] = self.window
        scale = self.cached_scale if cached else self.scale
        if scale is not None:
            options["scale"] = scale
        if self.softcap is not None:
            options["softcap"] = self.softcap
        if self.sinks is not None:
            options["sinks"] = self.sinks
        if self.recompute_core and torch.is_grad_enabled():
            out = torch.utils.checkpoint.checkpoint(core, query, key, value, key_mask, *dropout, use_reentrant=False,
                                                    **options)
        else:
            out = core(query, key, value, key_mask, *dropout, **options)
        if cached:
            out = self.from_cached_output(out)
        return adapted(self.o_proj, out.transpose(1, 2).reshape(batch, seq, -1), coordinates)

    def dropout_keep_mask(self, context, key_len: int) -> torch.Tensor:
        """The attention-dropout mask [b, heads, t, s] of this forward (training, no cache)."""
        if self.core is not attention_core:
            raise ConfigError("model.attention_dropout > 0 is not supported under context parallelism (ring "
                              "attention has no dropout); set model.attention_dropout=0 or parallel.cp=1.")
        positions = context.position_ids
        if positions.shape[1] != key_len:
            raise RuntimeError("attention dropout runs in training forwards without a cache only")
        heads = torch.arange(self.num_heads, device=positions.device) + self.head_offset
        return attention_keep_mask(required_key(context), self.dropout_site, heads, positions, positions,
                                   self.dropout_p)
