"""Tensor (and sequence) parallelism for the Mamba-2 mixer: split by SSM heads and B/C groups.

The mixer (``meshlm/models/mamba2.py``) is, per token,

    z, x, B, C, dt = in_proj(u)          widths d_inner, d_inner, G*N, G*N, H
    x, B, C = silu(conv(x, B, C))        depthwise: every channel has its own K taps
    y = SSM_h(x_h, dt_h, A_h, B_g(h), C_g(h)) + D_h x_h        independently per head h
    out = out_proj(GatedRMSNorm_per_group(y, z))

Everything between the two projections is independent across heads, except that head h reads
the B and C of its group g(h) = h // (H / G). With t ranks, H and G both divisible by t, rank r
owns heads [r H/t, (r+1) H/t) and exactly the groups [r G/t, (r+1) G/t) those heads read --
a contiguous block of heads maps onto a contiguous block of groups. So, as in Megatron-LM's
MLP (Shoeybi et al. 2019) and as Mamba-2 was designed for (Dao & Gu 2024, §8):

- ``in_proj`` is column-parallel, each of its five partitions [z, x, B, C, dt] split on its own,
  so rank r's output is [z_r, x_r, B_r, C_r, dt_r] -- the same layout as the full layer, only
  narrower, which is why the mixer's forward runs unchanged on a shard;
- the depthwise conv is split by channel (x, B and C each the same way): no channel mixes with
  another, so a rank convolves its own channels;
- ``dt_bias``, ``A_log`` and ``D`` are per head and are sliced with the heads;
- the gated norm normalizes each group's d_inner / G channels on their own. Dao & Gu chose a
  *grouped* norm precisely so that a rank holding whole groups needs no all-reduce for the
  norm's statistics; its weight is sliced like the channels;
- ``out_proj`` is row-parallel: each rank multiplies its own channels and the partial sums are
  added over the group (one all-reduce, or a reduce-scatter under sequence parallelism).

Under sequence parallelism (Korthikanti et al. 2022) the mixer receives its rank's slice of
the sequence; the column-parallel ``in_proj`` all-gathers it first, so the conv and the scan --
which are recurrences over time -- see the whole sequence of the local heads, and ``out_proj``
reduce-scatters back to the slice. Generation caches then hold local heads and channels only.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.errors import ConfigError
from meshlm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from meshlm.parallel.tensor.sharding import shard_parameter


def shard_depthwise_conv(conv: nn.Conv1d, partition_sizes: list[int], context) -> nn.Conv1d:
    """A depthwise conv over only this rank's share of each channel partition (x, B, C)."""
    channels = sum(partition_sizes) // context.tp_size
    local = nn.Conv1d(channels, channels, conv.kernel_size[0], groups=channels, bias=conv.bias is not None,
                      padding=conv.padding[0], device=conv.weight.device, dtype=conv.weight.dtype)
    local.weight = shard_parameter(conv.weight, 0, context, partition_sizes, "Mamba conv1d.weight")
    if conv.bias is not None:
        local.bias = shard_parameter(conv.bias, 0, context, partition_sizes, "Mamba conv1d.bias")
    return local


@torch.no_grad()
def parallelize_mamba(mixer, context) -> None:
    """Split a full ``Mamba2Mixer`` in place into this rank's heads and groups (see module doc).

    ``check_layout`` normally refuses a layout where tp does not divide the heads and the groups
    before anything is built; this check repeats it for direct callers, because B and C would
    otherwise be cut through the middle of a group without any error.
    """
    tp = context.tp_size
    if tp == 1:
        return
    inner, bc, heads = mixer.inner_size, mixer.bc_size, mixer.num_heads
    if heads % tp or mixer.num_groups % tp:
        raise ConfigError(f"Mamba-2 with {heads} heads and model.mamba_num_groups={mixer.num_groups} cannot be "
                          f"split over parallel.tp={tp}: each rank must hold whole heads and whole B/C groups.")
    mixer.in_proj = ColumnParallelLinear.from_full(mixer.in_proj, context,
                                                   partition_sizes=[inner, inner, bc, bc, heads])
    mixer.conv1d = shard_depthwise_conv(mixer.conv1d, [inner, bc, bc], context)
    for name in ("dt_bias", "A_log", "D"):  # one value per head
        setattr(mixer, name, shard_parameter(getattr(mixer, name), 0, context, what=f"Mamba {name}"))
    if hasattr(mixer.norm, "weight"):  # a gated norm (model.mamba_gated_norm); the plain gate has none
        mixer.norm.weight = shard_parameter(mixer.norm.weight, 0, context, what="Mamba norm.weight")
    mixer.out_proj = RowParallelLinear.from_full(mixer.out_proj, context)

    # The forward reads only these sizes, so from here on it runs on the shard unchanged.
    mixer.num_heads = heads // tp
    mixer.num_groups = mixer.num_groups // tp
    mixer.inner_size = inner // tp
    mixer.bc_size = bc // tp
    mixer.conv_dim = mixer.inner_size + 2 * mixer.bc_size


__all__ = ["parallelize_mamba", "shard_depthwise_conv"]
