"""Fully sharded data parallelism (ZeRO stages 2 and 3): when each unit is gathered, reduced and freed.

``parallel.zero_stage`` picks how much of the training state each of the dp ranks keeps
(Rajbhandari et al. 2020, "ZeRO: memory optimizations toward training trillion parameter
models", sections 5.1-5.3; PyTorch FSDP, Zhao et al. 2023), bytes per parameter in bf16 with
fp32 masters, Adam moments and fp32 gradient accumulation:

    stage 1   2 (bf16 weights) + 4 (fp32 gradient buffer) + 12/dp (masters, m, v)
    stage 2   2 + (4 + 12)/dp          gradients reduce-scattered unit by unit, only a shard kept
    stage 3   (2 + 4 + 12)/dp          the weights too: a unit is all-gathered when it runs

(the ZeRO paper's (2 + 2 + 12)/dp for stage 3 counts bf16 gradients; meshlm reduces and
accumulates gradients in fp32, as Megatron-LM does by default, hence 4). Each rank owns the r-th
contiguous 1/dp of every unit's flat bucket (``units.py``), the segments the ZeRO-1 optimizer
already updates: ``DistributedOptimizer(zero_stage=...)`` keeps the masters and moments of those,
``ShardedGradientReducer`` (``sharded_gradients.py``) their reduced gradient, and at stage 3 the
optimizer also keeps the model-dtype values of those segments (``model_shard``) and gathers a
unit into a buffer whose storage exists only while needed.

**The schedule** (``UnitSchedule``: hooks on the model's modules). Every collective of stages 2
and 3 is issued at one of these points, in the same order on every rank whatever the routing,
so NCCL never sees two ranks disagree (``parallel.check_collectives`` verifies it):

    forward, block i      gather block i (stage 3; waits for the prefetch), start gathering
                          block i+1, run, free block i (its backward gathers it again)
    backward reaches i    (a hook on block i's output gradient) reduce-scatter the gradients of
                          the blocks whose backward has ended and free them (stage 3); gather
                          block i, start gathering block i-1
    end of the backward   reduce-scatter what is left: the remaining block, the tail, the
                          embedding (a callback queued on the autograd engine)
    optimizer step        update the owned segments; stage 3 drops every gathered unit (stale),
                          stage 2 all-gathers the updated parameters as ZeRO-1 does

The embedding and the tail (final norm, output projection, MTP) are gathered together by the
first of their modules that runs and stay gathered until the optimizer step: the output
projection and MTP read the (tied) embedding and the final norm without calling their modules in
order, and they are small beside the blocks -- PyTorch FSDP keeps its root unit the same way.
Activation recomputation reruns a block's forward inside its backward, with the block gathered.

Under pipeline parallelism every (chunk, micro-batch) backward is a backward here: its blocks
are reduced as above; the embedding goes with the backward that covers the rank's first block
(or, for a later stage's copy of a tied embedding, its last), the tail with the last block. The
tied copies are then summed over the embedding group on their reduced shards, cut alike on both
stages (``PipelinedModel.sum_embedding_grads``). Under expert parallelism the dense and expert
parts of a block are two buckets in two optimizers (dp_cp and edp groups), driven by one schedule
in a fixed order (dense first).
"""

from __future__ import annotations

import torch

from meshlm.parallel.data.units import EMBEDDING, TAIL, block_index, forward_order

STEP_UNIT_MODULES = ("embedding", "final_norm", "output", "mtp")
"""The language model's modules whose first call gathers the embedding and the tail (stage 3)."""


class UnitSchedule:
    """Drives the ZeRO-2/3 collectives of ``parts`` (``DistributedOptimizer``s of stage 2 or 3:
    one, or dense + experts) over ``model`` (a ``LanguageModel`` or this rank's pipeline stages)."""

    def __init__(self, model: torch.nn.Module, parts: list):
        self.parts = parts
        self.gathers = any(part.zero_stage == 3 for part in parts)
        units = forward_order(unit for part in parts for unit in part.reducer.bucket_of_unit)
        self.blocks = [unit for unit in units if block_index(unit) is not None]
        """This rank's block units, in forward order."""
        self.step_units = [unit for unit in (EMBEDDING, TAIL) if unit in units]
        first_block, last_block = (self.blocks[0], self.blocks[-1]) if self.blocks else (None, None)
        holds_block_zero = first_block is not None and block_index(first_block) == 0
        self.anchors = {EMBEDDING: first_block if holds_block_zero else last_block, TAIL: last_block}
        """The block whose backward also reduces the embedding / the tail (None: every backward)."""
        self.active: list[str] = []
        """Blocks whose backward began in the running backward and whose gradients are not reduced yet."""
        self.seen: set[str] = set()
        self.callback_queued = False
        self.events: list[tuple[str, str]] | None = None
        """Set to a list to record every (operation, unit) in order (the tests read it)."""
        self.handles = []
        for part in parts:
            part.reducer.on_gradient = self.note_backward
        for unit in self.blocks:
            module = model.get_submodule(unit)
            self.handles.append(module.register_forward_pre_hook(self._before_forward(unit)))
            self.handles.append(module.register_forward_hook(self._after_forward(unit)))
        if self.gathers:
            for name in STEP_UNIT_MODULES:
                module = getattr(model, name, None)
                if isinstance(module, torch.nn.Module):
                    self.handles.append(module.register_forward_pre_hook(self._gather_step_units))

    # --- gathers (stage 3) ---------------------------------------------------------------------------
    def _each(self, method: str, unit: str) -> None:
        """Every part's ``method`` for ``unit`` in part order: 'launch' (the gradients' reduce-scatter)
        or, at stage 3, 'start_gather', 'finish_gather', 'release'."""
        if self.events is not None:
            self.events.append((method, unit))
        for part in self.parts:
            if method == "launch":
                part.reducer.launch_unit(unit)
            elif part.zero_stage == 3:
                getattr(part, method)(unit)

    def _gather_step_units(self, module, args) -> None:
        for unit in self.step_units:
            self._each("start_gather", unit)
        for unit in self.step_units:
            self._each("finish_gather", unit)

    def _neighbour(self, unit: str, step: int) -> str | None:
        position = self.blocks.index(unit) + step
        return self.blocks[position] if 0 <= position < len(self.blocks) else None

    def _gather_with_prefetch(self, unit: str, step: int) -> None:
        self._each("start_gather", unit)
        neighbour = self._neighbour(unit, step)
        if neighbour is not None:
            self._each("start_gather", neighbour)
        self._each("finish_gather", unit)

    # --- hooks ---------------------------------------------------------------------------------------------
    def _before_forward(self, unit: str):
        def gather_block(module, args) -> None:
            if self.gathers:
                self._gather_with_prefetch(unit, +1)
        return gather_block

    def _after_forward(self, unit: str):
        def release_block(module, args, output) -> None:
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self._before_backward(unit))
            if self.gathers and unit not in self.active:  # (not while a recomputation runs in its backward)
                self._each("release", unit)
        return release_block

    def _before_backward(self, unit: str) -> None:
        self.note_backward()
        self._reduce_finished_blocks()
        self.active.append(unit)
        self.seen.add(unit)
        if self.gathers:
            self._gather_with_prefetch(unit, -1)

    def _reduce_finished_blocks(self) -> None:
        for done in self.active:
            self._each("launch", done)
            if self.gathers:
                self._each("release", done)
        self.active = []

    def note_backward(self) -> None:
        """A backward is running: have the autograd engine call ``end_of_backward`` when it ends."""
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            self.callback_queued = True

    def end_of_backward(self) -> None:
        self._reduce_finished_blocks()
        for unit in (TAIL, EMBEDDING):
            if unit in self.step_units and (self.anchors[unit] is None or self.anchors[unit] in self.seen):
                self._each("launch", unit)
        for part in self.parts:
            part.reducer.end_backward()
        self.seen = set()
        self.callback_queued = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for part in self.parts:
            part.reducer.on_gradient = None


__all__ = ["UnitSchedule"]
