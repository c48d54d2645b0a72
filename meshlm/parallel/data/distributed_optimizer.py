"""A distributed optimizer: AdamW whose fp32 master state is sharded over the data-parallel group.

Plain data parallelism keeps a full copy of everything on every DP rank: with AdamW in fp32 that
is 4 bytes of weight, 4 of gradient and 8 of moments (m, v) per parameter, of which only the
weights and gradients are needed by forward and backward. ZeRO stage 1 (Rajbhandari et al. 2020,
"ZeRO: memory optimizations toward training trillion parameter models", section 5.1; Megatron-LM's
distributed optimizer) shards the optimizer's part: rank r owns 1/dp of the elements and keeps
the Adam moments of those only. One step then reads:

    gradients   reduce-scatter (instead of all-reduce): rank r receives the DP sum of its elements
    update      AdamW on rank r's elements only (each rank does 1/dp of the optimizer's work)
    parameters  all-gather: every rank receives everybody's updated elements

A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the step moves the same
bytes as plain data parallelism; it only moves the update between the two halves.

Layout. The shards are cut from the flat buffers of ``GradientReducer`` in sharded mode: the
parameters are laid out in reverse order in buckets, each bucket padded to a multiple of dp, and
rank r owns the r-th contiguous 1/dp of every bucket, so each bucket's reduce-scatter can be
launched during backward as soon as it fills (overlap). A parameter may straddle two ranks; each
rank sees the pieces it owns as *segments* (views into the value, gradient and moment buffers).
The values the optimizer updates depend on the precision:

* fp32: the model's parameters ARE the masters. They become views into one flat fp32 value
  buffer with the gradient buffer's layout; the update writes this rank's segments in place and
  the all-gather fills the rest of the buffer in place.
* bf16/fp16: this rank keeps only ITS 1/dp of the fp32 masters (``values`` holds the owned
  segments, like the moments), copied from ``MixedPrecision``'s masters at construction, which are
  then released: each master stays a Parameter of its full shape -- the gradient holder whose
  ``.grad`` is a bucket view -- but its data is a single element broadcast to that shape (stride
  0), so it costs 4 bytes. The model's low-precision parameters become views into one flat
  buffer of their dtype; after the update each rank casts its fp32 segments into it and the
  all-gather moves low-precision values (half the bytes of fp32). ``MixedPrecision`` forwards its
  ``master_to_model`` (nothing left to do), ``state_dict`` and ``load_state_dict`` of the masters
  here (``full_master_weights`` / ``load_master_weights``, collective over DP).

Overlapping the all-gather with the next forward (``overlap_gather_with_forward``, the trainer's
``parallel.overlap_param_gather``). Nothing needs the updated parameters until the next forward
reaches them, and it reaches them in order: the embedding, block 0, block 1, ... So ``step()``
launches the buckets' all-gathers asynchronously in that order (the buffer holds the parameters
in reverse, so the last bucket first) and returns at once; a forward pre-hook on the embedding
and on each block waits for the buckets holding that module's parameters only, so block k
computes while the buckets of blocks k+1, ... are still on the wire. The final norm's hook waits
for everything left: the head that follows reads weights (the output matrix, a tied embedding)
without calling their modules. Anything else that reads or writes the parameters first calls
``wait_for_parameters()``: the next ``step``, the state dicts here, and the trainer before a
checkpoint is saved or loaded. ``gather_waits`` records when each bucket was waited for.

Checkpoints stay in the single-process format: ``state_dict()`` all-gathers the moments into
exactly the dict a ``torch.optim.AdamW`` from ``build_adamw`` would save, and
``load_state_dict()`` takes such a dict and keeps this rank's segments -- so a checkpoint written
at one DP size (or by a single process) loads at any other.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from meshlm.optim.build import build_optimizer
from meshlm.optim.muon import MOMENTUM_KEY, MUON_GROUP, orthogonalize, update_scale
from meshlm.parallel.data.grad_norm import clip_grads_
from meshlm.parallel.collectives import all_gather_into_
from meshlm.parallel.data.grad_reducer import GradientReducer
from meshlm.parallel.data.sharded_gradients import ShardedGradientReducer

READY = "ready"
"""A stage-3 unit whose all-gather has completed."""


@dataclass(frozen=True)
class Segment:
    """The part of parameter ``param`` that this rank owns."""

    param: int
    """Index of the parameter (in the reducer's order)."""
    start: int
    """[start, end) in the flat value / gradient buffers."""
    end: int
    local: int
    """Where it starts in this rank's moment buffers."""


@dataclass
class GroupViews:
    """One parameter group's segments as parallel lists of views, for the foreach kernels."""

    values: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]


def owned_segments(layout, rank: int, num_shards: int) -> list[Segment]:
    """Every (parameter, owned range) piece of rank's 1/num_shards of each bucket."""
    segments = []
    for bucket in layout.buckets:
        shard_start, shard_end = bucket.shard(rank, num_shards)
        local_start = bucket.start // num_shards  # buckets are contiguous and each divides by num_shards
        for index in bucket.params:
            start = max(layout.offsets[index], shard_start)
            end = min(layout.offsets[index] + layout.shapes[index].numel(), shard_end)
            if start < end:
                segments.append(Segment(index, start, end, local_start + start - shard_start))
    return segments


@torch.no_grad()
def adamw_update(views: GroupViews, group: dict, step: int) -> None:
    """One AdamW step on a group's segments (``torch.optim.AdamW``'s math, foreach form)."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if weight_decay:
        torch._foreach_mul_(views.values, 1 - lr * weight_decay)
    torch._foreach_lerp_(views.exp_avgs, views.grads, 1 - beta1)
    torch._foreach_mul_(views.exp_avg_sqs, beta2)
    torch._foreach_addcmul_(views.exp_avg_sqs, views.grads, views.grads, 1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denominators = torch._foreach_sqrt(views.exp_avg_sqs)
    torch._foreach_div_(denominators, math.sqrt(1 - beta2 ** step))
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(views.values, views.exp_avgs, denominators, -step_size)


class DistributedOptimizer:
    """ZeRO-1 AdamW over (name, fp32 parameter) pairs; a drop-in for ``build_adamw``'s AdamW.

    ``model_parameters``: the model tensors that produce the gradients (bf16/fp16 runs: the
    low-precision model parameters behind MixedPrecision's masters), aligned with the pairs;
    ``model_dtype``: their dtype in training (default: their dtype now; MixedPrecision with
    ``sharded_masters`` leaves them fp32, sharing the masters' storage, for this optimizer to cast).
    The gradient reduction lives in ``self.reducer`` (``no_sync()``, ``finish()``). Build it
    after the model is on its device and after MixedPrecision: the given parameters' ``.data``
    become views into the flat value buffer (``.to()`` afterwards would break the views).

    ``zero_stage``: 1 (the above), 2 (gradients sharded too: ``ShardedGradientReducer``, one
    bucket per unit) or 3 (parameters sharded as well: see ``fully_sharded.py``; the model's
    parameters become views into per-unit buffers that hold values only while gathered). Stages
    2 and 3 need a ``fully_sharded.UnitSchedule`` over the model to launch their collectives.

    ``optim_config.optimizer=muon``: the "muon" group steps by ``muon_update``
    (Distributed Muon), its momentum in ``exp_avg`` (its part of ``exp_avg_sq`` stays unused, so
    the buffers keep AdamW's layout); ``orthogonalize_many`` is how it orthogonalizes TP-cut
    matrices whole (``meshlm.parallel.tensor.orthogonal_updates.sharded_orthogonalizer``).
    """

    def __init__(self, parameters_by_name: list[tuple[str, torch.nn.Parameter]], optim_config, context,
                 bucket_size_mb: float = 25.0, overlap: bool = True,
                 model_parameters: list[torch.Tensor] | None = None, model_dtype: torch.dtype | None = None,
                 zero_stage: int = 1, reduce_grads_in_fp32: bool = True, orthogonalize_many=None):
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage} is not 1, 2 or 3.")
        self.context, self.zero_stage = context, zero_stage
        self.reference = build_optimizer(parameters_by_name, optim_config, orthogonalize_many)
        """The single-process optimizer (AdamW, or Muon with AdamW groups): its groups,
        hyperparameters and state-dict layout. It never steps."""
        self.orthogonalize_many = self.reference.orthogonalize_many if optim_config.optimizer == "muon" else None
        self.param_groups = self.reference.param_groups
        if zero_stage == 1:
            self.reducer = GradientReducer(parameters_by_name, context, bucket_size_mb, overlap, shard=True,
                                           model_parameters=model_parameters)
        else:
            grad_dtype = torch.float32 if reduce_grads_in_fp32 else (model_dtype or parameters_by_name[0][1].dtype)
            self.reducer = ShardedGradientReducer(parameters_by_name, context, model_parameters=model_parameters,
                                                  grad_dtype=grad_dtype)
        layout, holders = self.reducer.layout, self.reducer.holders
        sources = self.reducer.sources
        model_dtype = model_dtype or sources[0].dtype
        self.low_precision = model_dtype != torch.float32 or any(source is not holder
                                                                 for source, holder in zip(sources, holders))
        """bf16/fp16: the fp32 masters are sharded here and the model's parameters are gathered into."""
        self.shard_values = self.low_precision or zero_stage == 3
        """``values`` holds this rank's segments only (else the full fp32 layout, the model's own parameters)."""
        device = self.reducer.buffer.device
        self.segments = owned_segments(layout, context.dp_cp_rank, context.dp_cp_size)
        self.exp_avg = torch.zeros(layout.total // context.dp_cp_size, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.unit_gathers: dict[int, object] = {}
        """Stage 3: bucket -> its all-gather in flight, or ``READY``; absent: not gathered (no storage)."""
        with torch.no_grad():
            if self.shard_values:
                self.values = torch.zeros_like(self.exp_avg)  # this rank's fp32 masters only
                for segment in self.segments:
                    self._owned(self.values, segment).copy_(self._piece(holders[segment.param], segment))
            if zero_stage == 3:
                self._shard_parameters(model_dtype, device)
            elif self.low_precision:
                self.model_values = torch.zeros(layout.total, dtype=model_dtype, device=device)
                for index, (source, holder) in enumerate(zip(sources, holders)):
                    view = layout.view(self.model_values, index)
                    view.copy_(source)
                    source.data = view
                    holder.data = torch.zeros(1, dtype=holder.dtype, device=device).expand(holder.shape)
            else:
                self.values = torch.zeros(layout.total, dtype=torch.float32, device=device)
                for index, holder in enumerate(holders):
                    view = layout.view(self.values, index)
                    view.copy_(holder)
                    holder.data = view
        group_of = {id(param): number for number, group in enumerate(self.param_groups) for param in group["params"]}
        muon_params = {id(param) for group in self.param_groups if group.get("name") == MUON_GROUP
                       for param in group["params"]}
        self.muon_indices = {index for index, holder in enumerate(holders) if id(holder) in muon_params}
        """The reducer's indices of the parameters Muon steps (their momentum lives in ``exp_avg``)."""
        self.muon_segments: dict[int, list[Segment]] = {}
        """Muon parameter index -> this rank's segments of it."""
        for segment in self.segments:
            if segment.param in self.muon_indices:
                self.muon_segments.setdefault(segment.param, []).append(segment)
        self.muon_buckets = [(bucket, sorted(index for index in self.muon_segments
                                             if layout.bucket_of[index] == bucket))
                             for bucket in sorted({layout.bucket_of[index] for index in self.muon_indices})]
        """(bucket index, the Muon parameters in it this rank owns a segment of) for every bucket
        holding a Muon parameter: the same buckets and, for TP peers, the same owned lists."""
        self.group_views = [GroupViews([], [], [], []) for _ in self.param_groups]
        for segment in self.segments:
            views = self.group_views[group_of[id(holders[segment.param])]]
            views.values.append(self._owned(self.values, segment) if self.shard_values
                                else self.values[segment.start:segment.end])
            views.grads.append(self.reducer.segment_grad(segment))
            views.exp_avgs.append(self._owned(self.exp_avg, segment))
            views.exp_avg_sqs.append(self._owned(self.exp_avg_sq, segment))
        self.step_count = 0
        self.defer_gather = False
        """True: ``step()`` leaves the all-gathers running (``overlap_gather_with_forward``)."""
        self.gathers: dict[int, object] = {}
        """Bucket index -> its all-gather still in flight."""
        self.gather_waits: list[tuple[int, float, float]] = []
        """(bucket index, perf_counter when waiting began, when it ended) for the last gathers launched."""

    def _shard_parameters(self, model_dtype: torch.dtype, device: torch.device) -> None:
        """ZeRO-3: keep the model's parameters as this rank's ``model_shard`` (the fp32 ``values``
        themselves in fp32), and make each parameter a view into its unit's ``gathered`` buffer,
        whose storage exists only between ``start_gather`` and ``release`` (freed by resizing
        it to zero bytes, so every view -- and every tensor autograd saved -- follows it)."""
        layout = self.reducer.layout
        self.model_shard = self.values if model_dtype == torch.float32 else self.values.to(model_dtype)
        self.gathered = [torch.empty(bucket.size, dtype=model_dtype, device=device) for bucket in layout.buckets]
        for index, (source, holder) in enumerate(zip(self.reducer.sources, self.reducer.holders)):
            bucket_index = layout.bucket_of[index]
            first = layout.offsets[index] - layout.buckets[bucket_index].start
            view = self.gathered[bucket_index][first:first + layout.shapes[index].numel()].view(layout.shapes[index])
            source.data = view
            if holder is not source:  # bf16/fp16 master: a 4-byte stand-in keeps the gradient holder's shape
                holder.data = torch.zeros(1, dtype=holder.dtype, device=device).expand(holder.shape)
        for full in self.gathered:
            full.untyped_storage().resize_(0)

    # --- ZeRO-3: a unit's parameters, gathered and released (``fully_sharded.UnitSchedule`` calls) ----
    def start_gather(self, unit: str) -> None:
        """Launch the all-gather of ``unit``'s parameters from every rank's shard (if not gathered
        or on the way already)."""
        bucket_index = self.reducer.bucket_of_unit.get(unit)
        if bucket_index is None or bucket_index in self.unit_gathers:
            return
        full, bucket = self.gathered[bucket_index], self.reducer.layout.buckets[bucket_index]
        storage = full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(full.numel() * full.element_size())
        own = self.model_shard[bucket.local_slice(self.context.dp_cp_size)]
        self.unit_gathers[bucket_index] = all_gather_into_(full, own, self.context.dp_cp_group, async_op=True)

    def finish_gather(self, unit: str) -> None:
        """``unit``'s parameters hold their values when this returns."""
        bucket_index = self.reducer.bucket_of_unit.get(unit)
        if bucket_index is None:
            return
        if bucket_index not in self.unit_gathers:
            self.start_gather(unit)
        self._settle(bucket_index)

    def _settle(self, bucket_index: int) -> None:
        """Wait for a stage-3 unit's all-gather, if it is still running."""
        work = self.unit_gathers[bucket_index]
        if work is not READY:
            if work is not None:
                work.wait()
            self.unit_gathers[bucket_index] = READY

    def release(self, unit: str) -> None:
        """Free ``unit``'s gathered parameters (their storage shrinks to zero bytes)."""
        bucket_index = self.reducer.bucket_of_unit.get(unit)
        if bucket_index is None or bucket_index not in self.unit_gathers:
            return
        self.finish_gather(unit)
        del self.unit_gathers[bucket_index]
        self.gathered[bucket_index].untyped_storage().resize_(0)

    def release_all(self) -> None:
        for unit in list(self.reducer.bucket_of_unit):
            self.release(unit)

    def gather_all(self) -> None:
        """Gather every unit and keep it (after training: the model then holds all its values;
        the next step releases them again)."""
        for unit in self.reducer.bucket_of_unit:
            self.start_gather(unit)
        for unit in self.reducer.bucket_of_unit:
            self.finish_gather(unit)

    @staticmethod
    def _owned(local_buffer: torch.Tensor, segment: Segment) -> torch.Tensor:
        """The segment's view into a buffer that holds only this rank's shard (moments, bf16 masters)."""
        return local_buffer[segment.local:segment.local + segment.end - segment.start]

    def _piece(self, tensor: torch.Tensor, segment: Segment) -> torch.Tensor:
        """The segment's elements of a parameter-shaped tensor, flattened."""
        first = segment.start - self.reducer.layout.offsets[segment.param]
        return tensor.reshape(-1)[first:first + segment.end - segment.start]

    # --- the optimizer interface the trainer uses ----------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Finish the gradient reduction (if the caller has not), update this rank's shard, all-gather
        (left running when ``defer_gather``: the next forward waits for each bucket as it needs it)."""
        self.reducer.finish()
        self.wait_for_parameters()
        self.step_count += 1
        for group, views in zip(self.param_groups, self.group_views):
            if views.values and group.get("name") != MUON_GROUP:
                if views.grads[0].dtype != torch.float32:  # gradients reduced in bf16/fp16: the update is fp32
                    views = GroupViews(views.values, [grad.float() for grad in views.grads], views.exp_avgs,
                                       views.exp_avg_sqs)
                adamw_update(views, group, self.step_count)
        for group in self.param_groups:  # Muon's matrices: gathered bucket by bucket over DP
            if group.get("name") == MUON_GROUP:
                self.muon_update(group)
        self.gather_parameters(wait=not self.defer_gather)

    def state_buffers(self, index: int) -> dict[str, torch.Tensor]:
        """The flat per-rank buffers holding parameter ``index``'s state, by the single-process
        optimizer's state key: Muon's momentum, or AdamW's two moments."""
        if self.is_muon(index):
            return {MOMENTUM_KEY: self.exp_avg}
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def is_muon(self, index: int) -> bool:
        """Whether Muon steps the reducer's parameter ``index``."""
        return index in self.muon_indices

    @torch.no_grad()
    def muon_update(self, group: dict) -> None:
        """Distributed Muon (Liu et al. 2025, section 2.3 and Algorithm 3) on this rank's segments.

        The momentum is elementwise, so it lives sharded like Adam's first moment (in ``exp_avg``)
        and steps on the owned segments. Newton-Schulz needs each matrix whole, so bucket by
        bucket (a parameter never straddles two) this rank's momentum-updated directions are laid
        into its 1/dp piece of the bucket (zeros where AdamW's parameters sit) and all-gathered
        over DP into a temporary fp32 copy of the whole bucket -- the parameters' all-gather,
        once more, in fp32, one bucket's memory at a time; it needs no full gradient buffer, so
        every ZeRO stage runs it. Each rank then orthogonalizes only the matrices it owns a
        segment of -- about 1/dp of them; where TP cuts them, dealt over the TP ranks and each
        orthogonalized whole on one (``orthogonalize_many``), which within a bucket shares the
        work over TP too -- and applies its segments of the update. The elementwise steps are
        the single-process optimizer's operations on the same elements, so the result is the
        single process's."""
        mu, layout = group["momentum"], self.reducer.layout
        lr, decay = group["lr"], group["weight_decay"]
        rank, size = self.context.dp_cp_rank, self.context.dp_cp_size
        for bucket_index, mine in self.muon_buckets:
            bucket = layout.buckets[bucket_index]
            first, last = bucket.shard(rank, size)
            piece = torch.zeros(last - first, dtype=torch.float32, device=self.exp_avg.device)
            for index in mine:
                for segment in self.muon_segments[index]:
                    grad = self.reducer.segment_grad(segment).float()
                    momentum = self._owned(self.exp_avg, segment)
                    momentum.mul_(mu).add_(grad)
                    direction = piece[segment.start - first:segment.end - first]
                    if group["nesterov"]:
                        torch.add(grad, momentum, alpha=mu, out=direction)
                    else:
                        direction.copy_(momentum)
            whole = piece
            if size > 1:
                whole = torch.empty(bucket.size, dtype=torch.float32, device=piece.device)
                all_gather_into_(whole, piece, self.context.dp_cp_group)
            named = []
            for index in mine:
                offset = layout.offsets[index] - bucket.start
                named.append((self.reducer.names[index],
                              whole[offset:offset + layout.shapes[index].numel()].view(layout.shapes[index])))
            updates = self.orthogonalize_many(named, lambda matrix: orthogonalize(matrix, group["ns_steps"]))
            for index, (update, whole_shape) in zip(mine, updates):
                scale = update_scale(whole_shape, group["update_rms"])
                for segment in self.muon_segments[index]:
                    value = (self._owned(self.values, segment) if self.shard_values
                             else self.values[segment.start:segment.end])
                    value.mul_(1 - lr * decay)
                    value.add_(self._piece(update, segment), alpha=-lr * scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffer (never set to None: the gradients are views into it)."""
        self.reducer.zero_grad()

    @torch.no_grad()
    def gather_parameters(self, wait: bool = True) -> None:
        """All-gather every rank's updated shard, bucket by bucket in forward order (the last
        bucket first): in fp32 into the full value buffer (the model's parameters); in bf16/fp16
        cast first and gathered into the model's low-precision buffer. ``wait=False`` leaves the
        gathers running (``wait_for_parameters``)."""
        self.wait_for_parameters()
        if self.zero_stage == 3:  # nothing is gathered ahead: the next forward gathers unit by unit
            if self.low_precision:
                self.model_shard.copy_(self.values)
            self.release_all()
            return
        layout, rank, size = self.reducer.layout, self.context.dp_cp_rank, self.context.dp_cp_size
        target = self.model_values if self.low_precision else self.values
        if self.low_precision:
            for bucket in layout.buckets:
                start, end = bucket.shard(rank, size)
                local = bucket.start // size
                target[start:end].copy_(self.values[local:local + end - start])
        if size == 1:
            return
        self.gather_waits = []
        for index in reversed(range(len(layout.buckets))):
            bucket = layout.buckets[index]
            start, end = bucket.shard(rank, size)
            self.gathers[index] = all_gather_into_(target[bucket.start:bucket.end], target[start:end],
                                                   self.context.dp_cp_group, async_op=True)
        if wait:
            self.wait_for_parameters()

    def wait_for_parameters(self, names=None) -> None:
        """Wait for the all-gathers of the buckets holding the parameters ``names`` (all: None)."""
        if names is None:  # stage 3: no unit's gather may still be running either
            for bucket_index in list(self.unit_gathers):
                self._settle(bucket_index)
        if not self.gathers:
            return
        if names is None:
            buckets = sorted(self.gathers, reverse=True)  # in launch order
        else:
            index_of, bucket_of = self.reducer.index_of, self.reducer.layout.bucket_of
            buckets = sorted({bucket_of[index_of[name]] for name in names if name in index_of}, reverse=True)
        for bucket in buckets:
            work = self.gathers.pop(bucket, None)
            if work is not None:
                started = time.perf_counter()
                work.wait()
                self.gather_waits.append((bucket, started, time.perf_counter()))

    def named_grad_shards(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, this rank's reduced gradient piece) for every owned segment."""
        return [(self.reducer.names[segment.param], self.reducer.segment_grad(segment)) for segment in self.segments]

    def clip_grad_norm_(self, max_norm: float, tensor_parallel_names: set[str] | None = None) -> torch.Tensor:
        """Global-norm clipping of the sharded gradient (squares summed over DP and TP shards)."""
        return clip_grads_(self.named_grad_shards(), max_norm, self.context, sharded_by_dp=True,
                           tensor_parallel_names=tensor_parallel_names, device=self.values.device)

    # --- checkpoints in the single-process format ---------------------------------------------------
    def _gathered(self, local: torch.Tensor) -> torch.Tensor:
        """A buffer holding this rank's shard of every bucket, all-gathered into the full layout."""
        self.wait_for_parameters()  # one collective at a time on the group, in the same order on every rank
        size, layout = self.context.dp_cp_size, self.reducer.layout
        if size == 1:
            return local
        full = torch.zeros(layout.total, dtype=local.dtype, device=local.device)
        pending = [all_gather_into_(full[bucket.start:bucket.end], local[bucket.local_slice(size)],
                                   self.context.dp_cp_group, async_op=True) for bucket in layout.buckets]
        for work in pending:
            work.wait()
        return full

    def gathered_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, v) for every parameter, in the full buffer layout. Collective over the DP group."""
        return self._gathered(self.exp_avg), self._gathered(self.exp_avg_sq)

    # --- the fp32 masters of bf16/fp16 runs (MixedPrecision forwards here) -------------------------
    def full_master_weights(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 master} of every parameter this optimizer holds. Collective over DP."""
        full, layout = self._gathered(self.values), self.reducer.layout
        return {name: layout.view(full, index).clone() for index, name in enumerate(self.reducer.names)}

    @torch.no_grad()
    def load_master_weights(self, masters: dict[str, torch.Tensor]) -> None:
        """Keep this rank's segments of full fp32 masters (any DP size saved them) and refresh the
        model's low-precision parameters from them (an all-gather over DP)."""
        missing = [name for name in self.reducer.names if name not in masters]
        if missing:
            raise ValueError(f"no master weight for {missing[0]} ({len(missing)} missing); saved for another model")
        self.wait_for_parameters()
        for segment in self.segments:
            self._owned(self.values, segment).copy_(self._piece(masters[self.reducer.names[segment.param]], segment))
        self.gather_parameters()

    def state_dict(self) -> dict:
        """Exactly the state dict of the single-process optimizer (``self.reference``: torch's AdamW,
        or Muon). Collective: every DP rank must call it (every rank gets the whole dict)."""
        exp_avg, exp_avg_sq = self.gathered_moments()
        packed = self.reference.state_dict()  # groups with hyperparameters, names and packed indices
        if self.step_count == 0:
            return packed
        layout = self.reducer.layout
        position = {id(holder): index for index, holder in enumerate(self.reducer.holders)}
        gathered = {id(self.exp_avg): exp_avg, id(self.exp_avg_sq): exp_avg_sq}  # this rank's buffer -> whole
        for group, packed_group in zip(self.param_groups, packed["param_groups"]):
            for param, packed_index in zip(group["params"], packed_group["params"]):
                index = position[id(param)]
                entry = {} if self.is_muon(index) else {"step": torch.tensor(float(self.step_count),
                                                                             dtype=torch.float32)}
                entry.update({key: layout.view(gathered[id(buffer)], index).clone()
                              for key, buffer in self.state_buffers(index).items()})
                packed["state"][packed_index] = entry
        return packed

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a single-process AdamW state dict (saved at any DP size), keeping this rank's segments."""
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the optimizer state has {len(saved_groups)} parameter groups, this run "
                             f"{len(self.param_groups)}; it was saved with different optim settings.")
        entries = {}
        for group, saved in zip(self.param_groups, saved_groups):
            names = saved.get("param_names")
            if names is None or list(names) != list(group["param_names"]):
                raise ValueError(f"optimizer group {group.get('name')!r} holds different parameters in the saved "
                                 "state (compared by name); it was saved for a different model.")
            entries.update({name: saved_state.get(packed) for name, packed in zip(names, saved["params"])})
            group.update({key: value for key, value in saved.items() if key not in ("params", "param_names")})
        steps = {int(entry["step"]) for entry in entries.values() if entry and "step" in entry}
        if len(steps) > 1:
            raise ValueError(f"the saved parameters have different step counts {sorted(steps)}; this optimizer "
                             "keeps one count for all of them.")
        self.step_count = steps.pop() if steps else 0
        self.wait_for_parameters()
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        for segment in self.segments:
            entry = entries[self.reducer.names[segment.param]]
            if entry:
                for key, buffer in self.state_buffers(segment.param).items():
                    self._owned(buffer, segment).copy_(self._piece(entry[key], segment))


def overlap_gather_with_forward(model, optimizer) -> list:
    """Let ``optimizer.step()`` (a ``DistributedOptimizer`` or an ``OptimizerGroup`` of them) leave
    its parameter all-gathers running, and make the forward of ``model`` (a language model, whole
    or a pipeline stage) wait for each bucket just before it needs it: the embedding and each
    block for their own parameters, the final norm for all the rest (see the module docstring).
    Returns the hook handles."""
    parts = getattr(optimizer, "optimizers", [optimizer])
    for part in parts:
        part.defer_gather = True
    handles = []
    units = [("embedding", getattr(model, "embedding", None)),
             ("position_embedding", getattr(model, "position_embedding", None))]  # learned positions, if any
    units += [(name, module) for name, module in model.named_modules() if name.count(".") == 1
              and name.startswith("blocks.")]
    for prefix, module in units:
        if module is not None:
            names = [f"{prefix}.{name}" for name, _ in module.named_parameters()]
            handles.append(module.register_forward_pre_hook(_waiter(parts, names)))
    if getattr(model, "final_norm", None) is not None:
        handles.append(model.final_norm.register_forward_pre_hook(_waiter(parts, None)))
    return handles


def _waiter(parts, names):
    def wait_before_forward(module, args) -> None:
        for part in parts:
            part.wait_for_parameters(names)
    return wait_before_forward


__all__ = ["DistributedOptimizer", "GroupViews", "Segment", "adamw_update", "overlap_gather_with_forward",
           "owned_segments"]
