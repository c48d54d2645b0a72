"""Tensor-parallel linear layers: column- and row-parallel, and entering and leaving their region.

Megatron-LM's intra-layer model parallelism (Shoeybi et al. 2019, §3) splits one matrix
multiply y = x A over the t ranks of a tensor-parallel (TP) group in one of two ways:

- **column-parallel**: A = [A_1 ... A_t] by output features. Every rank needs the whole input
  x and computes its own slice y_r = x A_r. Entering it is the operator f (``copy_to_group``):
  identity forward; in backward each rank holds only its share of dL/dx, so f all-reduces it.
- **row-parallel**: A split by input features, so x must already be split the same way (the
  output of a column-parallel layer is). Rank r computes the partial product x_r A_r; the sum
  over ranks is the operator g (``reduce_from_group``): all-reduce forward, identity backward.

Column then row (attention's q/k/v then o; the MLP's up then down) costs one all-reduce in the
forward and one in the backward, and everything between the two layers -- the activation, the
per-head attention -- stays local. A bias of a column-parallel layer is split with its outputs;
a row-parallel layer adds its (replicated) bias once, after the sum.

**Sequence parallelism** (Korthikanti et al. 2022, §4.2.2) keeps the residual stream sharded
along the sequence between these regions: rank r holds tokens [r s/t, (r+1) s/t). f becomes an
all-gather along the sequence and g a reduce-scatter along it -- the same bytes as the
all-reduce, since a ring all-reduce *is* a reduce-scatter followed by an all-gather -- and the
norms in between run on 1/t of the tokens. A replicated parameter applied to a sequence shard
(a norm weight, a row-parallel bias) then receives only its shard's share of the gradient: it
carries ``tp_partial_grad`` and ``reduce_partial_tp_grads`` sums it over the group after
backward. The layers read ``context.sequence_parallel`` at every call, so a model can switch
SP off (e.g. to decode one token at a time) without being rebuilt.

Which parameters are shards, and how a full tensor is cut into them, is ``sharding.py``.

A LoRA adapter (``meshlm/models/lora.py``) is cut like the weight it rides on: a column-parallel
layer splits its b by output features (its a, replicated, has a partial gradient), a row-parallel
layer splits its a by input features and adds its partial detour before the reduction (its b,
replicated, has a partial gradient).

A low-precision recipe (``meshlm/precision/quantized_linear.py``) sets a layer's
``quantization``; its GEMMs then run on quantized operands, with the amaxes of sharded tensors
reduced over the group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.models.dropout import TokenCoordinates
from meshlm.models.lora import ADAPTER_MODULE, with_adapter
from meshlm.parallel.collectives import all_gather_along, copy_to_group, reduce_from_group, reduce_scatter_along
from meshlm.parallel.tensor.sharding import mark_partial_grad, shard_parameter, shard_tensor

# --- entering and leaving a tensor-parallel region ---------------------------------------------


def _linear(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with the layer's weight, or its recipe's quantized GEMMs when it has one."""
    if layer.quantization is None:
        return F.linear(x, layer.weight, bias)
    return layer.quantization.linear(x, layer.weight, bias)


def column_parallel_input(x: torch.Tensor, context) -> torch.Tensor:
    """The full input [b, s, in] every rank of a column-parallel layer needs: f (identity forward,
    all-reduce backward), or under SP the all-gather of the sequence slices [b, s/t, in]."""
    if context.sequence_parallel:
        return all_gather_along(x, dim=1, group=context.tp_group)
    return copy_to_group(x, context.tp_group)


def row_parallel_output(partial: torch.Tensor, context) -> torch.Tensor:
    """Sum a row-parallel layer's partial products over the group: g (all-reduce), or under SP a
    reduce-scatter that leaves this rank its slice of the sequence."""
    if context.sequence_parallel:
        return reduce_scatter_along(partial, dim=1, group=context.tp_group)
    return reduce_from_group(partial, context.tp_group)


def carry_adapter(full: nn.Module, layer: nn.Module, split: str | None, context=None,
                  sizes: list[int] | None = None, what: str = "") -> None:
    """Give ``layer`` (the parallel form of ``full``) ``full``'s LoRA adapter, if it has one, cut
    like the weight: ``split`` 'b' (column-parallel: b by output features) or 'a' (row-parallel: a
    by input features). The other half stays whole and is fed only this rank's share (its outputs,
    or its partial sum), so its gradient is partial, summed over the group after backward. ``split``
    None (replicated rows): both stay whole, both partial."""
    adapter = getattr(full, ADAPTER_MODULE, None)
    if adapter is None:
        return
    if split is None:
        mark_partial_grad(adapter)
    else:
        cut = shard_parameter(getattr(adapter, split), 0 if split == "b" else 1, context, sizes,
                              f"{what} lora.{split}")
        setattr(adapter, split, cut)
        mark_partial_grad(adapter.a if split == "b" else adapter.b)
        if split == "a":  # its dropout masks the input channels by their global indices (kept on the
            channels = torch.arange(full.in_features)  # host: a model built on meta is materialized later)
            adapter.input_channels = shard_tensor(channels, 0, sizes or [full.in_features], context.tp_rank,
                                                  context.tp_size)
    layer.lora = adapter


# --- the layers -------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y_r = x A_r (+ b_r): this rank's output features. Input [b, s, in] (or [b, s/t, in] under SP,
    gathered here); output [b, s, out/t]. ``gather_input=False`` when the caller already entered
    the parallel region once for several layers that share the input (q, k, v; gate, up)."""

    tensor_parallel = "column"
    """How the layer is cut, for code that must not import this module (the precision recipes)."""
    quantization = None
    """A low-precision recipe's ``LinearQuantization`` (None: plain GEMMs)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, context, gather_input: bool = True,
                 partition_sizes: list[int] | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.context = context
        self.gather_input = gather_input
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.partition_sizes = partition_sizes or [self.out_features * context.tp_size]
        """Full sizes of the output partitions a fused projection is cut into (each split over the ranks)."""

    @classmethod
    def from_full(cls, full: nn.Linear, context, partition_sizes: list[int] | None = None,
                  gather_input: bool = True) -> "ColumnParallelLinear":
        sizes = partition_sizes or [full.out_features]
        what = f"ColumnParallelLinear({full.in_features} -> {full.out_features})"
        weight = shard_parameter(full.weight, 0, context, sizes, what)
        bias = shard_parameter(full.bias, 0, context, sizes, what) if full.bias is not None else None
        layer = cls(weight, bias, context, gather_input, sizes)
        carry_adapter(full, layer, "b", context, sizes, what)  # b split like the weight's rows
        return layer

    def forward(self, x: torch.Tensor, coordinates: TokenCoordinates | None = None) -> torch.Tensor:
        if self.gather_input:
            x = column_parallel_input(x, self.context)
        return with_adapter(self, x, _linear(self, x, self.bias), coordinates=coordinates)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, local_out={self.out_features}, tp={self.context.tp_size}"


class RowParallelLinear(nn.Module):
    """y = sum_r x_r A_r (+ b): input [b, s, in/t] split like A's rows; output [b, s, out] summed
    over the group, or [b, s/t, out] under SP. The bias is added once, after the sum."""

    tensor_parallel = "row"
    """How the layer is cut, for code that must not import this module (the precision recipes)."""
    quantization = None
    """A low-precision recipe's ``LinearQuantization`` (None: plain GEMMs)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, context):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.context = context
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_full(cls, full: nn.Linear, context, partition_sizes: list[int] | None = None) -> "RowParallelLinear":
        sizes = partition_sizes or [full.in_features]
        what = f"RowParallelLinear({full.in_features} -> {full.out_features})"
        weight = shard_parameter(full.weight, 1, context, sizes, what)
        bias = None
        if full.bias is not None:
            bias = nn.Parameter(full.bias.detach().clone(), requires_grad=full.bias.requires_grad)
            if context.sequence_parallel:  # added to this rank's tokens only
                mark_partial_grad(bias)
        layer = cls(weight, bias, context)
        carry_adapter(full, layer, "a", context, sizes, what)  # a split like the weight's columns
        return layer

    def forward(self, x: torch.Tensor, coordinates: TokenCoordinates | None = None) -> torch.Tensor:
        out = row_parallel_output(with_adapter(self, x, _linear(self, x, None), coordinates=coordinates),
                                  self.context)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"local_in={self.in_features}, out={self.out_features}, tp={self.context.tp_size}"


class ReplicatedRowsLinear(nn.Module):
    """A full linear layer kept on every rank, of which this rank computes only ``rows`` of the
    output: the key/value projections when there are fewer KV heads than ranks (each rank reads
    the KV head its query heads share). Its gradient covers only those rows and only this rank's
    queries, so it is partial and summed over the group after backward."""

    tensor_parallel = "replicated rows"
    """How the layer is cut, for code that must not import this module (the precision recipes)."""

    def __init__(self, full: nn.Linear, context, rows: slice, gather_input: bool = True):
        super().__init__()
        self.weight = full.weight
        self.bias = full.bias
        mark_partial_grad(self.weight, self.bias)
        carry_adapter(full, self, None)  # LoRA: a and b whole, b read at the same rows
        self.context, self.rows, self.gather_input = context, rows, gather_input

    def forward(self, x: torch.Tensor, coordinates: TokenCoordinates | None = None) -> torch.Tensor:
        if self.gather_input:
            x = column_parallel_input(x, self.context)
        bias = self.bias[self.rows] if self.bias is not None else None
        return with_adapter(self, x, F.linear(x, self.weight[self.rows], bias), self.rows, coordinates)

    def extra_repr(self) -> str:
        return f"rows={self.rows.start}:{self.rows.stop} of {self.weight.shape[0]}"



__all__ = ["ColumnParallelLinear", "ReplicatedRowsLinear", "RowParallelLinear", "carry_adapter",
           "column_parallel_input", "row_parallel_output"]
