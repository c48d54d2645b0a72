"""FLOP formulas for ops torch 2.13's ``FlopCounterMode`` table lacks (they would count as 0),
with the conventions torch uses for their siblings; pass as ``custom_mapping``.

- the CPU flash-attention kernels (``_scaled_dot_product_flash_attention_for_cpu`` and its
  backward): torch's own SDPA formulas (``sdpa_flop_count``: two full-square batched matmuls,
  whatever the causal mask; the backward five, one of them the recomputed scores);
- ``_grouped_mm`` (the MoE experts' grouped GEMM): 2 x the multiply-adds of the groups' GEMMs.

Used by tests/models/test_flops.py and bench/context_parallel_balance.py.
"""

import math

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _per_query_head(query, *shapes):
    """Key/value shapes with the query's head count: grouped-query attention does the matmuls of
    one query head against its shared K/V head per query head (torch 2.11's formulas refuse
    unequal head counts; torch 2.13's count them this way)."""
    return [(shape[0], query[1], *shape[2:]) for shape in shapes]


def _cpu_sdpa_forward(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, *_per_query_head(query, key, value))


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, *_per_query_head(query, key, value))


def _grouped_mm(a, b, *args, out_shape=None, **kwargs):
    if len(a) == 2 and len(b) == 2:  # weight gradient: the contraction (rows) is split into groups
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


MISSING_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
    aten._grouped_mm: _grouped_mm,
}
