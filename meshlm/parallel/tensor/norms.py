"""QK-norms under tensor parallelism: an RMSNorm whose channels are split over the group (OLMo 2),
and the per-head weights of a ``HeadNorm`` cut with the heads.

OLMo 2 normalizes the whole query projection -- all heads' channels at once, with a weight per
channel (``model.qk_norm_scope=all``) -- and likewise the keys. Tensor parallelism gives each rank
whole heads, so a rank holds only its heads' channels of the vector being normalized, and of the
weight. The mean square is then a sum over the group: each rank sums the squares of its channels,
one all-reduce adds the partial sums, and every rank divides by the full width. The all-reduce
sits in forward and, for the same reason, in backward: every rank's output depends on every
rank's partial sum, so the gradient of a partial sum is the sum of all ranks' gradients with
respect to the total (``copy_to_group`` then ``reduce_from_group``: identity then all-reduce
forward, all-reduce then identity backward, each with its adjoint tested in
tests/parallel/test_collectives.py). The weight is a shard like the projection's rows: its
gradient is whole on its rank.
"""

from __future__ import annotations

import torch

from meshlm.models.norms import HeadNorm, RMSNorm
from meshlm.parallel.collectives import copy_to_group, reduce_from_group
from meshlm.parallel.tensor.sharding import mark_partial_grad, shard_parameter


class ShardedRMSNorm(RMSNorm):
    """``RMSNorm`` over ``full_size`` channels of which this rank holds a contiguous share of whole
    heads (the weight sharded along with them); statistics summed over ``group``."""

    group = None
    full_size = 0

    @classmethod
    @torch.no_grad()
    def from_full(cls, norm: RMSNorm, context) -> "ShardedRMSNorm":
        full_size = norm.weight.shape[0]
        norm.weight = shard_parameter(norm.weight, 0, context, what="the QK-norm weight")
        norm.__class__ = cls
        norm.group, norm.full_size = context.tp_group, full_size
        return norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        squares = reduce_from_group(copy_to_group(squares, self.group), self.group)  # all ranks' channels
        normed = x32 * torch.rsqrt(squares / self.full_size + self.eps)
        scale = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (scale * normed).to(x.dtype)


@torch.no_grad()
def parallelize_head_norm(norm: HeadNorm | None, context, replicated_heads: slice | None = None) -> None:
    """Give a per-head QK-norm (``model.qk_norm_per_head``) this rank's heads; mark a shared one's
    gradient partial.

    Statistics are per head, so nothing is communicated. A weight (and bias) of one row per head
    is cut along the heads like the projection's rows; where the key heads are replicated over
    the ranks (fewer KV heads than ranks), the rank keeps the whole weight and reads the rows of
    ``replicated_heads``, its gradient then partial like the replicated key projection's. A weight
    shared by all heads sees only this rank's heads: partial too, summed after backward.
    """
    if norm is None:
        return
    if norm.weight.dim() == 1 or replicated_heads is not None:
        norm.head_rows = replicated_heads if norm.weight.dim() == 2 else None
        mark_partial_grad(norm)
        return
    norm.weight = shard_parameter(norm.weight, 0, context, what="the per-head QK-norm weight")
    if norm.bias is not None:
        norm.bias = shard_parameter(norm.bias, 0, context, what="the per-head QK-norm bias")


__all__ = ["ShardedRMSNorm", "parallelize_head_norm"]
