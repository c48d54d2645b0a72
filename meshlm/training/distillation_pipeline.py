"""Distillation under pipeline parallelism: the teacher's own forward pipeline pass, then the student's.

Under ``parallel.pp`` the teacher (``distillation.build_teacher``) is cut into stages as the
student is: its virtual stage k lives on the rank of the student's virtual stage k (block-wise
distillation cuts it at the student's boundaries, so teacher block i sits beside student block
i). Each training step then runs two schedules over the same micro-batches:

    teacher pass    a forward-only schedule (``build_schedule(..., forward_only=True)``, the one
                    evaluation uses) through the teacher's stages, activations sent between
                    stages by the same executor and point-to-point messages as the student's;
                    each rank keeps what the student's stages will need (below). A barrier over
                    the pipeline then separates its messages from the student's, which reuse
                    the same (micro-batch, stage) tags.
    student step    the usual 1F1B / interleaved schedule, with ``DistillingStages``: the last
                    virtual stage's head is ``Distillation.head_output`` (logit distillation,
                    the teacher's logits computed there from its final hidden state), and under
                    ``train.distill_blocks`` every chunk adds its own blocks' errors to its loss,
                    as a stage with MoE blocks adds their auxiliary terms (``pipelined_model.py``).

**Memory of the teacher under PP** (on top of its resident weight shards): logit distillation
keeps, on the last pipeline rank only, the teacher's final hidden state of every micro-batch of
the step -- m x [micro_batch, seq / (tp if sp) / cp, teacher hidden] in the run's dtype, one
activation message per micro-batch -- until the student's last stage consumes it; the teacher's
logits [tokens, vocab / tp] (fp32) exist one micro-batch at a time, as without pipelining.
Block-wise distillation keeps on every rank the teacher's input to each of its chunks for every
micro-batch (m x vp such tensors) and recomputes the chunk's teacher blocks, forward only, when
the student's chunk runs: the teacher's blocks run twice per step, so that a rank never holds
m x (its blocks) hidden states.

Interleaving (``parallel.vp`` > 1) needs nothing more: the forward-only schedule runs any vp and
each chunk finds its own (micro-batch, chunk) entry.
"""

from __future__ import annotations

import functools

import torch

from meshlm.parallel.collectives import barrier
from meshlm.parallel.pipeline.pipelined_model import LanguageModelStages
from meshlm.parallel.pipeline.runtime import PipelineExecutor
from meshlm.parallel.pipeline.schedules import build_schedule


class TeacherStages:
    """The executor's ``stages`` for the teacher's forward-only pass over one step's micro-batches."""

    def __init__(self, distillation, microbatches: list[dict]):
        self.distillation, self.microbatches = distillation, microbatches
        self.final_hidden: dict[int, torch.Tensor] = {}
        """Micro-batch -> the teacher's last block output (logit distillation, last virtual stage)."""
        self.chunk_inputs: dict[tuple[int, int], torch.Tensor] = {}
        """(micro-batch, chunk) -> the teacher's input to that chunk (block-wise distillation)."""

    @torch.no_grad()
    def forward(self, action, incoming: torch.Tensor | None) -> torch.Tensor | None:
        distillation, batch = self.distillation, self.microbatches[action.microbatch]
        chunk = distillation.teacher_chunks[action.chunk]
        first_state = None if chunk.is_first else incoming
        if distillation.block_wise:
            if first_state is None:
                first_state = distillation.teacher_states(batch, blocks=())[0]
            self.chunk_inputs[(action.microbatch, action.chunk)] = first_state
        hidden = distillation.teacher_states(batch, chunk.blocks, first_state)[-1]
        if not chunk.is_last:
            return hidden
        if not distillation.block_wise:
            self.final_hidden[action.microbatch] = hidden
        return None

    def backward(self, action, grad):
        raise RuntimeError("the teacher's pipeline pass is forward-only")


def teacher_pass(distillation, microbatches: list[dict]) -> TeacherStages:
    """Run the teacher's forward-only schedule over ``microbatches`` on this rank's stages (collective
    over the pipeline); returns what each student stage needs (see the module docstring)."""
    context, teacher = distillation.context, distillation.teacher
    stages = TeacherStages(distillation, microbatches)
    schedule = build_schedule(context.pp_size, context.vp_size, len(microbatches), forward_only=True)
    batch, seq = microbatches[0]["input_ids"].shape
    if context.sequence_parallel:
        seq //= context.tp_size
    shape = (batch, seq, teacher.config.hidden_size)
    dtype = next(teacher.parameters()).dtype
    PipelineExecutor(schedule, context.pp_rank, context.pp_ranks, context.pp_group).run(
        stages, shape, dtype, microbatches[0]["input_ids"].device)
    barrier(context.pp_group)  # every teacher message received before the student's, with the same tags, go out
    return stages


class DistillingStages(LanguageModelStages):
    """The student's stages with the distillation losses of ``distillation`` (``Distillation``),
    fed by the teacher's pass ``teacher`` (``TeacherStages``) of the same micro-batches."""

    def __init__(self, *args, distillation, teacher: TeacherStages, **kwargs):
        super().__init__(*args, **kwargs)
        self.distillation, self.teacher = distillation, teacher
        self.term_names = self.term_names + distillation.term_names(self.model.config.num_blocks)

    def finish(self, action, hidden: torch.Tensor, batch: dict, context):
        if self.distillation.block_wise:
            return super().finish(action, hidden, batch, context)
        teacher_hidden = self.teacher.final_hidden.pop(action.microbatch)
        return self.distillation.head_output(self.model, hidden, batch, context, teacher_hidden)

    def losses(self, action, hidden: torch.Tensor, batch: dict, context):
        total, terms, counts = super().losses(action, hidden, batch, context)
        if not self.distillation.block_wise:
            return total, terms, counts
        blocks = self.chunks[action.chunk].blocks
        with torch.no_grad():
            first_state = self.teacher.chunk_inputs.pop((action.microbatch, action.chunk))
            states = self.distillation.teacher_states(batch, blocks, first_state)
        errors = self.distillation.block_errors(self.model, blocks, states, batch)
        total, terms = self.distillation.add_block_errors(total, terms, errors)
        return total, terms, counts


def distilling_stages(distillation, microbatches: list[dict]):
    """``make_stages`` for ``PipelinedModel.forward_backward``: the teacher's pass runs here, first."""
    return functools.partial(DistillingStages, distillation=distillation,
                             teacher=teacher_pass(distillation, microbatches))


__all__ = ["DistillingStages", "TeacherStages", "distilling_stages", "teacher_pass"]
