"""Data parallelism: where the pieces are, and the one call that picks them for a run.

Every DP rank holds a replica of the (tensor-parallel) model and runs micro-batches of its own
samples; each micro-batch loss is divided by the micro-batch count of the WHOLE step (all DP
ranks together), so the sum of the ranks' gradients is the single-process gradient of the
step's mean loss. Three pieces turn that into a step:

* ``grad_reducer.GradientReducer`` -- fp32 gradient buckets, summed over DP by all-reduces that
  start during the last micro-batch's backward (overlap), nothing sent on the others.
* ``distributed_optimizer.DistributedOptimizer`` -- ZeRO stage 1: the reducer reduce-scatters
  instead, each rank updates its 1/dp of the fp32 values with its 1/dp of the Adam moments,
  and an all-gather brings the updated values back to every rank (by default while the next
  forward runs: each block waits only for its own buckets).
* ``fully_sharded`` -- ZeRO stages 2 and 3 (``parallel.zero_stage``): the same optimizer keeps
  only a shard of the gradients (``sharded_gradients.ShardedGradientReducer``), and at stage 3
  of the parameters too, gathered block by block; hooks on the model issue the collectives.
* ``expert_data_parallel`` -- under expert parallelism (MoE Parallel Folding) the routed
  experts' gradients are summed over the expert-data-parallel group (edp) and dense ones over
  dp_cp: one reducer (and distributed optimizer) per group, driven as one.
* ``grad_norm`` -- the global gradient norm (and clipping by it), every element counted once
  across TP shards and, with the distributed optimizer, DP shards.

A trainer step with either optimizer::

    reducer.zero_grad()
    for micro-batch i of n:   (with reducer.no_sync() unless i == n - 1): backward(loss_i / total)
    norm, skip = finish_gradients(...)        # DP reduction, TP partial sums, unscale, clip
    if not skip: optimizer.step(); precision.master_to_model()
    optimizer.zero_grad()

The skip decision comes from the global norm alone, so every rank takes it alike: an inf or nan
in any rank's local gradient reaches the reduced gradient of the rank that owns that element,
and from there the global norm of every rank. (MixedPrecision's own non-finite flag looks at
this rank's buffer only and is implied by the norm.)
"""

from __future__ import annotations

import torch

from meshlm.optim.build import build_optimizer
from meshlm.parallel.data.distributed_optimizer import DistributedOptimizer, overlap_gather_with_forward
from meshlm.parallel.data.expert_data_parallel import build_expert_data_parallel
from meshlm.parallel.data.fully_sharded import UnitSchedule
from meshlm.parallel.data.grad_norm import clip_grad_norm_across, clip_grads_, global_grad_norm
from meshlm.parallel.data.grad_reducer import GradientReducer
from meshlm.parallel.tensor.orthogonal_updates import sharded_orthogonalizer
from meshlm.parallel.tensor.sharding import reduce_partial_tp_grads


def build_data_parallel(precision, optim_config, parallel_config, context, model=None):
    """(reducer, optimizer) for a run: the distributed optimizer of ``parallel.sharding_stage``
    (ZeRO 1, 2 or 3; its reducer shards) when it is > 0, else torch AdamW beside an all-reducing
    reducer. Build after ``MixedPrecision`` (the reducer's hooks must run after its gradient
    mover). Given the ``model`` and ``parallel.overlap_param_gather``, the stage-1/2 parameter
    all-gathers run on into the next forward (``overlap_gather_with_forward``); stages 2 and 3
    need the ``model``: their collectives are driven by hooks on it (``fully_sharded.py``)."""
    stage = parallel_config.sharding_stage
    if stage >= 2 and model is None:
        raise ValueError(f"ZeRO stage {stage} needs the model: its collectives are driven by hooks on its blocks.")
    expert_names = {name for name, param in precision.model_parameters if getattr(param, "expert_parallel", False)}
    if expert_names:  # expert parallelism: experts reduced over edp (meshlm/parallel/data/expert_data_parallel.py)
        reducer, optimizer = build_expert_data_parallel(precision, optim_config, parallel_config, context,
                                                        expert_names)
    elif stage >= 1:
        optimizer = DistributedOptimizer(precision.master_parameters(), optim_config, context,
                                         parallel_config.bucket_size_mb, parallel_config.overlap_grad_reduce,
                                         model_parameters=[param for _, param in precision.model_parameters],
                                         model_dtype=precision.dtype, zero_stage=stage,
                                         reduce_grads_in_fp32=parallel_config.reduce_grads_in_fp32,
                                         orthogonalize_many=sharded_orthogonalizer(precision.model_parameters, context))
        precision.hand_masters_to(optimizer)  # bf16/fp16: the fp32 masters are sharded over DP too
        reducer = optimizer.reducer
    else:
        return build_replicated(precision, optim_config, parallel_config, context)
    if stage >= 2:
        optimizer.schedule = UnitSchedule(model, list(getattr(optimizer, "optimizers", [optimizer])))
    if model is not None and stage in (1, 2) and parallel_config.overlap_param_gather:
        overlap_gather_with_forward(model, optimizer)
    return reducer, optimizer


def build_replicated(precision, optim_config, parallel_config, context):
    """(all-reducing reducer, the ``optim.optimizer`` over the full fp32 parameters; Muon sees TP
    shards whole through ``sharded_orthogonalizer``)."""
    named = precision.master_parameters()
    sources = [param for _, param in precision.model_parameters]
    reducer = GradientReducer(named, context, parallel_config.bucket_size_mb, parallel_config.overlap_grad_reduce,
                              model_parameters=sources)
    return reducer, build_optimizer(named, optim_config, sharded_orthogonalizer(precision.model_parameters, context))


def finish_gradients(reducer: GradientReducer, optimizer, precision, context, max_norm: float,
                     tensor_parallel_names: set[str] | None = None,
                     partial_grad_names: set[str] | None = None,
                     expert_names: set[str] | None = None) -> tuple[torch.Tensor, bool]:
    """After the last micro-batch's backward: finish the DP reduction, sum TP-partial gradients
    over the TP group (on this rank's shards only with the distributed optimizer; sums commute, so
    after the DP sum is as good as before it), unscale (fp16) and clip by the global norm.
    Returns (norm, skip), skip being True when the norm is not finite."""
    reducer.finish()
    sharded = hasattr(optimizer, "named_grad_shards")  # a DistributedOptimizer (or a group of them)
    named_grads = optimizer.named_grad_shards() if sharded else reducer.named_grads()
    if context.tp_size > 1 and partial_grad_names:
        reduce_partial_tp_grads(named_grads, context, partial_grad_names)
    precision.gradients_to_master(check_nonfinite=False)  # divides by the loss scale (linear, so after the
    # sums); the global norm below is non-finite exactly when some gradient entry is
    norm = clip_grads_(named_grads, max_norm, context, sharded, tensor_parallel_names, reducer.buffer.device,
                       expert_names)
    return norm, not bool(torch.isfinite(norm))


__all__ = ["DistributedOptimizer", "GradientReducer", "build_data_parallel", "clip_grad_norm_across", "clip_grads_",
           "finish_gradients", "global_grad_norm"]
