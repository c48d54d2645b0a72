"""Data parallelism over two groups at once: dense weights over dp_cp, expert weights over edp.

MoE Parallel Folding (Liu et al. 2025) lays the experts on their own grid (edp, ep, etp) over the
ranks of a pipeline stage (``meshlm/parallel/expert/expert_parallel.py``). A dense weight (attention, norms, the router,
the shared expert) is replicated over the data- and context-parallel ranks, and its gradient is
summed over ``dp_cp``; an expert shard is replicated over the *expert*-data-parallel ranks only,
and its gradient is summed over ``edp``. With ep = 4 on 8 ranks, say, dp_cp may be 8 while edp is
2: each expert lives on 2 ranks and sees the tokens that were sent to it from all 8.

Nothing about the reduction itself changes, only the group, so both halves reuse the existing
pieces unchanged: a ``GradientReducer`` (and, with ZeRO-1, a ``DistributedOptimizer``) over the
dense parameters, and another over the expert parameters whose ``ParallelContext`` says that its
data-parallel group is edp (``expert_data_context``). ``ReducerGroup`` and
``OptimizerGroup`` drive the two as one, in the order the trainer expects: both reducers launch
their buckets during the last backward, both finish, both optimizers step. The distributed
optimizer thus shards the Adam moments (and bf16/fp16 masters) of the experts over edp, and
those of dense weights over dp_cp. Without it, one ordinary AdamW over all parameters keeps the
single-process optimizer state layout.

**One launch order for both.** dp_cp and edp share ranks (ranks 0 and 4 may be in both), and
two ranks that launch a dense and an expert bucket in opposite orders can deadlock NCCL; which
bucket fills first depends on when each gradient arrives, which depends on the routing. So the
two reducers' buckets are merged into ONE fixed order (``grad_reducer.LaunchOrder``): by the
place in backward order (the highest parameter index first, parameters being laid out in
reverse) of each bucket's last-arriving parameter, the one that completes it. A bucket launches
when it is ready and every bucket before it in that order has launched, so the overlap with
backward stays and the sequence of collectives is the same on every rank.

The global gradient norm counts an expert element on the rank that is canonical for it (edp rank
0, or its ZeRO-1 owner): ``grad_norm.is_canonical_owner``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from meshlm.optim.build import build_optimizer
from meshlm.parallel.data.distributed_optimizer import DistributedOptimizer
from meshlm.parallel.data.grad_reducer import GradientReducer, LaunchOrder
from meshlm.parallel.tensor.orthogonal_updates import sharded_orthogonalizer


def expert_data_context(context):
    """``context`` with its data-parallel group replaced by the expert-data-parallel one (what the
    reducer and the distributed optimizer read)."""
    return dataclasses.replace(context, dp_size=context.edp_size, dp_rank=context.edp_rank, dp_group=context.edp_group,
                               dp_cp_size=context.edp_size, dp_cp_rank=context.edp_rank,
                               dp_cp_group=context.edp_group)


def merged_launch_order(reducers: list[GradientReducer], parameter_order: list[torch.Tensor]) -> LaunchOrder:
    """Every bucket of ``reducers`` in one order: by the position in ``parameter_order`` (the model
    parameters in definition order) of the bucket's first parameter, highest first -- the order
    in which backward completes them. Within a reducer this is its index order."""
    position = {id(param): index for index, param in enumerate(parameter_order)}

    def completed_by(entry: tuple[GradientReducer, int]) -> int:
        reducer, bucket = entry
        return min(position[id(reducer.sources[index])] for index in reducer.layout.buckets[bucket].params)

    entries = [(reducer, bucket) for reducer in reducers for bucket in range(len(reducer.layout.buckets))]
    return LaunchOrder(sorted(entries, key=completed_by, reverse=True))


class ReducerGroup:
    """Several ``GradientReducer``s (dense over dp_cp, experts over edp) driven as one, their
    buckets launched in one merged order (see the module docstring). ``parameter_order``: every
    model parameter the reducers hold, in definition order."""

    def __init__(self, reducers: list[GradientReducer], parameter_order: list[torch.Tensor]):
        self.reducers = reducers
        self.shards_gradients = all(getattr(reducer, "shards_gradients", False) for reducer in reducers)
        """ZeRO-2/3 reducers: ``fully_sharded.UnitSchedule`` orders their launches, not a LaunchOrder."""
        if not self.shards_gradients:
            self.launch_order = merged_launch_order(reducers, parameter_order)
            for reducer in reducers:
                reducer.launch_order = self.launch_order

    def zero_grad(self) -> None:
        for reducer in self.reducers:
            reducer.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for reducer in self.reducers:
                stack.enter_context(reducer.no_sync())
            yield

    @contextlib.contextmanager
    def sync_parameters(self, names):
        with contextlib.ExitStack() as stack:
            for reducer in self.reducers:
                stack.enter_context(reducer.sync_parameters(names))
            yield

    def finish(self) -> None:
        if self.shards_gradients:
            for reducer in self.reducers:
                reducer.finish()
        else:
            self.launch_order.finish()

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return [pair for reducer in self.reducers for pair in reducer.named_grads()]

    @property
    def names(self) -> list[str]:
        return [name for reducer in self.reducers for name in reducer.names]

    @property
    def buffer(self) -> torch.Tensor:
        """The first reducer's buffer (callers read its device)."""
        return self.reducers[0].buffer

    def remove_hooks(self) -> None:
        for reducer in self.reducers:
            reducer.remove_hooks()


class OptimizerGroup:
    """Distributed optimizers over disjoint parameter sets (dense over dp_cp, experts over edp),
    stepped together; ``optimizers`` lists them for the checkpoint code."""

    def __init__(self, optimizers: list[DistributedOptimizer], parameter_order: list[torch.Tensor]):
        self.optimizers = optimizers
        self.reducer = ReducerGroup([optimizer.reducer for optimizer in optimizers], parameter_order)

    @property
    def param_groups(self) -> list[dict]:
        """Every part's groups (the LR schedule writes ``lr`` into each)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def named_grad_shards(self) -> list[tuple[str, torch.Tensor]]:
        return [pair for optimizer in self.optimizers for pair in optimizer.named_grad_shards()]

    def wait_for_parameters(self, names=None) -> None:
        for optimizer in self.optimizers:
            optimizer.wait_for_parameters(names)

    def full_master_weights(self) -> dict[str, torch.Tensor]:
        """bf16/fp16: every part's fp32 masters, gathered (collective over each part's group)."""
        return {name: value for optimizer in self.optimizers for name, value in optimizer.full_master_weights().items()}

    def load_master_weights(self, masters: dict[str, torch.Tensor]) -> None:
        for optimizer in self.optimizers:
            optimizer.load_master_weights({name: masters[name] for name in optimizer.reducer.names})

    def gather_all(self) -> None:
        """ZeRO-3: every part gathers all its units and keeps them (see ``DistributedOptimizer.gather_all``)."""
        for optimizer in self.optimizers:
            optimizer.gather_all()


def split_by_expert(named: list[tuple[str, torch.Tensor]], sources: list[torch.Tensor], expert_names: set[str]):
    """((dense pairs, dense sources), (expert pairs, expert sources)), order kept."""
    dense, experts = ([], []), ([], [])
    for pair, source in zip(named, sources):
        part = experts if pair[0] in expert_names else dense
        part[0].append(pair)
        part[1].append(source)
    return dense, experts


def build_expert_data_parallel(precision, optim_config, parallel_config, context, expert_names: set[str]):
    """(reducer, optimizer) for a model with expert-grid parameters (``expert_names``): dense
    parameters reduced over dp_cp, experts over edp; see the module docstring."""
    named = precision.master_parameters()
    sources = [param for _, param in precision.model_parameters]
    parts = [(pairs, part_sources, part_context) for (pairs, part_sources), part_context in
             zip(split_by_expert(named, sources, expert_names), (context, expert_data_context(context))) if pairs]
    size, overlap, stage = parallel_config.bucket_size_mb, parallel_config.overlap_grad_reduce, \
        parallel_config.sharding_stage
    orthogonalize_many = sharded_orthogonalizer(precision.model_parameters, context)
    if stage >= 1:
        optimizer = OptimizerGroup([DistributedOptimizer(pairs, optim_config, part_context, size, overlap,
                                                         model_parameters=part_sources, model_dtype=precision.dtype,
                                                         zero_stage=stage,
                                                         reduce_grads_in_fp32=parallel_config.reduce_grads_in_fp32,
                                                         orthogonalize_many=orthogonalize_many)
                                    for pairs, part_sources, part_context in parts], sources)
        precision.hand_masters_to(optimizer)
        return optimizer.reducer, optimizer
    reducers = [GradientReducer(pairs, part_context, size, overlap, model_parameters=part_sources)
                for pairs, part_sources, part_context in parts]
    return ReducerGroup(reducers, sources), build_optimizer(named, optim_config, orthogonalize_many)


__all__ = ["OptimizerGroup", "ReducerGroup", "build_expert_data_parallel", "expert_data_context", "merged_launch_order",
           "split_by_expert"]
