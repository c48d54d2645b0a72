"""A language model cut into pipeline stages, as the trainer drives it: one step, one evaluation.

``PipelinedModel.build`` cuts this rank's share out of the full (tensor-parallelized) model
(``stages.py``) and prepares the schedules; each training step then runs

    schedule (1F1B / interleaved)   every micro-batch's forward and backward through this rank's
                                    chunks, activations and gradients exchanged with neighbours;
                                    gradients accumulate (the DP reducer is in no_sync), except
                                    in each chunk's LAST backward, which is final for that
                                    chunk's parameters: their DP buckets launch as they fill
    tied embedding                  the first and last stages' embedding gradients are summed
    loss sums                       the step's loss terms, summed over the pipeline (one
                                    all-reduce), so every rank -- global rank 0 included, which
                                    is a first stage -- logs the single-process numbers

after which the trainer's ``finish_gradients`` launches the buckets left, waits for the DP
reduction and clips by the global norm, whose all-reduce spans every stage.

**DP reduction during the schedule.** Without pipelining, the last micro-batch's backward
launches the DP reduction of each gradient bucket as soon as it fills (``grad_reducer.py``).
A pipeline rank has one last backward per model chunk, and with interleaving (vp > 1) they come
at different times: chunk v - 1 finishes its micro-batches first. So the reducer stays in
``no_sync()`` for the schedule, and each chunk's last backward runs inside
``reducer.sync_parameters(that chunk's parameters)``; the buffer holds the later blocks first and
buckets launch in order, so the buckets of later chunks go out while earlier chunks still
compute. One exception: the tied embedding's gradients (first stage, and the last stage's copy)
must be summed over the two stages *before* the DP reduction. Sums commute, so for an all-reduce
the order would not matter; but with the distributed optimizer the DP reduction is a
reduce-scatter, and the two stages' buffers cut the embedding into different shards, so after it
neither holds the values the other adds. Those parameters are therefore never made final during
the schedule: their bucket (the last: the embedding is the model's first parameter) launches in
``finish`` after ``sum_embedding_grads`` -- at the end of the first stage's last backward anyway.

**Losses on every stage.** The last virtual stage computes the LM loss (and MTP), divided by the
step's micro-batch count like the trainer's. A stage with MoE blocks also owns their auxiliary
and z losses: its backward is ``autograd.backward([output, aux_total], [grad_from_next, 1])``, so
those terms reach the router gradients on the stage that computed them, as they do in a single
process where they are part of one scalar loss.
"""

from __future__ import annotations

import contextlib

import torch

from meshlm.models.context import SequenceContext
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.context.context_parallel import share_losses
from meshlm.parallel.data.units import EMBEDDING
from meshlm.parallel.pipeline.runtime import PipelineExecutor
from meshlm.parallel.pipeline.schedules import BACKWARD, build_schedule
from meshlm.parallel.pipeline.stages import (STAGE_COPY_NAMES, build_embedding_group, chunk_parameter_names,
                                             keep_stage_modules, rank_chunks)


def loss_term_names(config) -> list[str]:
    """The loss terms a single-process forward reports, in a fixed order."""
    names = ["lm"]
    if "E" in config.block_kinds:
        names += ["moe_aux", "moe_z"]
    if config.mtp_depth:
        names += ["mtp"] + [f"mtp_{depth}" for depth in range(1, config.mtp_depth + 1)]
    return names


class LanguageModelStages:
    """The forward and backward of this rank's chunks for one step (the executor's ``stages``)."""

    def __init__(self, model, chunks, microbatches: list[dict], loss_divisor: int, context, scale_loss=None,
                 backward_context=None):
        self.model, self.chunks, self.microbatches, self.context = model, chunks, microbatches, context
        self.loss_divisor, self.scale_loss = loss_divisor, scale_loss or (lambda loss: loss)
        self.backward_context = backward_context or (lambda action: contextlib.nullcontext())
        """action -> the context its backward runs in (the DP reducer's sync for a chunk's last one)."""
        config = model.config
        self.moe_blocks = [index for index, kind in enumerate(config.block_kinds) if kind == "E"]
        self.term_names = loss_term_names(config)
        self.loss_sum = torch.zeros((), device=context.device)  # all-reduced over pp: on the run's device
        self.term_sums: dict[str, torch.Tensor] = {}
        self.expert_counts: dict[int, torch.Tensor] = {}
        """Global MoE block index -> token assignments per expert, summed over micro-batches."""
        self.saved: dict[tuple[int, int], tuple] = {}

    def forward(self, action, incoming: torch.Tensor | None) -> torch.Tensor | None:
        chunk, batch = self.chunks[action.chunk], self.microbatches[action.microbatch]
        input_ids = batch["input_ids"]
        context = SequenceContext.for_tokens(input_ids, position_ids=batch.get("position_ids"),
                                             dropout_key=batch.get("dropout_key"), document_ids=batch.get("document_ids"),
                                             document_positions=batch.get("document_positions"))
        if chunk.is_first:
            hidden = self.model.embed(input_ids, context)
        else:
            hidden = incoming.requires_grad_(torch.is_grad_enabled())
        stage_input = hidden
        for index in chunk.blocks:
            hidden = self.model.blocks[index](hidden, context)
        total, terms, counts = self.losses(action, hidden, batch, context)
        self._accumulate(chunk, total, terms, counts)
        if torch.is_grad_enabled():
            scaled = self.scale_loss(total / self.loss_divisor) if total is not None else None
            self.saved[(action.microbatch, action.chunk)] = (stage_input, hidden, scaled)
        return None if chunk.is_last else hidden

    def losses(self, action, hidden: torch.Tensor, batch: dict, context: SequenceContext):
        """(total loss or None, its terms, per-expert counts) of one chunk's forward of one micro-batch:
        the last virtual stage's head and losses (``finish``), another stage's MoE terms. A subclass
        adds terms of its own (``meshlm/training/distillation_pipeline.py``)."""
        if self.chunks[action.chunk].is_last:
            output = self.finish(action, hidden, batch, context)
            return output.loss, output.losses, output.tokens_per_expert
        terms = self.model.moe_loss_terms(context) if context.moe_losses else {}
        if terms and self.context.cp_size > 1:  # as share_losses does: 1/cp of each MoE term
            terms = {name: value / self.context.cp_size for name, value in terms.items()}
        total = self.model.add_moe_losses(0.0, terms) if terms else None
        return total, terms, [losses.tokens_per_expert for losses in context.moe_losses]

    def finish(self, action, hidden: torch.Tensor, batch: dict, context: SequenceContext):
        """The last virtual stage's output (head, losses) for the last block's ``hidden``; under CP
        this rank's share of the losses."""
        output = self.model.finish(hidden, batch["input_ids"], batch["labels"], context, return_logits=False)
        return share_losses(output, batch, self.context, self.model.config.mtp_loss_coeff)

    def backward(self, action, grad: torch.Tensor | None) -> torch.Tensor | None:
        chunk = self.chunks[action.chunk]
        stage_input, output, scaled = self.saved.pop((action.microbatch, action.chunk))
        with self.backward_context(action):
            if chunk.is_last:
                scaled.backward()
            else:
                tensors, grads = [output], [grad]
                if scaled is not None:  # this stage's MoE terms: part of the loss, so part of the gradient
                    tensors.append(scaled)
                    grads.append(None)
                torch.autograd.backward(tensors, grads)
        return None if chunk.is_first else stage_input.grad

    def _accumulate(self, chunk, total, terms: dict, counts: list) -> None:
        if total is not None:
            self.loss_sum = self.loss_sum + total.detach().float()
        for name, value in terms.items():
            self.term_sums[name] = self.term_sums.get(name, 0.0) + value.detach().float()
        chunk_moe_blocks = [index for index in chunk.blocks if index in self.moe_blocks]
        for index, count in zip(chunk_moe_blocks, counts):
            self.expert_counts[index] = self.expert_counts.get(index, 0) + count.detach()


class PipelinedModel:
    """This rank's stages of a language model plus what running them needs (see the module docstring)."""

    def __init__(self, model, context, chunks, embedding_group):
        self.model, self.context, self.chunks, self.embedding_group = model, context, chunks, embedding_group
        held_back = set(STAGE_COPY_NAMES) if embedding_group is not None else set()  # summed over stages first
        self.chunk_parameters = [[name for name in names if name not in held_back]
                                 for names in chunk_parameter_names(model, chunks)]
        """Per chunk, the parameters its last backward makes final for the DP reduction."""
        self.last_records = []
        """The per-action timestamps of the last training step (``runtime.ActionRecord``)."""

    @classmethod
    def build(cls, model, context, seq_len: int) -> "PipelinedModel":
        """Keep this rank's stages of the full ``model`` (in place; ``seq_len`` weighs the blocks'
        FLOPs) and join its embedding group. Collective (every rank creates every embedding group)."""
        chunks = rank_chunks(model.config, context.pp_size, context.vp_size, context.pp_rank, seq_len)
        keep_stage_modules(model, chunks, context.pp_rank, context.pp_size)
        return cls(model, context, chunks, build_embedding_group(context, model.config))

    # --- one training step ----------------------------------------------------------------------
    def forward_backward(self, microbatches: list[dict], loss_divisor: int, precision, reducer,
                         make_stages=LanguageModelStages):
        """Run the step's schedule; returns (loss sum, term sums, per-expert counts) of the whole
        pipeline for this DP rank's micro-batches, like the trainer's loop without pipelining.
        ``make_stages``: ``LanguageModelStages`` or a subclass with losses of its own (distillation)."""
        schedule = build_schedule(self.context.pp_size, self.context.vp_size, len(microbatches))
        stages = make_stages(self.model, self.chunks, microbatches, loss_divisor, self.context,
                             precision.scale_loss, self._final_backward_sync(schedule, reducer))
        reducer.zero_grad()
        with reducer.no_sync():
            self.last_records = self._executor(schedule).run(stages, *self._message_layout(microbatches, precision))
        self.sum_embedding_grads(reducer)
        return self.sum_over_pipeline(stages)

    def _final_backward_sync(self, schedule, reducer):
        """action -> context: each chunk's last backward of the step makes its parameters' gradients final."""
        last = {action.chunk: action for action in schedule.actions[self.context.pp_rank] if action.kind == BACKWARD}

        def backward_context(action):
            if last.get(action.chunk) != action:
                return contextlib.nullcontext()
            return reducer.sync_parameters(self.chunk_parameters[action.chunk])

        return backward_context

    def sum_embedding_grads(self, reducer) -> None:
        """Add the first and last stages' embedding gradients (the tied copies take the same step);
        before their DP reduction, which ``finish`` launches (see the module docstring)."""
        if self.embedding_group is None:
            return
        parts = getattr(reducer, "reducers", [reducer])
        if any(getattr(part, "shards_gradients", False) for part in parts):
            # ZeRO-2/3: the embedding is a unit of its own, cut into the same shards on both
            # stages, so the sum goes after its reduce-scatter, on this rank's shard.
            reducer.finish()
            for part in parts:
                shard = part.unit_shard(EMBEDDING)
                if shard is not None:
                    all_reduce_(shard, self.embedding_group)
            return
        for name, grad in reducer.named_grads():
            if name in STAGE_COPY_NAMES:
                all_reduce_(grad, self.embedding_group)

    @torch.no_grad()
    def evaluate(self, batches: list[dict], precision) -> float:
        """Sum over ``batches`` of the LM loss (under CP: this CP rank's shares), on every rank of
        the pipeline (forward-only schedule)."""
        stages = LanguageModelStages(self.model, self.chunks, batches, 1, self.context)
        schedule = build_schedule(self.context.pp_size, self.context.vp_size, len(batches), forward_only=True)
        self._executor(schedule).run(stages, *self._message_layout(batches, precision))
        _, terms, _ = self.sum_over_pipeline(stages)
        return float(terms["lm"])

    # --- helpers ---------------------------------------------------------------------------------------
    def _executor(self, schedule) -> PipelineExecutor:
        return PipelineExecutor(schedule, self.context.pp_rank, self.context.pp_ranks, self.context.pp_group)

    def _message_layout(self, microbatches: list[dict], precision):
        """(shape, dtype, device) of every activation between stages: [batch, local sequence, hidden]."""
        batch, seq = microbatches[0]["input_ids"].shape
        if self.context.sequence_parallel:
            seq //= self.context.tp_size
        device = microbatches[0]["input_ids"].device
        return (batch, seq, self.model.config.hidden_size), precision.dtype, device

    def sum_over_pipeline(self, stages: LanguageModelStages):
        """The stages' loss sums, term sums and expert counts added over the pipeline (one all-reduce)."""
        config, device = self.model.config, self.context.device
        names = stages.term_names
        experts = [torch.zeros(config.for_block(index).moe_num_experts, dtype=torch.int64, device=device)
                   for index in stages.moe_blocks]
        for position, index in enumerate(stages.moe_blocks):
            if index in stages.expert_counts:
                experts[position] = stages.expert_counts[index].to(torch.int64)
        pieces = [stages.loss_sum.reshape(1)]
        pieces += [torch.as_tensor(stages.term_sums.get(name, 0.0), device=device).reshape(1) for name in names]
        pieces += experts
        flat = torch.cat([piece.double() for piece in pieces])  # float64: counts stay exact integers
        all_reduce_(flat, self.context.pp_group)
        values = flat.split([piece.numel() for piece in pieces])
        terms = {name: value[0].float() for name, value in zip(names, values[1:1 + len(names)])}
        counts = [value.to(torch.int64) for value in values[1 + len(names):]]
        return values[0][0].float(), terms, counts


__all__ = ["LanguageModelStages", "PipelinedModel", "loss_term_names"]
