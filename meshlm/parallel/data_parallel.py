"""Data parallelism: where the pieces are, and the one call that picks them for a run.

Every DP rank holds a replica of the (tensor-parallel) model and runs micro-batches of its own
samples; each micro-batch loss is divided by the micro-batch count of the WHOLE step (all DP
ranks together), so the sum of the ranks' gradients is the single-process gradient of the
step's mean loss. Three pieces turn that into a step:

* ``grad_reducer.GradientReducer`` -- fp32 gradient buckets, summed over DP by all-reduces that
  start during the last micro-batch's backward (overlap), nothing sent on the others.
* ``distributed_optimizer.DistributedOptimizer`` -- ZeRO stage 1: the reducer reduce-scatters
  instead, each rank updates its 1/dp of the fp32 values with its 1/dp of the Adam moments,
  and an all-gather brings the updated values back to every rank.
* ``grad_norm`` -- the global gradient norm (and clipping by it), every element counted once
  across TP shards and, with the distributed optimizer, DP shards.

A trainer step with either optimizer::

    reducer.zero_grad()
    for micro-batch i of n:   (with reducer.no_sync() unless i == n - 1): backward(loss_i / total)
    reducer.finish()                          # then: TP partial-grad sums, unscale (fp16)
    norm = clip (DistributedOptimizer.clip_grad_norm_, or clip_grad_norm_across(..., sharded_by_dp=False))
    optimizer.step(); precision.master_to_model()
"""

from __future__ import annotations

from meshlm.parallel.distributed_optimizer import DistributedOptimizer
from meshlm.parallel.grad_norm import clip_grad_norm_across, clip_grads_, global_grad_norm
from meshlm.parallel.grad_reducer import GradientReducer
from meshlm.training.optimizer import build_optimizer


def build_data_parallel(precision, optim_config, parallel_config, context):
    """(reducer, optimizer) for a run: the distributed optimizer (whose reducer shards) when
    ``parallel.distributed_optimizer``, else torch AdamW beside an all-reducing reducer. Build
    after ``MixedPrecision`` (the reducer's hooks must run after its gradient mover)."""
    named = precision.master_parameters()
    sources = [param for _, param in precision.model_parameters]
    if parallel_config.distributed_optimizer:
        optimizer = DistributedOptimizer(named, optim_config, context, parallel_config.bucket_size_mb,
                                         parallel_config.overlap_grad_reduce, model_parameters=sources)
        return optimizer.reducer, optimizer
    reducer = GradientReducer(named, context, parallel_config.bucket_size_mb, parallel_config.overlap_grad_reduce,
                              model_parameters=sources)
    return reducer, build_optimizer(named, optim_config)


__all__ = ["DistributedOptimizer", "GradientReducer", "build_data_parallel", "clip_grad_norm_across", "clip_grads_",
           "global_grad_norm"]
