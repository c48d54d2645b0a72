"""The global gradient norm, and clipping by it, when the gradient is spread over many ranks.

Global-norm clipping (Pascanu et al. 2013, "On the difficulty of training recurrent neural
networks") rescales the whole gradient by ``min(1, max_norm / ||g||)``. With parallelism no rank
holds the whole g, and the norm must still be the single-process one: every element of every
parameter counted exactly once. Some elements live on one rank only (a TP shard, a ZeRO-1 shard,
a pipeline stage's blocks); others are *replicated* -- several ranks hold the same reduced value.

**The canonical-owner rule.** Each element has exactly one canonical owner: among the ranks
that hold the same value, the one whose rank is 0 in every group over which that value is
replicated. Each rank sums the squares of the elements it is the canonical owner of, and ONE
all-reduce over the whole world adds those sums up. A value is replicated

* over **tp** unless the parameter is a TP shard (``param.tensor_parallel``): norm weights,
  routers, ... are the same on every TP rank (partial gradients are summed over TP first);
* over **dp_cp** (the data- and context-parallel ranks together, which hold the same dense
  shards and see different samples / tokens) unless the gradient is sharded over it by the
  distributed optimizer (``sharded_by_dp``): after the all-reduce every replica holds the sum;
* **expert parameters** (``expert_names``: the routed experts of expert parallelism, whose
  shards are distinct over ep and etp and which are not replicated over tp) over **edp** unless
  the distributed optimizer shards them there;
* (other parallelisms add their cases in ``is_canonical_owner``: a tied embedding's last-stage
  copy is never canonical; different pipeline stages hold different parameters.)

So the norm is the same number on every rank, and every rank clips by the same factor and takes
the same skip decision. (When every rank holds the whole reduced gradient -- pure DP/CP
without the distributed optimizer -- each rank computes the norm alone, with no communication.)
One all-reduce of one scalar, whatever the layout, instead of a chain of
reductions over nested groups that each layout would order differently. The clip factor is
torch's: ``min(1, max_norm / (norm + 1e-6))``. A non-finite norm (an inf or nan anywhere, on
any rank) leaves the gradients untouched; the caller skips the step. A non-canonical replica's
inf is also its canonical owner's (replicas hold the same values), so nothing is missed.
"""

from __future__ import annotations

import torch

from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.pipeline.stages import STAGE_COPY_NAMES


def is_canonical_owner(name: str, context, sharded_by_dp: bool, tensor_parallel_names: set[str] | None,
                       expert_names: set[str] | None = None) -> bool:
    """Whether this rank counts parameter ``name``'s gradient elements in the global norm: it is
    rank 0 of every group over which that gradient is replicated (see the module docstring)."""
    if expert_names and name in expert_names:
        return sharded_by_dp or context.edp_rank == 0
    tensor_parallel = bool(tensor_parallel_names) and name in tensor_parallel_names
    if not tensor_parallel and context.tp_rank != 0:
        return False
    if not sharded_by_dp and context.dp_cp_rank != 0:
        return False
    if name in STAGE_COPY_NAMES and not context.is_first_stage:
        return False  # the last pipeline stage's copy of a tied embedding: the first stage counts it
    return True


def global_grad_norm(named_grads: list[tuple[str, torch.Tensor]], context, sharded_by_dp: bool,
                     tensor_parallel_names: set[str] | None = None, device: torch.device | None = None,
                     expert_names: set[str] | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient from this rank's (name, gradient) pairs; see the module docstring.

    ``sharded_by_dp``: the gradients are this rank's distributed-optimizer shards (distinct over
    the dp_cp group) rather than full replicas. ``tensor_parallel_names``: the names of TP-shard
    parameters (``tensor_parallel_names(model)``), required when ``context.tp_size > 1``.
    ``device``: where to reduce when this rank has no gradients (default: the run's). ``expert_names``: the names of
    expert-grid parameters (``expert_parallel_names(model)``). Collective over the world.
    """
    if context.tp_size > 1 and tensor_parallel_names is None:
        raise ValueError("global_grad_norm with tp_size > 1 needs tensor_parallel_names (which parameters are "
                         "TP shards); pass meshlm.parallel.tensor.sharding.tensor_parallel_names(model).")
    if device is None:
        device = named_grads[0][1].device if named_grads else context.device
    if holds_whole_gradient(context, sharded_by_dp):
        return _sum_of_squares([grad for _, grad in named_grads], device).sqrt()
    owned = [grad for name, grad in named_grads
             if is_canonical_owner(name, context, sharded_by_dp, tensor_parallel_names, expert_names)]
    total = _sum_of_squares(owned, device)
    if context.world_size > 1:
        all_reduce_(total, context.world_group)
    return total.sqrt()


def holds_whole_gradient(context, sharded_by_dp: bool) -> bool:
    """True when every rank holds a replica of the whole reduced gradient (one process, or pure
    data/context parallelism without the distributed optimizer): the norm is then computed here,
    with no communication at all."""
    return (context.world_size == context.dp_cp_size and context.ep_size == 1 and context.etp_size == 1
            and not sharded_by_dp)


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack(torch._foreach_norm([grad.float() if grad.dtype != torch.float32 else grad for grad in grads]))
    return (norms * norms).sum()


@torch.no_grad()
def clip_grads_(named_grads: list[tuple[str, torch.Tensor]], max_norm: float, context, sharded_by_dp: bool,
                tensor_parallel_names: set[str] | None = None, device: torch.device | None = None,
                expert_names: set[str] | None = None) -> torch.Tensor:
    """Scale the gradients in place so that their global norm is at most ``max_norm`` (<= 0: only
    measure); return the norm before clipping."""
    norm = global_grad_norm(named_grads, context, sharded_by_dp, tensor_parallel_names, device, expert_names)
    if max_norm > 0 and named_grads and bool(torch.isfinite(norm)):
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([grad for _, grad in named_grads], factor)
    return norm


def clip_grad_norm_across(params_with_names: list[tuple[str, torch.Tensor]], max_norm: float, context,
                          sharded_by_dp: bool, tensor_parallel_names: set[str] | None = None) -> torch.Tensor:
    """``clip_grads_`` on the ``.grad`` of (name, parameter) pairs (those without a gradient are skipped)."""
    named_grads = [(name, param.grad) for name, param in params_with_names if param.grad is not None]
    device = params_with_names[0][1].device if params_with_names else None
    return clip_grads_(named_grads, max_norm, context, sharded_by_dp, tensor_parallel_names, device)


__all__ = ["clip_grad_norm_across", "clip_grads_", "global_grad_norm", "is_canonical_owner"]
