"""The collectives of tensor and sequence parallelism, each with its adjoint beside it.

Every data movement between ranks is a *linear operator* on the distributed tensor -- the view
of DistDL (Hewett & Grady 2020, "A linear algebraic approach to model parallelism"). A linear
operator F has an adjoint F*, defined by <F x, y> = <x, F* y> for all x, y, and the gradient of
a loss through y = F x is exactly F* applied to the gradient of y. So the backward of a
collective is never invented: it is its adjoint, and each ``autograd.Function`` below is one
such pair, whose backward calls the other member of the pair. The tests check every pair with the
dot-product test: for random x and y, both sides of <F x, y> = <x, F* y> agree to rounding.

Two kinds of distributed tensor appear, and the inner product differs between them:

* *per-rank* (distributed): each rank holds its own values -- a shard, or a partial sum. The
  inner product sums over ranks: <x, y> = sum_r <x_r, y_r>.
* *replicated*: every rank holds the same values; it is ONE vector stored n times, so its inner
  product is taken once (on any rank), not n times.

The conjugate operators of Megatron-LM (Shoeybi et al. 2019, section 3) are the two maps between
these spaces. ``copy_to_group`` (called f) turns a replicated tensor into per-rank copies -- a
broadcast: identity in the forward, and its adjoint sums the per-rank gradients (all-reduce).
``reduce_from_group`` (called g) sums per-rank partial results into a replicated one: all-reduce
forward, identity backward. A column-parallel linear layer starts with f; a row-parallel one ends
with g; a tensor-parallel MLP or attention block costs one all-reduce forward and one backward.

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) replaces g by a reduce-scatter
along the sequence (each rank keeps the summed values of its own slice of the sequence, so norms
and the residual stream are sharded) and f by an all-gather along the sequence. These two are
each other's adjoint: ``all_gather_along`` (concatenate every rank's shard; adjoint: sum the
per-rank gradients and keep one's own slice) and ``reduce_scatter_along``. Together they move
the same bytes as the one all-reduce they replace (a ring all-reduce *is* a reduce-scatter
followed by an all-gather).

``scatter_along`` and ``gather_along`` move between a replicated tensor and its shards without
summing: keeping one's own slice of a replicated tensor is the adjoint of gathering the slices
into a replicated tensor. ``all_to_all_along`` re-shards a tensor from one dim to another (used
by expert and context parallelism); it is a permutation, so its adjoint is its inverse: the same
exchange with the two dims swapped. ``all_to_all_uneven`` is its row-wise form with a different
number of rows for every pair of ranks (expert parallelism's token exchange); it is a permutation
too, and its adjoint is the same exchange with the send and receive counts swapped.

Every function returns its input unchanged -- no communication, no autograd node -- when the
group is None or has a single rank, so a model built for a world of one is an ordinary model.

**One place for all communication.** Groups are ``meshlm.parallel.groups.Group`` objects (a
process group with its name, the run's device and the run's record), and every byte that moves
between ranks -- these autograd pairs, and the plain collectives, point-to-point batches and
object exchanges the rest of meshlm imports from here -- goes through
``meshlm/parallel/plain_collectives.py``, the only module that calls torch.distributed's
communication functions. There each call refuses a tensor that is not on the run's device
(naming the operation, the group and the tensor) and, under ``parallel.check_collectives``, is
recorded so that the ranks can compare their sequences after every step
(``collective_checks.py``).
"""

from __future__ import annotations

import functools

import torch

from meshlm.parallel.groups import Group
from meshlm.parallel.plain_collectives import (all_gather_into_, all_gather_objects, all_reduce_, all_to_all_, barrier,
                                               broadcast_objects, gather_objects, reduce_scatter_into_,
                                               send_and_receive)


def group_size(group: Group | None) -> int:
    return 1 if group is None else group.size


def group_rank(group: Group | None) -> int:
    return 0 if group is None else group.rank


# --- the raw collectives, on contiguous buffers --------------------------------------------------

def _all_reduced(x: torch.Tensor, group) -> torch.Tensor:
    """A new tensor holding the sum of x over the group (x itself is left alone)."""
    summed = x.clone(memory_format=torch.contiguous_format)
    all_reduce_(summed, group)
    return summed


def _check_divisible(x: torch.Tensor, dim: int, size: int, what: str) -> None:
    if x.shape[dim] % size:
        raise ValueError(f"{what}: dim {dim} of a tensor of shape {tuple(x.shape)} has size {x.shape[dim]}, "
                         f"not divisible by the group size {size}; every rank needs an equal slice.")


def _stacked_chunks(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """x cut into `size` equal chunks along dim and stacked in a new leading dim, contiguous
    (a free view when dim is 0 or every dim before it has size 1)."""
    return x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()


def _unstacked(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of ``_stacked_chunks``: concatenate the leading-dim chunks along dim."""
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def _gathered(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's x concatenated along dim in rank order. The gather writes a stack
    [size, *x.shape] (no copy of the input); moving the rank dim next to dim costs one copy of
    the output, and none when dim is 0. (gloo wants the buffers concatenated on dim 0, hence
    the flattened views.)"""
    stacked = x.new_empty((group_size(group), *x.shape))
    all_gather_into_(stacked.flatten(0, 1), x.contiguous(), group)
    return _unstacked(stacked, dim)


def _reduce_scattered(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum of x over the group, keeping this rank's slice along dim."""
    size = group_size(group)
    _check_divisible(x, dim, size, "reduce_scatter_along")
    stacked = _stacked_chunks(x, dim, size)
    own = stacked.new_empty(stacked.shape[1:])
    reduce_scatter_into_(own, stacked.flatten(0, 1), group)
    return own


def _own_slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    size = group_size(group)
    _check_divisible(x, dim, size, "scatter_along")
    length = x.shape[dim] // size
    return x.narrow(dim, group_rank(group) * length, length).clone(memory_format=torch.contiguous_format)


def _exchanged(x: torch.Tensor, split_dim: int, concat_dim: int, group) -> torch.Tensor:
    """Chunk j of x along split_dim goes to rank j; the chunks received from every rank are
    concatenated along concat_dim in rank order."""
    size = group_size(group)
    _check_divisible(x, split_dim, size, "all_to_all_along")
    outgoing = _stacked_chunks(x, split_dim, size)
    incoming = torch.empty_like(outgoing)
    all_to_all_(incoming, outgoing, group)
    return _unstacked(incoming, concat_dim)


# --- the autograd pairs --------------------------------------------------------------------------

class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_from_group(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduced(x, group)

    @staticmethod
    def backward(ctx, grad):
        return copy_to_group(grad, ctx.group), None


class _AllGatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gathered(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scattered(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, ctx.dim, ctx.group), None, None


class _ScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.dim, ctx.group), None, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gathered(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return scatter_along(grad, ctx.dim, ctx.group), None, None


class _AllToAllAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, concat_dim, group):
        ctx.split_dim, ctx.concat_dim, ctx.group = split_dim, concat_dim, group
        return _exchanged(x, split_dim, concat_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_along(grad, ctx.concat_dim, ctx.split_dim, ctx.group), None, None, None


# --- the public functions ------------------------------------------------------------------------

def copy_to_group(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """f (Shoeybi et al. 2019). Forward: identity (a replicated tensor enters per-rank
    computation). Adjoint: all-reduce(sum) of the per-rank gradients."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """g (Shoeybi et al. 2019). Forward: all-reduce(sum) of per-rank partial results into a
    replicated tensor. Adjoint: identity."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def all_gather_along(x: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """Sequence parallelism's entry (Korthikanti et al. 2022). Forward: every rank's x
    concatenated along dim in rank order; each rank then computes with its copy. Adjoint:
    reduce-scatter along dim (sum the per-rank gradients, keep one's own slice)."""
    return x if group_size(group) == 1 else _AllGatherAlong.apply(x, dim % x.dim(), group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """Sequence parallelism's exit (Korthikanti et al. 2022). Forward: the sum of x over the
    ranks, of which this rank keeps its slice along dim. Adjoint: all-gather along dim."""
    return x if group_size(group) == 1 else _ReduceScatterAlong.apply(x, dim % x.dim(), group)


def scatter_along(x: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """Forward: this rank's slice along dim of a replicated x (no communication). Adjoint:
    all-gather the slices' gradients into a replicated gradient."""
    return x if group_size(group) == 1 else _ScatterAlong.apply(x, dim % x.dim(), group)


def gather_along(x: torch.Tensor, dim: int, group: Group | None) -> torch.Tensor:
    """Forward: all-gather the shards along dim into a replicated tensor. Adjoint: keep this
    rank's slice of the replicated gradient (no communication)."""
    return x if group_size(group) == 1 else _GatherAlong.apply(x, dim % x.dim(), group)


def all_to_all_along(x: torch.Tensor, split_dim: int, concat_dim: int,
                     group: Group | None) -> torch.Tensor:
    """Forward: x cut into group-size chunks along split_dim, chunk j sent to rank j, the chunks
    received concatenated along concat_dim in rank order. Adjoint (= inverse, a permutation):
    the same exchange with split_dim and concat_dim swapped."""
    if group_size(group) == 1:
        return x
    return _AllToAllAlong.apply(x, split_dim % x.dim(), concat_dim % x.dim(), group)


# --- uneven all-to-all: rows of different counts to each rank (expert parallelism) -------------------

def _exchange_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group, async_op: bool):
    """(output buffer, work): rows [sum(input_splits), ...] of x cut into consecutive pieces, piece j
    sent to rank j; output_splits[i] rows received from rank i, in rank order."""
    output = x.new_empty((sum(output_splits), *x.shape[1:]))
    work = all_to_all_(output, x.contiguous(), group, list(output_splits), list(input_splits), async_op=async_op)
    return output, work


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _exchange_rows(x, output_splits, input_splits, group, async_op=False)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_uneven(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


class PendingExchange:
    """An uneven all-to-all that was launched and may still be in flight; ``wait()`` returns its
    output (the tensor must not be read before). Its backward is an ordinary, blocking exchange."""

    def __init__(self, output: torch.Tensor | None = None):
        self.output, self.work = output, None

    def wait(self) -> torch.Tensor:
        return self.output if self.work is None else _WaitForExchange.apply(self.output, self)


class _StartAllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, pending):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        output, pending.work = _exchange_rows(x, output_splits, input_splits, group, async_op=True)
        return output

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_uneven(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None, None


class _WaitForExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, pending):
        pending.work.wait()
        pending.work = None
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_to_all_uneven(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      group: Group | None) -> torch.Tensor:
    """Forward: the rows of x cut into consecutive pieces of ``input_splits[j]`` rows, piece j sent
    to rank j; the ``output_splits[i]`` rows received from rank i concatenated in rank order (the
    token exchange of expert parallelism, where every rank sends a different number of tokens to
    every other). Adjoint (= inverse, a permutation of rows): the same exchange with the two split
    lists swapped. Zero rows in any direction are fine."""
    return x if group_size(group) == 1 else _AllToAllUneven.apply(x, list(output_splits), list(input_splits), group)


def start_all_to_all_uneven(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                            group: Group | None) -> PendingExchange:
    """``all_to_all_uneven`` launched asynchronously: compute something else, then ``.wait()``.
    (Backward runs the adjoint exchange synchronously.)"""
    if group_size(group) == 1:
        return PendingExchange(x)
    pending = PendingExchange()
    pending.output = _StartAllToAllUneven.apply(x, list(output_splits), list(input_splits), group, pending)
    return pending


# --- plain collectives on gradients --------------------------------------------------------------

def all_reduce_coalesced_(tensors: list[torch.Tensor], group: Group | None) -> list[torch.Tensor]:
    """Sum each tensor over the group in place, with one all-reduce per dtype: the tensors are
    flattened into one buffer (many small all-reduces cost a latency each), reduced, and copied
    back. Not autograd-aware; meant for gradients after backward."""
    if group_size(group) == 1:
        return tensors
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same_kind in by_dtype.values():
        buffer = torch.cat([tensor.reshape(-1) for tensor in same_kind])
        all_reduce_(buffer, group)
        for tensor, reduced in zip(same_kind, buffer.split([t.numel() for t in same_kind])):
            tensor.copy_(reduced.view_as(tensor))
    return tensors


def summing_over(group: Group | None):
    """A function that sums a tensor in place over ``group`` (None for one rank): how a layer
    below ``parallel`` (the MoE balancing of ``meshlm.models``) is handed a collective."""
    return None if group_size(group) == 1 else functools.partial(all_reduce_, group=group)


__all__ = ["PendingExchange", "all_gather_along", "all_gather_into_", "all_gather_objects", "all_reduce_",
           "all_reduce_coalesced_", "all_to_all_", "all_to_all_along", "all_to_all_uneven", "barrier",
           "broadcast_objects", "copy_to_group", "gather_along", "gather_objects", "group_rank", "group_size",
           "reduce_from_group", "reduce_scatter_along", "reduce_scatter_into_", "scatter_along", "send_and_receive",
           "start_all_to_all_uneven", "summing_over"]
