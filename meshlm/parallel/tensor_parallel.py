"""Tensor-parallel linear layers, and the bookkeeping of which parameters are shards.

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

**Shard bookkeeping.** Every shard parameter carries ``tensor_parallel = True``,
``partition_dim`` (the dim it is split along) and ``partition_sizes`` (the full sizes of the
consecutive partitions along that dim, each split over the ranks on its own -- e.g. Mamba's
in-projection [z, x, B, C, dt]: rank r holds [z_r, x_r, B_r, C_r, dt_r]). A vocabulary shard
also carries ``unpadded_size`` (the real vocabulary; rows beyond it are padding). From these
``gather_full_tensor`` rebuilds the single-process tensor, and ``gather_full_state_dict`` /
``load_full_state_dict`` convert whole models, so checkpoints keep the single-process format.
A routed-expert shard of the expert grid (``meshlm/parallel/expert_parallel.py``) instead carries
``expert_parallel = True`` -- dim 0 (the experts) split into consecutive blocks over the EP group
-- and, when expert tensor parallelism splits it too, ``expert_partition_dim`` /
``expert_partition_sizes`` (the same rule as above, over the ETP group).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlm.models.config import ConfigError
from meshlm.parallel.collectives import (all_gather_along, all_reduce_coalesced_, copy_to_group,
                                         reduce_from_group, reduce_scatter_along)

# --- entering and leaving a tensor-parallel region ---------------------------------------------


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


# --- slicing a full tensor into this rank's shard, and back ---------------------------------------


def _check_partitions(partition_sizes: list[int], tp_size: int, what: str) -> None:
    for size in partition_sizes:
        if size % tp_size:
            raise ConfigError(f"{what}: a partition of {size} features is not divisible by parallel.tp={tp_size}; "
                              "every rank must hold an equal share (change the model width or tp).")


def shard_tensor(full: torch.Tensor, dim: int, partition_sizes: list[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s share of every partition of ``full`` along ``dim``, concatenated."""
    pieces, start = [], 0
    for size in partition_sizes:
        share = size // tp_size
        pieces.append(full.narrow(dim, start + tp_rank * share, share))
        start += size
    return torch.cat(pieces, dim=dim)


def unshard_tensor(shards: list[torch.Tensor], dim: int, partition_sizes: list[int]) -> torch.Tensor:
    """Inverse of ``shard_tensor``: rebuild the full tensor from every rank's shard, in rank order."""
    tp_size = len(shards)
    partitions, local_start = [], 0
    for size in partition_sizes:
        share = size // tp_size
        partitions.extend(shard.narrow(dim, local_start, share) for shard in shards)
        local_start += share
    return torch.cat(partitions, dim=dim)


def shard_parameter(full: torch.Tensor, dim: int, context, partition_sizes: list[int] | None = None,
                    what: str = "parameter") -> nn.Parameter:
    """A new parameter holding this rank's shard of ``full`` along ``dim``, marked as a TP shard."""
    partition_sizes = list(partition_sizes) if partition_sizes is not None else [full.shape[dim]]
    if sum(partition_sizes) != full.shape[dim]:
        raise ValueError(f"{what}: partition sizes {partition_sizes} do not add up to dim {dim} of shape "
                         f"{tuple(full.shape)}")
    _check_partitions(partition_sizes, context.tp_size, what)
    local = shard_tensor(full.detach(), dim, partition_sizes, context.tp_rank, context.tp_size)
    shard = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
    mark_shard(shard, dim, partition_sizes)
    return shard


def mark_shard(param: nn.Parameter, dim: int, partition_sizes: list[int], unpadded_size: int | None = None) -> None:
    param.tensor_parallel = True
    param.partition_dim = dim
    param.partition_sizes = list(partition_sizes)
    if unpadded_size is not None:
        param.unpadded_size = unpadded_size


def mark_expert_shard(param: nn.Parameter, etp_dim: int | None, partition_sizes: list[int]) -> None:
    """Mark this rank's experts of a stacked [E, ., .] weight (dim 0 over EP), split on ``etp_dim`` over ETP."""
    param.expert_parallel = True
    if etp_dim is not None:
        param.expert_partition_dim = etp_dim
        param.expert_partition_sizes = list(partition_sizes)


def mark_partial_grad(*modules_or_params) -> None:
    """Flag replicated parameters whose gradient is only this rank's share (summed after backward)."""
    for item in modules_or_params:
        if item is None:
            continue
        params = item.parameters() if isinstance(item, nn.Module) else [item]
        for param in params:
            param.tp_partial_grad = True


# --- the layers -------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """y_r = x A_r (+ b_r): this rank's output features. Input [b, s, in] (or [b, s/t, in] under SP,
    gathered here); output [b, s, out/t]. ``gather_input=False`` when the caller already entered
    the parallel region once for several layers that share the input (q, k, v; gate, up)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, context, gather_input: bool = True):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.context = context
        self.gather_input = gather_input
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_full(cls, full: nn.Linear, context, partition_sizes: list[int] | None = None,
                  gather_input: bool = True) -> "ColumnParallelLinear":
        sizes = partition_sizes or [full.out_features]
        what = f"ColumnParallelLinear({full.in_features} -> {full.out_features})"
        weight = shard_parameter(full.weight, 0, context, sizes, what)
        bias = shard_parameter(full.bias, 0, context, sizes, what) if full.bias is not None else None
        return cls(weight, bias, context, gather_input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = column_parallel_input(x, self.context)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, local_out={self.out_features}, tp={self.context.tp_size}"


class RowParallelLinear(nn.Module):
    """y = sum_r x_r A_r (+ b): input [b, s, in/t] split like A's rows; output [b, s, out] summed
    over the group, or [b, s/t, out] under SP. The bias is added once, after the sum."""

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
        return cls(weight, bias, context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = row_parallel_output(F.linear(x, self.weight), self.context)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"local_in={self.in_features}, out={self.out_features}, tp={self.context.tp_size}"


class ReplicatedRowsLinear(nn.Module):
    """A full linear layer kept on every rank, of which this rank computes only ``rows`` of the
    output: the key/value projections when there are fewer KV heads than ranks (each rank reads
    the KV head its query heads share). Its gradient covers only those rows and only this rank's
    queries, so it is partial and summed over the group after backward."""

    def __init__(self, full: nn.Linear, context, rows: slice, gather_input: bool = True):
        super().__init__()
        self.weight = full.weight
        self.bias = full.bias
        mark_partial_grad(self.weight, self.bias)
        self.context, self.rows, self.gather_input = context, rows, gather_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gather_input:
            x = column_parallel_input(x, self.context)
        bias = self.bias[self.rows] if self.bias is not None else None
        return F.linear(x, self.weight[self.rows], bias)

    def extra_repr(self) -> str:
        return f"rows={self.rows.start}:{self.rows.stop} of {self.weight.shape[0]}"


# --- which parameters are what ----------------------------------------------------------------------


def tensor_parallel_names(model: nn.Module) -> set[str]:
    """Names of the parameters that are TP shards (their squares are summed over TP for norms)."""
    return {name for name, param in model.named_parameters() if getattr(param, "tensor_parallel", False)}


def partial_grad_names(model: nn.Module) -> set[str]:
    """Names of replicated parameters whose gradient is partial on each TP rank."""
    return {name for name, param in model.named_parameters() if getattr(param, "tp_partial_grad", False)}


def reduce_partial_tp_grads(named_grads_or_model, context, names: set[str] | None = None) -> None:
    """Sum partial gradients over the TP group, in place, in one coalesced all-reduce.

    Given a model: every parameter flagged ``tp_partial_grad`` (a missing grad counts as zeros
    and is created, so every rank reduces the same list). Given a mapping or iterable of
    (name, grad) -- e.g. fp32 master gradients -- the entries whose name is in ``names``, or all
    of them when ``names`` is None. Call after the last micro-batch's backward, before DP.
    """
    if context.tp_size == 1:
        return
    if isinstance(named_grads_or_model, nn.Module):
        grads = []
        for param in named_grads_or_model.parameters():
            if getattr(param, "tp_partial_grad", False) and param.requires_grad:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
    else:
        items = named_grads_or_model.items() if isinstance(named_grads_or_model, Mapping) else named_grads_or_model
        grads = [grad for name, grad in items if grad is not None and (names is None or name in names)]
    if grads:
        all_reduce_coalesced_(grads, context.tp_group)


# --- the single-process state dict ----------------------------------------------------------------


def gather_full_tensor(param: torch.Tensor, tensor: torch.Tensor, context) -> torch.Tensor:
    """The single-process form of ``tensor`` (a shard shaped like ``param``, e.g. its value or its
    gradient): all-gathered over the TP group and reassembled, vocabulary padding dropped. A
    replicated parameter's tensor is returned as it is."""
    if getattr(param, "expert_parallel", False):
        return _gather_full_expert_tensor(param, tensor, context)
    if not getattr(param, "tensor_parallel", False) or context.tp_size == 1:
        return tensor
    full = unshard_tensor(_all_gathered(tensor, context.tp_size, context.tp_group), param.partition_dim,
                          param.partition_sizes)
    unpadded = getattr(param, "unpadded_size", None)
    return full.narrow(param.partition_dim, 0, unpadded) if unpadded is not None else full


def _all_gathered(tensor: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    local = tensor.detach().contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return shards


def _gather_full_expert_tensor(param: torch.Tensor, tensor: torch.Tensor, context) -> torch.Tensor:
    """An expert shard's tensor gathered over ETP (its FFN split), then over EP (the experts)."""
    full = tensor.detach()
    etp_dim = getattr(param, "expert_partition_dim", None)
    if etp_dim is not None and context.etp_size > 1:
        full = unshard_tensor(_all_gathered(full, context.etp_size, context.etp_group), etp_dim,
                              param.expert_partition_sizes)
    if context.ep_size > 1:
        full = torch.cat(_all_gathered(full, context.ep_size, context.ep_group), dim=0)
    return full


def local_expert_shard_of(param: torch.Tensor, full: torch.Tensor, context) -> torch.Tensor:
    """This rank's experts of a full stacked expert tensor, split over ETP like ``param``."""
    num_local = full.shape[0] // context.ep_size
    local = full.narrow(0, context.ep_rank * num_local, num_local)
    etp_dim = getattr(param, "expert_partition_dim", None)
    if etp_dim is not None and context.etp_size > 1:
        local = shard_tensor(local, etp_dim, param.expert_partition_sizes, context.etp_rank, context.etp_size)
    return local


def gather_full_state_dict(model: nn.Module, context) -> dict[str, torch.Tensor]:
    """The exact single-process state dict of a parallelized model, on every rank of the TP group."""
    params = dict(model.named_parameters())
    return {name: gather_full_tensor(params[name], value, context) if name in params else value.detach()
            for name, value in model.state_dict().items()}


def local_shard_of(param: torch.Tensor, full: torch.Tensor, context) -> torch.Tensor:
    """This rank's shard of the single-process tensor ``full`` for ``param`` (padding the vocabulary)."""
    if getattr(param, "expert_parallel", False):
        return local_expert_shard_of(param, full, context)
    if not getattr(param, "tensor_parallel", False) or context.tp_size == 1:
        return full
    dim, sizes = param.partition_dim, param.partition_sizes
    missing = sum(sizes) - full.shape[dim]
    if missing:
        padding = [0, 0] * (full.dim() - 1 - dim) + [0, missing]
        full = F.pad(full, padding)
    return shard_tensor(full, dim, sizes, context.tp_rank, context.tp_size)


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], context) -> None:
    """Load a single-process state dict into a parallelized model, each rank taking its shard."""
    from meshlm.checkpoint.model_files import CheckpointError

    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"the state dict does not match the model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}; it must come from the same model config.")
    params = dict(model.named_parameters())
    for name, target in own.items():
        value = local_shard_of(params[name], state[name], context) if name in params else state[name]
        if value.shape != target.shape:
            raise CheckpointError(f"{name}: the state dict holds shape {tuple(state[name].shape)}, which does "
                                  f"not fit this model's {tuple(target.shape)}; it must come from the same config.")
        target.copy_(value)


def parallelize_model(model, context, vocab_pad_multiple: int = 1):
    """Split a full single-process ``LanguageModel`` in place over the TP group; see
    ``meshlm.parallel.parallel_model`` (re-exported here, where the spec names it)."""
    from meshlm.parallel.parallel_model import parallelize_model as parallelize

    return parallelize(model, context, vocab_pad_multiple=vocab_pad_multiple)


__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "ReplicatedRowsLinear", "column_parallel_input",
    "row_parallel_output", "shard_tensor", "unshard_tensor", "shard_parameter", "mark_shard", "mark_expert_shard",
    "mark_partial_grad", "local_expert_shard_of",
    "tensor_parallel_names", "partial_grad_names", "reduce_partial_tp_grads", "gather_full_tensor",
    "gather_full_state_dict", "load_full_state_dict", "local_shard_of", "parallelize_model",
]
