"""Tensor-parallel attention: each rank holds whole heads (Shoeybi et al. 2019, §3).

q/k/v are column-parallel (split by heads), o is row-parallel; the input enters the parallel
region once for q, k and v. KV heads are split when tp divides them; when there are fewer KV
heads than ranks (GQA), every rank keeps the full k/v projections and computes the rows of the
KV head its query heads share (``kv_rows_for_rank``). QK-norm weights act on local heads only,
so their gradients are partial (summed over TP after backward). Attention sinks
(``model.attention_sinks``), one logit per query head, are cut with the heads.

Multi-head latent attention (``meshlm/models/latent_attention.py``) splits its heads the same
way: the up-projections W_qb (or W_q) and W_kvb are column-parallel, o row-parallel. Its
down-projections W_qa, W_kva and the two latent norms stay whole on every rank, which computes the
latents of the whole sequence; their gradients are partial, as each rank's heads return only
their share of the latents' gradient.
"""

from __future__ import annotations

import torch

from meshlm.errors import ConfigError
from meshlm.models.attention import SelfAttention
from meshlm.models.latent_attention import LatentAttention
from meshlm.parallel.tensor.layers import (ColumnParallelLinear, ReplicatedRowsLinear, RowParallelLinear,
                                           column_parallel_input)
from meshlm.parallel.tensor.norms import ShardedRMSNorm, parallelize_head_norm
from meshlm.parallel.tensor.sharding import mark_partial_grad, shard_parameter


class TensorParallelSelfAttention(SelfAttention):
    """``SelfAttention`` over this rank's heads; the input is gathered once for q, k and v."""

    parallel_context = None

    @property
    def head_offset(self) -> int:
        return self.parallel_context.tp_rank * self.num_heads

    def forward(self, x: torch.Tensor, context) -> torch.Tensor:
        return super().forward(column_parallel_input(x, self.parallel_context), context)


class TensorParallelLatentAttention(TensorParallelSelfAttention, LatentAttention):
    """``LatentAttention`` over this rank's heads; the input is gathered once for both latents."""


def kv_rows_for_rank(num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> slice:
    """Rows of the full k/v projection that this rank's query heads read (GQA: query head h reads
    KV head h // (num_heads / num_kv_heads))."""
    local_heads, group = num_heads // tp_size, num_heads // num_kv_heads
    first = tp_rank * local_heads // group
    last = ((tp_rank + 1) * local_heads - 1) // group
    return slice(first * head_dim, (last + 1) * head_dim)


def check_whole_heads(heads: int, tp: int) -> None:
    if heads % tp:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by parallel.tp={tp}; each rank "
                          "must hold whole heads.")


@torch.no_grad()
def parallelize_latent_attention(attention: LatentAttention, context) -> None:
    """Split a latent attention block's heads over the TP group, in place (module docstring)."""
    check_whole_heads(attention.num_heads, context.tp_size)

    def replicated(layer: torch.nn.Linear) -> ReplicatedRowsLinear:
        return ReplicatedRowsLinear(layer, context, slice(0, layer.out_features), gather_input=False)

    if attention.q_proj is not None:
        attention.q_proj = ColumnParallelLinear.from_full(attention.q_proj, context, gather_input=False)
    else:
        attention.q_a_proj = replicated(attention.q_a_proj)
        attention.q_b_proj = ColumnParallelLinear.from_full(attention.q_b_proj, context, gather_input=False)
        mark_partial_grad(attention.q_a_norm)
    attention.kv_a_proj = replicated(attention.kv_a_proj)
    mark_partial_grad(attention.kv_a_norm)
    attention.kv_b_proj = ColumnParallelLinear.from_full(attention.kv_b_proj, context, gather_input=False)
    attention.o_proj = RowParallelLinear.from_full(attention.o_proj, context)
    if attention.sinks is not None:
        attention.sinks = shard_parameter(attention.sinks, 0, context, what="the attention sinks")
    attention.num_heads = attention.num_kv_heads = attention.num_heads // context.tp_size
    attention.__class__ = TensorParallelLatentAttention
    attention.parallel_context = context


@torch.no_grad()
def parallelize_attention(attention: SelfAttention, context) -> None:
    if isinstance(attention, LatentAttention):
        parallelize_latent_attention(attention, context)
        return
    tp, heads, kv_heads = context.tp_size, attention.num_heads, attention.num_kv_heads
    check_whole_heads(heads, tp)
    replicated_kv_heads = None
    attention.q_proj = ColumnParallelLinear.from_full(attention.q_proj, context, gather_input=False)
    if kv_heads % tp == 0:
        attention.k_proj = ColumnParallelLinear.from_full(attention.k_proj, context, gather_input=False)
        attention.v_proj = ColumnParallelLinear.from_full(attention.v_proj, context, gather_input=False)
        attention.num_kv_heads = kv_heads // tp
    elif tp % kv_heads == 0:
        if attention.qk_norm_all:
            raise ConfigError(f"model.qk_norm_scope=all normalizes all key heads together, and with "
                              f"model.num_kv_heads={kv_heads} < parallel.tp={tp} the key heads are replicated "
                              "over the ranks; use a parallel.tp that divides the KV heads (or qk_norm_scope=head).")
        rows = kv_rows_for_rank(heads, kv_heads, attention.head_dim, context.tp_rank, tp)
        attention.k_proj = ReplicatedRowsLinear(attention.k_proj, context, rows, gather_input=False)
        attention.v_proj = ReplicatedRowsLinear(attention.v_proj, context, rows, gather_input=False)
        attention.num_kv_heads = (rows.stop - rows.start) // attention.head_dim
        replicated_kv_heads = slice(rows.start // attention.head_dim, rows.stop // attention.head_dim)
    else:
        raise ConfigError(f"model.num_kv_heads={kv_heads} and parallel.tp={tp}: KV heads are either split "
                          "(kv_heads divisible by tp) or replicated (tp divisible by kv_heads); neither holds.")
    attention.o_proj = RowParallelLinear.from_full(attention.o_proj, context)
    attention.num_heads = heads // tp
    if attention.sinks is not None:  # one logit per query head: cut with the heads
        attention.sinks = shard_parameter(attention.sinks, 0, context, what="the attention sinks")
    if attention.qk_norm_all:  # a weight per channel: cut with the heads, statistics over the group
        attention.q_norm = ShardedRMSNorm.from_full(attention.q_norm, context)
        attention.k_norm = ShardedRMSNorm.from_full(attention.k_norm, context)
    else:
        parallelize_head_norm(attention.q_norm, context)
        parallelize_head_norm(attention.k_norm, context, replicated_kv_heads)
    attention.__class__ = TensorParallelSelfAttention
    attention.parallel_context = context


__all__ = ["TensorParallelLatentAttention", "TensorParallelSelfAttention", "kv_rows_for_rank",
           "parallelize_attention", "parallelize_latent_attention"]
