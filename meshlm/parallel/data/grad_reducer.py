"""Data-parallel gradient reduction: flat buckets, launched during backward, in a fixed order.

Data parallelism runs one replica of the model per DP rank, each on its own micro-batches. Each
micro-batch loss is scaled by 1 / (micro-batches per step, counted over ALL ranks) before its
backward, so the gradient of the step's mean loss is the SUM of the ranks' accumulated gradients:
one all-reduce(sum) over the DP group per step, after which every replica takes the same step.

How that sum is done decides how much of it is hidden behind computation (Li et al. 2020,
"PyTorch Distributed"; Megatron-LM's DDP):

* **Buckets.** One collective per parameter pays the latency of hundreds of small messages; one
  collective for everything can only start when backward has ended. So the parameters are laid
  out, in *reverse* order of definition (backward produces the last layers' gradients first), in
  one flat fp32 buffer cut into buckets of about ``bucket_size_mb``, closed at parameter
  boundaries. Each gradient the optimizer reads is a *view* into that buffer (``holder.grad``),
  so autograd (or MixedPrecision's grad mover) accumulates straight into it: no copy in, none out.
* **Overlap.** A post-accumulate-grad hook on every parameter marks it ready; when every
  parameter of a bucket is ready, the bucket's all-reduce is launched asynchronously and
  backward goes on computing earlier layers meanwhile. ``finish()`` launches what is left and
  waits.
* **A fixed launch order.** Every rank must issue its collectives in the same order (NCCL hangs
  otherwise), but the order in which the hooks fire may differ between ranks: an MoE graph
  depends on the routing, and an expert that received no tokens gets its gradient at another
  moment. So buckets launch in one fixed order (``LaunchOrder``), index order for one reducer:
  a ready bucket waits until every bucket before it has launched (as in PyTorch DDP). Under
  expert parallelism two reducers -- dense weights over dp_cp, experts over edp, groups that
  share ranks -- run in one backward; ``ReducerGroup`` gives them ONE merged order (by each
  bucket's place in backward order), so that no two ranks launch a dense and an expert bucket
  in opposite orders either.
* **Accumulation.** The micro-batches before the last of a step run inside ``no_sync()``: their
  gradients only accumulate locally and nothing is communicated; the last one triggers the
  reduction of the accumulated sum. So the communication per step is one pass over the buffer
  whatever the number of micro-batches. Under pipeline parallelism each model chunk of a rank
  has its own last backward, at its own time; inside ``no_sync()``, ``sync_parameters(names)``
  makes one backward final for those parameters only (``pipeline/pipelined_model.py``), so a
  chunk's buckets go out while the schedule still runs the other chunks. ``launches`` records
  when each bucket went out.

Precision. In fp32 the holders are the model parameters themselves. In bf16/fp16 they are
``MixedPrecision``'s fp32 masters: its hook (registered first, so it runs first) adds each
low-precision gradient into ``master.grad`` -- our bucket view -- and our hook, registered on the
same model parameter, then marks it ready. So the overlap works in every precision, and the
reduction always sums fp32 numbers (with fp16 they are still multiplied by the loss scale, which
is linear and divided out later by ``MixedPrecision.gradients_to_master``). The reduced sum is
exact up to the order of fp32 additions.

Sharded mode (``shard=True``, used by the distributed optimizer): every bucket is padded to a
multiple of the DP size and *reduce-scattered* instead: rank r receives the summed gradient of
the r-th 1/dp slice of every bucket, in place in the buffer (the rest of the buffer keeps this
rank's unreduced local values, which nobody reads).

Tensor parallelism. Replicated parameters whose gradient is partial on each TP rank are summed
over the TP group too. Sums commute, so that TP sum may run after ``finish()`` on the DP-reduced
gradients (in sharded mode, on this rank's shards only: ``DistributedOptimizer.named_grad_shards``).

Step cycle, as the trainer drives it::

    reducer.zero_grad()                       zero the buffer, (re)attach the views
    with reducer.no_sync(): backward(mb_1..mb_{n-1})
    backward(mb_n)                            buckets launch as they fill (overlap_grad_reduce)
    reducer.finish()                          launch the rest, wait for all

A parameter that gets no gradient still has its (zero) view, so an optimizer steps it like one
with a zero gradient; in our models every trainable parameter is used by every step.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from meshlm.parallel.collectives import all_reduce_, reduce_scatter_into_

BYTES_PER_GRAD_ELEMENT = 4
"""The gradient buffer is fp32 in every precision."""


@dataclass(frozen=True)
class Bucket:
    start: int
    """First element of the bucket in the flat buffer."""
    end: int
    """One past its last element, padding included (so ``end - start`` divides by the pad multiple)."""
    params: tuple[int, ...]
    """Indices of the parameters it holds, in buffer order."""

    @property
    def size(self) -> int:
        return self.end - self.start

    def local_slice(self, num_shards: int) -> slice:
        """Where the bucket's 1/num_shards lives in a buffer holding only one rank's shard of every
        bucket (moments, ZeRO-2/3 gradient and parameter shards)."""
        return slice(self.start // num_shards, self.end // num_shards)

    def shard(self, rank: int, num_shards: int) -> tuple[int, int]:
        """[start, end) of rank's contiguous 1/num_shards of the bucket in the flat buffer."""
        length = self.size // num_shards
        return self.start + rank * length, self.start + (rank + 1) * length


@dataclass(frozen=True)
class BufferLayout:
    """Where each parameter lives in a flat buffer, and how the buffer is cut into buckets."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    bucket_of: tuple[int, ...]
    """Bucket index of each parameter."""
    total: int
    """Elements in the buffer, padding included."""

    def view(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter ``index``'s slot in ``buffer``, shaped like the parameter."""
        numel = self.shapes[index].numel()
        return buffer[self.offsets[index]:self.offsets[index] + numel].view(self.shapes[index])


def plan_buckets(shapes: list[torch.Size], bucket_elements: int, pad_multiple: int = 1) -> BufferLayout:
    """Lay out parameters of these shapes in reverse order; close a bucket at the first parameter
    boundary at or past ``bucket_elements`` and pad it to a multiple of ``pad_multiple``."""
    offsets, bucket_of = [0] * len(shapes), [0] * len(shapes)
    buckets, members, start, cursor = [], [], 0, 0

    def close_bucket() -> None:
        nonlocal start, cursor, members
        end = start + -(-(cursor - start) // pad_multiple) * pad_multiple
        buckets.append(Bucket(start, end, tuple(members)))
        start = cursor = end
        members = []

    for index in reversed(range(len(shapes))):
        offsets[index], bucket_of[index] = cursor, len(buckets)
        members.append(index)
        cursor += shapes[index].numel()
        if cursor - start >= bucket_elements:
            close_bucket()
    if members:
        close_bucket()
    return BufferLayout(tuple(shapes), tuple(offsets), tuple(buckets), tuple(bucket_of), cursor)


def trainable_pairs(parameters: list[tuple[str, torch.Tensor]], model_parameters: list[torch.Tensor] | None):
    """(names, holders, sources) of the trainable ``parameters``: the (name, tensor) pairs whose
    ``.grad`` the optimizer reads, and the model tensors (``model_parameters``, aligned with them;
    default: the same tensors) whose backward produces those gradients, where hooks go."""
    sources = model_parameters if model_parameters is not None else [tensor for _, tensor in parameters]
    if len(sources) != len(parameters):
        raise ValueError(f"model_parameters has {len(sources)} tensors for {len(parameters)} parameters; "
                         "pass one model tensor per (name, parameter) pair, in the same order.")
    kept = [index for index, (_, tensor) in enumerate(parameters) if tensor.requires_grad]
    return ([parameters[index][0] for index in kept], [parameters[index][1] for index in kept],
            [sources[index] for index in kept])


def bucket_elements_for(bucket_size_mb: float) -> int:
    return max(1, int(bucket_size_mb * 2**20) // BYTES_PER_GRAD_ELEMENT)


class LaunchOrder:
    """The one order in which the buckets of one or more reducers are launched: an entry
    launches when its bucket is ready and every entry before it has launched; ``finish()``
    launches the rest, in order, and waits for every reducer. Built by ``GradientReducer`` (its
    own buckets in index order) or by ``ReducerGroup`` (several reducers merged)."""

    def __init__(self, entries: list[tuple["GradientReducer", int]]):
        self.entries = entries
        self.reducers = list({id(reducer): reducer for reducer, _ in entries}.values())
        self.cursor = 0
        """Entries before it have launched (since the last ``restart``)."""

    def restart(self) -> None:
        self.cursor = 0

    def launch_ready(self) -> None:
        while self.cursor < len(self.entries):
            reducer, bucket = self.entries[self.cursor]
            if bucket >= reducer.next_bucket:  # not launched yet
                if not reducer.bucket_ready(bucket):
                    return
                reducer.launch(bucket)
            self.cursor += 1

    def finish(self) -> None:
        """Launch every bucket not launched yet, in order, and wait for all; idempotent until zero_grad()."""
        if all(reducer.reduced for reducer in self.reducers):
            return
        for reducer in self.reducers:
            reducer.attach_all()  # gradients that arrived without a hook (written by hand)
        for reducer, bucket in self.entries[self.cursor:]:
            if bucket >= reducer.next_bucket:
                reducer.launch(bucket)
        self.cursor = len(self.entries)
        for reducer in self.reducers:
            reducer.wait()
            reducer.reduced = True


class GradientReducer:
    """Sums the gradients of ``parameters`` over the dp_cp group of ``context``, bucket by bucket
    (the DP and CP ranks together: they hold the same dense parameters and saw different samples
    or different tokens of the same sequences; with cp = 1 it is the DP group).

    ``parameters``: (name, tensor) pairs whose ``.grad`` the optimizer reads (fp32: the model's
    parameters; bf16/fp16: ``MixedPrecision``'s masters). ``model_parameters``: the model tensors
    whose backward produces those gradients, aligned with ``parameters`` (default: the same
    tensors); the readiness hooks go on them. Build it after ``MixedPrecision``.
    """

    def __init__(self, parameters: list[tuple[str, torch.Tensor]], context, bucket_size_mb: float = 25.0,
                 overlap: bool = True, shard: bool = False, model_parameters: list[torch.Tensor] | None = None):
        self.names, self.holders, self.sources = trainable_pairs(parameters, model_parameters)
        # Dense parameters are replicated over DP and CP together (each CP rank sees other tokens).
        self.group, self.dp_size, self.dp_rank = context.dp_cp_group, context.dp_cp_size, context.dp_cp_rank
        self.overlap, self.shard = overlap, shard
        self.layout = plan_buckets([holder.shape for holder in self.holders], bucket_elements_for(bucket_size_mb),
                                   self.dp_size if shard else 1)
        device = self.holders[0].device if self.holders else context.device
        self.buffer = torch.zeros(self.layout.total, dtype=torch.float32, device=device)
        self.grad_views = [self.layout.view(self.buffer, index) for index in range(len(self.holders))]
        self.sync = True
        self.synced_params: frozenset[int] = frozenset()
        """Parameters whose gradients count as final even inside ``no_sync()`` (``sync_parameters``)."""
        self.index_of = {name: index for index, name in enumerate(self.names)}
        self.pending: list = []
        self.launch_order = LaunchOrder([(self, bucket) for bucket in range(len(self.layout.buckets))])
        """Shared with other reducers when a ``ReducerGroup`` merges their orders."""
        self.launches: list[tuple[int, float]] = []
        """This step's reductions so far: (bucket index, ``time.perf_counter()`` at launch), in order."""
        self.hook_handles = [source.register_post_accumulate_grad_hook(self._ready_hook(index))
                             for index, source in enumerate(self.sources)]
        self.zero_grad()

    # --- the step cycle -------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the buffer and point every holder's ``.grad`` at its view; call before a step's first backward."""
        self.wait()
        self.buffer.zero_()
        for holder, view in zip(self.holders, self.grad_views):
            holder.grad = view
        self.ready = [set() for _ in self.layout.buckets]
        self.next_bucket = 0
        self.reduced = False
        self.launch_order.restart()
        self.launches = []

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate locally (the non-final micro-batches of a step)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    @contextlib.contextmanager
    def sync_parameters(self, names):
        """Inside ``no_sync()``: backward passes in this block are the last of the step for the
        parameters named ``names`` (those this reducer holds), whose buckets then launch as they
        fill: a pipeline chunk's last backward."""
        indices = {self.index_of[name] for name in names if name in self.index_of}
        previous, self.synced_params = self.synced_params, self.synced_params | indices
        try:
            yield
        finally:
            self.synced_params = previous

    def finish(self) -> None:
        """Launch every bucket not launched yet, in the launch order, and wait for all (every
        reducer sharing the order: they are one reduction); idempotent until zero_grad()."""
        self.launch_order.finish()

    # --- hooks and launches -------------------------------------------------------------------------
    def _ready_hook(self, index: int):
        def on_gradient_ready(source: torch.Tensor) -> None:
            if self.reduced:
                raise RuntimeError(f"a backward ran after GradientReducer.finish() without zero_grad() "
                                   f"({self.names[index]}); call zero_grad() at the start of every step.")
            if source is not self.holders[index] and source.grad is not None:
                raise RuntimeError(f"{self.names[index]}: the model gradient was not moved into the fp32 master "
                                   "before the reducer saw it; build the GradientReducer after MixedPrecision.")
            bucket = self.layout.bucket_of[index]
            if self.overlap and bucket < self.next_bucket:
                raise RuntimeError(f"{self.names[index]}: a second backward reached a bucket whose reduction was "
                                   "already launched; run the non-final micro-batches of a step inside no_sync().")
            self._attach(index)
            if self.overlap and (self.sync or index in self.synced_params):
                self.ready[bucket].add(index)
                self.launch_order.launch_ready()
        return on_gradient_ready

    def bucket_ready(self, bucket_index: int) -> bool:
        return len(self.ready[bucket_index]) == len(self.layout.buckets[bucket_index].params)

    def attach_all(self) -> None:
        for index in range(len(self.holders)):
            self._attach(index)

    def _attach(self, index: int) -> None:
        """Make the holder's gradient its bucket view again, keeping the values, if something
        (``zero_grad(set_to_none=True)``, a hand-written grad) replaced it."""
        holder, view = self.holders[index], self.grad_views[index]
        grad = holder.grad
        if grad is None:
            holder.grad = view
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            holder.grad = view

    def launch(self, bucket_index: int) -> None:
        """Start bucket ``bucket_index``'s reduction (only ``LaunchOrder`` calls this, in its order)."""
        if bucket_index != self.next_bucket:
            raise RuntimeError(f"bucket {bucket_index} launched before bucket {self.next_bucket}; buckets launch "
                               "in index order")
        self.next_bucket = bucket_index + 1
        if self.dp_size == 1:
            return
        bucket = self.layout.buckets[bucket_index]
        data = self.buffer[bucket.start:bucket.end]
        if self.shard:
            start, end = bucket.shard(self.dp_rank, self.dp_size)
            work = reduce_scatter_into_(self.buffer[start:end], data, self.group, async_op=True)
        else:
            work = all_reduce_(data, self.group, async_op=True)
        self.pending.append(work)
        self.launches.append((bucket_index, time.perf_counter()))

    def wait(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []

    # --- what the optimizer and the clipping read -------------------------------------------------------
    def segment_grad(self, segment) -> torch.Tensor:
        """Sharded mode: the reduced gradient of one owned segment (``distributed_optimizer.Segment``)."""
        return self.buffer[segment.start:segment.end]

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """(name, full gradient view) pairs; after ``finish()`` in unsharded mode, the DP sum."""
        return list(zip(self.names, self.grad_views))

    def remove_hooks(self) -> None:
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []


__all__ = ["Bucket", "BufferLayout", "GradientReducer", "LaunchOrder", "bucket_elements_for", "plan_buckets",
           "trainable_pairs"]
