"""Which parameters are tensor-parallel shards, how a full tensor is cut into them, and back.

Every shard parameter carries ``tensor_parallel = True``, ``partition_dim`` (the dim it is
split along) and ``partition_sizes`` (the full sizes of the consecutive partitions along that
dim, each split over the ranks on its own -- e.g. Mamba's in-projection [z, x, B, C, dt]: rank r
holds [z_r, x_r, B_r, C_r, dt_r]). A vocabulary shard also carries ``unpadded_size`` (the real
vocabulary; rows beyond it are padding). From these ``gather_full_tensor`` rebuilds the
single-process tensor, and ``gather_full_state_dict`` / ``load_full_state_dict`` convert whole
models, so checkpoints keep the single-process format. A routed-expert shard of the expert grid
(``meshlm/parallel/expert/expert_parallel.py``) instead carries ``expert_parallel = True`` --
dim 0 (the experts) split into consecutive blocks over the EP group -- and, when expert tensor
parallelism splits it too, ``expert_partition_dim`` / ``expert_partition_sizes`` (the same rule
as above, over the ETP group).

With tp = 1 nothing is a shard, and every function here is the identity on the model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import CheckpointError, ConfigError
from meshlm.parallel.collectives import all_gather_into_, all_reduce_coalesced_


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
    """Every rank's ``tensor`` (same shape everywhere), in group-rank order."""
    local = tensor.detach().contiguous()
    stacked = local.new_empty((size, *local.shape))
    all_gather_into_(stacked.view(-1), local.view(-1), group)
    return list(stacked.unbind(0))


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


__all__ = ["gather_full_state_dict", "gather_full_tensor", "load_full_state_dict", "local_expert_shard_of",
           "local_shard_of", "mark_expert_shard", "mark_partial_grad", "mark_shard", "partial_grad_names",
           "reduce_partial_tp_grads", "shard_parameter", "shard_tensor", "tensor_parallel_names", "unshard_tensor"]
