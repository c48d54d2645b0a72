"""One block of attention and its rows' log-sum-exp, through a fused kernel that returns both.

Ring attention (``meshlm/parallel/context/ring_attention.py``) cuts causal attention into blocks,
and attention sinks (``sink_attention.py``) merge their sink into a block's finished rows; both
need a block's output *and* its rows' log-sum-exp. Ring attention's blocks: c queries against the
c keys of one chunk, either whole (the key chunk comes earlier) or causal (the same chunk). A
block's result is a *partial* softmax: per query row, the output over its keys only and the
log-sum-exp lse = log sum_j exp(S_j) of its scores, so that blocks merge exactly afterwards.
This file computes one block, forward and backward, and nothing else.

**Forward.** FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", Alg. 1) computes softmax(S) V tile by tile in on-chip
memory and, for its own backward, also returns the row statistic L = m + log(l) -- exactly the
lse a merge needs. PyTorch exposes such kernels as aten ops that return (out, lse): on CPU
``_scaled_dot_product_flash_attention_for_cpu``; on CUDA ``_scaled_dot_product_flash_attention``
(FlashAttention-2, fp16/bf16) and ``_scaled_dot_product_efficient_attention`` (the memory-
efficient kernel of xFormers, after Rabe & Staats 2021, "Self-attention Does Not Need O(n^2)
Memory"; used here for fp32). The [c x c] scores exist only a tile at a time, inside the kernel;
the block runs in the run's dtype (bf16 stays bf16) while lse comes back in fp32 (fp64 for fp64).

**Backward with the final statistics.** The kernel's backward (FlashAttention-2, Alg. 2) takes
the output O and lse L of each query row, recomputes P = exp(S - L) tile by tile, forms
D = rowsum(dO * O), and returns

    dV = P^T dO     dS = P * (dO V^T - D)     dQ = dS K * scale     dK = dS^T Q * scale.

Give it, for a block's keys, the FINAL output and lse of the rows (merged over every block),
and P = exp(S_block - L_final) is exactly that block's columns of the full softmax, while D =
rowsum(dO * O_final) = sum over all keys of P * (dO V^T) is the full row's. So each block's
(dq, dk, dv) is its exact share of the full gradient, and the shares add up. This is how
FlashAttention-based ring attention is built (PyTorch's own context parallelism,
``torch.distributed.tensor.experimental``, calls the SDPA backward ops per block this way).
Nothing is stored between forward and backward but q, k, v, the output and lse.

**Grouped-query attention.** Query head h reads KV head h // (heads / kv_heads), as in
``F.scaled_dot_product_attention(enable_gqa=True)``. Not every kernel reads fewer KV heads (the
CPU kernel of older torch releases -- meshlm's floor is 2.5 -- and the CUDA memory-efficient
kernel index K/V by the query head), so the kernel is given K/V repeated to one head per query
head, for this block only: a copy the size of the block's queries, O(c*d), freed after the
call; dK/dV then sum over each group.

**Reference path.** ``reference_block_forward``/``reference_block_backward`` are the same
equations written as matmuls over the full [c x c] scores (the implementation ring attention
had before the fused kernels). They compute in fp32 (fp64 for fp64) and are used when no
fused kernel takes the block -- see ``fused_kernel`` -- and as the tests' reference. Blocks with
soft-capped scores (``model.attention_softcap``) take it too: no fused kernel applies a function to
the scores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from meshlm.models.softcap import soft_cap, soft_cap_slope

CPU_FLASH_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)
CUDA_EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CUDA_MAX_HEAD_DIM = 128
"""The CUDA kernels are used for head dims that are multiples of 8 up to this, a conservative
range; other head dims go to the reference path."""
EFFICIENT_LSE_ALIGNMENT = 32
"""The memory-efficient kernel's lse has its query dim padded to a multiple of this."""


# --- the fused kernels: (q, k, v) with as many KV heads as query heads --------------------------------
# The CPU kernel is what the tests run. The CUDA calls follow the ops' schemas (as of torch 2.13);
# on an H200 with torch 2.11 (2026-11-30) they matched the reference in the GPU tier (ring attention's
# blocks, attention sinks whole and windowed: tests/gpu/test_fused_paths.py).

def _cpu_flash_forward(query, key, value, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                      attn_mask=None, scale=scale)


def _cpu_flash_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, causal, attn_mask=None, scale=scale)


def _cuda_flash_forward(query, key, value, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False,
                                                                      scale=scale)
    return out, lse


def _cuda_flash_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    # Without dropout the kernel never reads the random-number state: placeholders do.
    no_rng = torch.empty((), dtype=torch.long)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out.contiguous(), query, key, value, out.contiguous(), lse.contiguous(), None, None,
        query.shape[2], key.shape[2], 0.0, causal, no_rng, no_rng, scale=scale)
    return grads[:3]


def _cuda_efficient_forward(query, key, value, causal: bool, scale: float):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, 0.0,
                                                                          causal, scale=scale)
    return out, lse[..., :query.shape[2]]  # drop the kernel's padding rows


def _cuda_efficient_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    padding = -lse.shape[-1] % EFFICIENT_LSE_ALIGNMENT  # the kernel reads lse in its padded shape
    no_rng = torch.empty((), dtype=torch.long)
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out.contiguous(), query, key, value, None, out.contiguous(), F.pad(lse, (0, padding)).contiguous(),
        no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale)
    return grads[:3]


class FusedKernel(NamedTuple):
    """A fused attention kernel returning lse: ``forward(q, k, v, causal, scale) -> (out, lse)`` and
    ``backward(grad_out, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``, q/k/v of equal heads."""

    name: str
    forward: Callable
    backward: Callable


CPU_FLASH = FusedKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)
CUDA_FLASH = FusedKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
CUDA_EFFICIENT = FusedKernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward)


def fused_kernel(query: torch.Tensor, key: torch.Tensor) -> FusedKernel | None:
    """The kernel that computes a block of these queries and keys, or None for the reference path.

    CPU: the CPU flash kernel for fp64, fp32, bf16 and fp16, any head dim. CUDA, for head dims
    that are multiples of 8 up to ``CUDA_MAX_HEAD_DIM``: FlashAttention-2 for fp16/bf16 on
    compute capability 8.0 or newer, otherwise the memory-efficient kernel (fp32, and fp16/bf16
    on older GPUs). Everything else -- fp64 on CUDA, other head dims, other devices, queries and
    keys of different dtypes -- takes the reference path.
    """
    dtype, device, head_dim = query.dtype, query.device, query.shape[-1]
    if key.dtype != dtype:
        return None
    if device.type == "cpu":
        return CPU_FLASH if dtype in CPU_FLASH_DTYPES else None
    if device.type != "cuda" or head_dim % 8 or head_dim > CUDA_MAX_HEAD_DIM:
        return None
    if dtype in CUDA_FLASH_DTYPES and torch.cuda.get_device_capability(device) >= (8, 0):
        return CUDA_FLASH
    return CUDA_EFFICIENT if dtype in CUDA_EFFICIENT_DTYPES else None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial results are summed (and the dtype of lse): fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


# --- one block ------------------------------------------------------------------------------------

def _one_head_per_query_head(tensor: torch.Tensor, group: int) -> torch.Tensor:
    """K or V [b, kv_heads, s, d] -> [b, kv_heads * group, s, d]: KV head j for query heads j*group..."""
    return tensor if group == 1 else tensor.repeat_interleave(group, dim=1)


def _sum_over_groups(grad: torch.Tensor, group: int) -> torch.Tensor:
    """The adjoint of ``_one_head_per_query_head``: [b, kv_heads * group, s, d] -> [b, kv_heads, s, d]."""
    return grad if group == 1 else grad.unflatten(1, (-1, group)).sum(2)


def block_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                  scale: float, band: int | None = None,
                  softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of query [b, heads, t, d] over one block key/value [b, kv_heads, s, d]
    (causal: query i sees keys 0..i, with t = s; ``band``: key j is also hidden from query i when
    j - i <= band, a sliding window's edge). Returns (out [b, heads, t, d], lse [b, heads, t]):
    out in the run's dtype from a fused kernel (the accumulation dtype from the reference path,
    which banded blocks take), lse in the accumulation dtype (-inf for a row the band hides whole).
    ``softcap``: scores capped at it (``meshlm/models/softcap.py``), on the reference path too."""
    kernel = None if band is not None or softcap is not None else fused_kernel(query, key)
    if kernel is None:
        wide = accumulation_dtype(query.dtype)
        return reference_block_forward(query.to(wide), key.to(wide), value.to(wide), causal, scale, band, softcap)
    group = query.shape[1] // key.shape[1]
    return kernel.forward(query, _one_head_per_query_head(key, group), _one_head_per_query_head(value, group),
                          causal, scale)


def block_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   band: int | None = None,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the FINAL output ``out`` [b, heads, t, d] and ``lse``
    [b, heads, t] of the query rows (merged over all blocks): the block's exact share of the full
    gradient. In the run's dtype from a fused kernel, the accumulation dtype from the reference."""
    kernel = None if band is not None or softcap is not None else fused_kernel(query, key)
    if kernel is None:
        wide = accumulation_dtype(query.dtype)
        return reference_block_backward(*(tensor.to(wide) for tensor in (grad_out, query, key, value, out, lse)),
                                        causal, scale, band, softcap)
    group = query.shape[1] // key.shape[1]
    dtype = query.dtype
    grad_query, grad_key, grad_value = kernel.backward(
        grad_out.to(dtype), query, _one_head_per_query_head(key, group), _one_head_per_query_head(value, group),
        out.to(dtype), lse.contiguous(), causal, scale)
    return grad_query, _sum_over_groups(grad_key, group), _sum_over_groups(grad_value, group)


# --- the reference: explicit matmuls over the [c x c] scores ---------------------------------------

def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, t, d] -> [b, kv_heads, group, t, d] (a view): the query heads sharing each KV head."""
    return query.unflatten(1, (kv_heads, -1))


def _scores(query: torch.Tensor, key: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """S = q k^T * scale for grouped queries [b, kv, g, t, d] and keys [b, kv, s, d] -> [b, kv, g, t, s],
    capped at ``softcap`` if given."""
    scores = torch.matmul(query, key.unsqueeze(2).transpose(-1, -2)) * scale
    return scores if softcap is None else soft_cap(scores, softcap)


def _masked(scores: torch.Tensor, causal: bool, band: int | None = None) -> torch.Tensor:
    """``scores`` with -inf where hidden: above the diagonal (causal), on or below diagonal ``band``
    (j - i <= band)."""
    rows, columns = scores.shape[-2:]
    if causal:
        above = torch.ones(rows, columns, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if band is not None:
        beyond = torch.ones(rows, columns, dtype=torch.bool, device=scores.device).tril(band)
        scores = scores.masked_fill(beyond, float("-inf"))
    return scores


def reference_block_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                            scale: float, band: int | None = None,
                            softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_forward`` as explicit matmuls in the inputs' dtype: S, lse = logsumexp(S), exp(S - lse) V
    (a row with no visible key: lse -inf and output 0)."""
    grouped = _grouped(query, key.shape[1])
    scores = _masked(_scores(grouped, key, scale, softcap), causal, band)
    lse = torch.logsumexp(scores, dim=-1)
    divisor = lse.masked_fill(lse == float("-inf"), 0)
    out = torch.matmul(torch.exp(scores - divisor.unsqueeze(-1)), value.unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def reference_block_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                             band: int | None = None,
                             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_backward`` as explicit matmuls in the inputs' dtype (FlashAttention's backward,
    Dao et al. 2022, Alg. 4, with P recomputed from the final lse and D = rowsum(dO * O)). With
    ``softcap``, dS (with respect to the capped scores) is carried through the cap's slope before
    it reaches q and k."""
    kv_heads = key.shape[1]
    grouped, grad_out, out = (_grouped(tensor, kv_heads) for tensor in (query, grad_out, out))
    lse = lse.unflatten(1, (kv_heads, -1))
    delta = (grad_out * out).sum(-1)
    scores = _scores(grouped, key, scale, softcap)
    probs = torch.exp(_masked(scores, causal, band) - lse.unsqueeze(-1))  # [b, kv, g, t, s]
    grad_value = torch.matmul(probs.transpose(-1, -2), grad_out).sum(2)
    grad_scores = probs * (torch.matmul(grad_out, value.unsqueeze(2).transpose(-1, -2)) - delta.unsqueeze(-1))
    if softcap is not None:
        grad_scores = grad_scores * soft_cap_slope(scores, softcap)
    grad_query = torch.matmul(grad_scores, key.unsqueeze(2)) * scale
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), grouped).sum(2) * scale
    return grad_query.flatten(1, 2), grad_key, grad_value


__all__ = ["CPU_FLASH", "CUDA_EFFICIENT", "CUDA_FLASH", "FusedKernel", "accumulation_dtype", "block_backward",
           "block_forward", "fused_kernel", "reference_block_backward", "reference_block_forward"]
