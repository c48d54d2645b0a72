"""The global gradient norm, and clipping by it, when the gradient is spread over TP and DP ranks.

Global-norm clipping (Pascanu et al. 2013, "On the difficulty of training recurrent neural
networks") rescales the whole gradient by ``min(1, max_norm / ||g||)``. With parallelism no rank
holds the whole g, and the norm must still be the single-process one: every element of every
parameter counted exactly once. Where each element lives decides how its square is summed:

* **TP shards** (``param.tensor_parallel``): each rank of a TP group holds a different slice,
  so their squares are summed over the TP group.
* **Replicated over TP** (norm weights, routers, ...): every TP rank holds the same full
  gradient (partial ones were summed over TP first), so it counts once -- we take it from TP
  rank 0 only, so a single all-reduce over TP sums both kinds.
* **DP**: without the distributed optimizer every DP rank holds the same reduced gradient after
  the all-reduce, so nothing is summed over DP; with it, each DP rank holds a distinct shard of
  the reduced gradient, so the squares are also summed over the DP group.

So ``norm**2 = sum_over_DP_if_sharded( sum_over_TP( shard squares + [tp_rank == 0] replicated
squares ) )``, the same number on every rank, so every rank clips by the same factor and makes
the same skip decision. The clip factor is torch's: ``min(1, max_norm / (norm + 1e-6))``. A
non-finite norm (an inf or nan anywhere, on any rank) leaves the gradients untouched; the caller
skips the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_grad_norm(named_grads: list[tuple[str, torch.Tensor]], context, sharded_by_dp: bool,
                     tensor_parallel_names: set[str] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """L2 norm of the whole model's gradient from this rank's (name, gradient) pairs; see the module docstring.

    ``tensor_parallel_names``: the names of TP-shard parameters (``tensor_parallel_names(model)``),
    required when ``context.tp_size > 1``. ``device``: where to reduce when this rank has no gradients.
    """
    if context.tp_size > 1 and tensor_parallel_names is None:
        raise ValueError("global_grad_norm with tp_size > 1 needs tensor_parallel_names (which parameters are "
                         "TP shards); pass meshlm.parallel.tensor_parallel.tensor_parallel_names(model).")
    sharded = [grad for name, grad in named_grads if tensor_parallel_names and name in tensor_parallel_names]
    replicated = [grad for name, grad in named_grads if not (tensor_parallel_names and name in tensor_parallel_names)]
    if device is None:
        device = named_grads[0][1].device if named_grads else torch.device("cpu")
    replicated_squares = _sum_of_squares(replicated if context.tp_rank == 0 else [], device)
    total = _sum_of_squares(sharded, device) + replicated_squares
    if context.tp_size > 1:
        dist.all_reduce(total, group=context.tp_group)
    if sharded_by_dp and context.dp_size > 1:
        dist.all_reduce(total, group=context.dp_group)
    return total.sqrt()


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), device=device)
    norms = torch.stack(torch._foreach_norm([grad.float() if grad.dtype != torch.float32 else grad for grad in grads]))
    return (norms * norms).sum()


@torch.no_grad()
def clip_grads_(named_grads: list[tuple[str, torch.Tensor]], max_norm: float, context, sharded_by_dp: bool,
                tensor_parallel_names: set[str] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Scale the gradients in place so that their global norm is at most ``max_norm`` (<= 0: only
    measure); return the norm before clipping."""
    norm = global_grad_norm(named_grads, context, sharded_by_dp, tensor_parallel_names, device)
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


__all__ = ["clip_grad_norm_across", "clip_grads_", "global_grad_norm"]
