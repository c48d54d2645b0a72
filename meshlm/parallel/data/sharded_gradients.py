"""ZeRO-2/3 gradients: reduce-scattered unit by unit during every backward, only this rank's shard kept.

ZeRO-1 (``grad_reducer.GradientReducer`` in sharded mode) still gives every rank a full fp32
gradient buffer -- 4 bytes per parameter -- and reduce-scatters it once per step. ZeRO stage 2
(Rajbhandari et al. 2020, section 5.2) keeps only the rank's 1/dp of the reduced gradient: each
unit's gradients (``units.py``: a block, the embedding, the tail) are copied into a *staging*
bucket as autograd produces them, the bucket is reduce-scattered as soon as the backward has
left the unit, this rank's slice is added into its persistent fp32 gradient shard, and the
staging bucket is freed. Gradient memory is then 4/dp bytes per parameter plus a few units in
flight, at the price of one reduce-scatter per unit per *micro-batch* (DeepSpeed's ZeRO-2 pays
the same; ZeRO-1 reduces once per step): the accumulation over micro-batches happens after the
reduction, in the shard.

**When a unit is reduced.** The moment is never "when its gradients are complete" as seen by
this rank -- under MoE routing one rank may get an expert's gradient later than another, and
ranks that launch collectives in different orders hang NCCL. ``fully_sharded.UnitSchedule``
launches a unit's reduction at fixed points of every backward instead: when the backward
reaches the unit before it (its pre-backward hook), and at the end of the backward for what is
left, in a fixed order. By then autograd has finished the unit (a block's input gradient needs
all of the block's backward first); a parameter that took no part in this backward (an expert
that received no tokens) contributes zeros, which is its gradient. A gradient arriving after
its unit was launched would be lost, so it is an error, never silently dropped.

The reduced sum over DP is the single-process gradient up to fp32 summation order, as in ZeRO-1.
What the optimizer reads: ``segment_grad(segment)``, a view of the shard for each owned segment
(``distributed_optimizer.owned_segments``, the ZeRO-1 segments of this layout).

Precision. The hooks go on the model's parameters and read their gradient in the model's dtype,
adding it into the fp32 staging bucket; ``MixedPrecision``'s own gradient mover is removed
(``MixedPrecision.hand_masters_to``), so no full fp32 master gradient ever exists. With
``parallel.reduce_grads_in_fp32=false`` staging, reduction and shard are in the model's dtype
instead (2 bytes per parameter / dp, the ZeRO paper's count), and the optimizer casts each
segment to fp32 for its update.
"""

from __future__ import annotations

import contextlib
import time

import torch

from meshlm.parallel.collectives import reduce_scatter_into_
from meshlm.parallel.data.grad_reducer import trainable_pairs
from meshlm.parallel.data.units import plan_unit_buckets, unit_of


class ShardedGradientReducer:
    """Reduce-scatters the gradients of ``parameters`` over the dp_cp group of ``context``, one
    unit (bucket) at a time, into this rank's fp32 gradient shard; see the module docstring.

    ``parameters``: (name, tensor) pairs the optimizer updates; ``model_parameters``: the model
    tensors whose backward produces the gradients (default: the same), where the hooks go.
    ``max_in_flight``: reductions left running before the oldest is waited for (bounds the
    staging memory to about that many units). ``grad_dtype``: of the staging buckets, the
    reduction and the shard (fp32, or the model's bf16/fp16: ``parallel.reduce_grads_in_fp32``).
    The launches come from ``UnitSchedule``.
    """

    shards_gradients = True
    """What ``fully_sharded`` and the pipeline ask to tell this reducer from ``GradientReducer``."""

    def __init__(self, parameters: list[tuple[str, torch.Tensor]], context,
                 model_parameters: list[torch.Tensor] | None = None, max_in_flight: int = 2,
                 grad_dtype: torch.dtype = torch.float32):
        self.names, self.holders, self.sources = trainable_pairs(parameters, model_parameters)
        self.group, self.dp_size, self.dp_rank = context.dp_cp_group, context.dp_cp_size, context.dp_cp_rank
        self.units = [unit_of(name) for name in self.names]
        self.layout, self.bucket_of_unit = plan_unit_buckets([holder.shape for holder in self.holders], self.units,
                                                             self.dp_size)
        self.index_of = {name: index for index, name in enumerate(self.names)}
        self.device = self.holders[0].device if self.holders else context.device
        self.grad_dtype = grad_dtype
        self.shard = torch.zeros(self.layout.total // self.dp_size, dtype=grad_dtype, device=self.device)
        """This rank's 1/dp of every bucket: the reduced gradient, accumulated over the step."""
        self.max_in_flight = max_in_flight
        self.staging: dict[int, torch.Tensor] = {}
        """Bucket -> its full fp32 gradient of the running backward (until launched)."""
        self.launched: set[int] = set()
        """Buckets reduced in the running backward (a gradient for them now would be lost)."""
        self.reduced_this_step: set[int] = set()
        self.pending: list[tuple[object, torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.launches: list[tuple[int, float]] = []
        """This step's reductions: (bucket index, ``time.perf_counter()`` at launch), in order."""
        self.on_gradient = None
        """Called (no arguments) whenever a gradient arrives: the schedule notes the running backward."""
        self.hook_handles = [source.register_post_accumulate_grad_hook(self._gradient_hook(index))
                             for index, source in enumerate(self.sources)]
        self.zero_grad()

    # --- the step cycle (the trainer's and the schedule's calls) -------------------------------------
    def zero_grad(self) -> None:
        """Finish what is in flight and zero the shard; call before a step's first backward."""
        self.wait()
        self.shard.zero_()
        self.staging.clear()
        self.launched.clear()
        self.reduced_this_step.clear()
        self.launches = []

    @contextlib.contextmanager
    def no_sync(self):
        """Accepted for the trainer's loop; ZeRO-2/3 reduces every backward anyway (the full gradient is never kept)."""
        yield

    @contextlib.contextmanager
    def sync_parameters(self, names):
        yield

    def launch_unit(self, unit: str) -> None:
        """Reduce-scatter ``unit``'s staging bucket (zeros if no gradient came), unless this
        backward already did; the oldest reductions are waited for beyond ``max_in_flight``."""
        bucket_index = self.bucket_of_unit.get(unit)
        if bucket_index is not None and bucket_index not in self.launched:
            self._launch(bucket_index)

    def _launch(self, bucket_index: int) -> None:
        self.launched.add(bucket_index)
        bucket = self.layout.buckets[bucket_index]
        staging = self.staging.pop(bucket_index, None)
        if staging is None:
            staging = torch.zeros(bucket.size, dtype=self.grad_dtype, device=self.device)
        output = self.shard[bucket.local_slice(self.dp_size)]
        first = bucket_index not in self.reduced_this_step
        self.reduced_this_step.add(bucket_index)
        received = output if first else torch.empty_like(output)
        work = reduce_scatter_into_(received, staging, self.group, async_op=True)
        self.pending.append((work, output, None if first else received, staging))
        self.launches.append((bucket_index, time.perf_counter()))
        while len(self.pending) > self.max_in_flight:
            self._complete(self.pending.pop(0))

    def end_backward(self) -> None:
        """The running backward is over: its buckets may receive gradients again in the next one."""
        self.launched.clear()

    def finish(self) -> None:
        """Reduce what was left unlaunched (gradients written by hand), in bucket order, and wait for all."""
        for bucket_index in sorted(self.staging):
            self._launch(bucket_index)
        self.end_backward()
        self.wait()

    def wait(self) -> None:
        for entry in self.pending:
            self._complete(entry)
        self.pending = []

    @staticmethod
    def _complete(entry) -> None:
        work, output, received, _staging = entry
        if work is not None:
            work.wait()
        if received is not None:
            output.add_(received)

    # --- the hooks -------------------------------------------------------------------------------------
    def _gradient_hook(self, index: int):
        def add_to_staging(source: torch.Tensor) -> None:
            bucket_index = self.layout.bucket_of[index]
            if bucket_index in self.launched:
                raise RuntimeError(f"{self.names[index]}: its gradient arrived after the reduce-scatter of its unit "
                                   f"({self.units[index]}) was launched in this backward; a parameter used outside "
                                   "its own block cannot be sharded with parallel.zero_stage 2 or 3.")
            if self.on_gradient is not None:
                self.on_gradient()
            bucket = self.layout.buckets[bucket_index]
            staging = self.staging.get(bucket_index)
            if staging is None:
                staging = self.staging[bucket_index] = torch.zeros(bucket.size, dtype=self.grad_dtype,
                                                                   device=self.device)
            offset, numel = self.layout.offsets[index] - bucket.start, self.layout.shapes[index].numel()
            with torch.no_grad():
                staging[offset:offset + numel].view(self.layout.shapes[index]).add_(source.grad)
            source.grad = None
            if self.holders[index] is not source:
                self.holders[index].grad = None
        return add_to_staging

    # --- what the optimizer and the clipping read ------------------------------------------------------
    def segment_grad(self, segment) -> torch.Tensor:
        """The reduced gradient of an owned segment: a view of the shard."""
        return self.shard[segment.local:segment.local + segment.end - segment.start]

    def unit_shard(self, unit: str) -> torch.Tensor | None:
        """This rank's slice of ``unit``'s reduced gradient (its bucket's shard, padding included)."""
        bucket_index = self.bucket_of_unit.get(unit)
        if bucket_index is None:
            return None
        return self.shard[self.layout.buckets[bucket_index].local_slice(self.dp_size)]

    @property
    def buffer(self) -> torch.Tensor:
        """The shard (callers read its device)."""
        return self.shard

    def remove_hooks(self) -> None:
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []


__all__ = ["ShardedGradientReducer"]
