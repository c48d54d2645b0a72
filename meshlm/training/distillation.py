"""Knowledge distillation: the run's model (the student) learns to reproduce a teacher's outputs.

    meshlm prune runs/big/checkpoints/step_5000 models/small ...
    meshlm train configs/small.yaml train.init_from=models/small train.distill_from=runs/big

This is how Minitron (Muralidharan et al. 2024, "Compact Language Models via Pruning and
Knowledge Distillation"; Sreenivas et al. 2024) recovers a pruned model: instead of the
next-token labels, the student is trained on the teacher's whole distribution over the
vocabulary at every position, which carries far more signal per token. Each training
micro-batch runs through both models:

    teacher (eval mode, no_grad)     z_T = its logits       no dropout, no activations kept
    student (training)               z_S = its logits
    distill = mean over labelled tokens of  T^2 KL(softmax(z_T/T) || softmax(z_S/T))   ('kl')
    loss    = (1 - w) * LM(z_S) + w * distill + the model's own MoE aux/z and MTP terms

``train.distill_loss`` picks the per-token term: 'kl' / 'forward_kl' as above, 'reverse_kl'
(KL(student || teacher), mode-seeking), or 'cosine' (1 - cosine similarity of z_S and z_T; the
temperature does not change it). ``train.distill_weight`` = w (default 1: the LM term is only
computed, under no_grad, to be logged). metrics.jsonl shows ``loss_lm`` and ``loss_distill``
beside the total ``loss`` (as ``loss_moe_aux``...); validation reports the LM loss, as always.

**Layout.** The teacher is built the way the trainer builds the student (``build.py``): on
``meta``, cut to this rank's TP/EP shards with the same ``parallelize_model`` and the same
process groups, then only its shards read from the folder by slice (``materialize``, as
``train.init_from``), and cast to the run's dtype. Under TP both models' logits stay sharded by
vocabulary and the loss never gathers them: ``vocab_parallel_distillation``
(``meshlm/parallel/tensor/vocab_parallel.py``) reduces the softmax maxima and sums over the TP
group and gets the gradient locally. Each DP rank runs the teacher on its own micro-batches.
So the run equals the single-process run at every tp/sp/dp/ep/ZeRO layout. Pipeline and context
parallelism are refused for now (the teacher would need its own stages and ring attention).

**Memory.** The teacher's weights (its shards, in the run's dtype) stay resident, plus one
micro-batch's fp32 logits of each model ([tokens, vocab / tp]) and the two [tokens, vocab / tp]
tensors the backward needs: the student's head is not the fused chunked loss here.

**Block-wise distillation** (``train.distill_blocks``; Puzzle, Bercovich et al. 2024, "blockwise
local distillation"): the teacher's hidden state entering each block, h_{i-1}, is fed (detached) to
the student's block i, which is trained to produce the teacher's h_i:

    distill = sum_i mean((block_i^S(h_{i-1}^T) - h_i^T)^2)     over tokens and hidden units

Each block's gradient depends on that block alone, so all blocks train independently and in
parallel (a replacement block can be fitted to its teacher block without the rest of the model).
The student's ordinary forward still runs for the LM term (and for the MoE and MTP terms): at
w = 1 its gradient is exactly zero, but every parameter gets one, so every layout updates the
same parameters. Under SP the squared error is summed over the sequence shards (one all-reduce).
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshlm.checkpoint.locate import resolve_model_dir
from meshlm.checkpoint.materialize import materialize
from meshlm.checkpoint.model_files import read_model_config, weights_source
from meshlm.errors import CheckpointError, ConfigError
from meshlm.models.context import SequenceContext
from meshlm.models.language_model import LanguageModel, LMOutput
from meshlm.models.moe.layer import set_load_balancing_sum
from meshlm.parallel.collectives import reduce_from_group, summing_over
from meshlm.parallel.mesh import check_layout
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.tensor.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_distillation,
)


def teacher_config(path: str, student_config, block_wise: bool):
    """The teacher folder's model config, refused (ConfigError, one sentence) when it cannot
    teach this student: another vocabulary, or for block-wise distillation other blocks."""
    if not Path(path).exists():
        raise ConfigError(f"train.distill_from={path} does not exist; give the teacher's meshlm model folder, "
                          "training checkpoint (step_N) or run directory.")
    try:
        directory = resolve_model_dir(path)
        config = read_model_config(directory)
    except CheckpointError as error:
        raise ConfigError(f"train.distill_from={path} is not a meshlm model: {error}") from error
    if config.vocab_size != student_config.vocab_size:
        raise ConfigError(f"train.distill_from={path} has a vocabulary of {config.vocab_size} tokens but the run's "
                          f"model has {student_config.vocab_size}; distillation compares the two distributions "
                          "token by token, so use a teacher with the student's tokenizer.")
    if block_wise and (config.num_blocks, config.hidden_size) != (student_config.num_blocks,
                                                                 student_config.hidden_size):
        raise ConfigError(f"train.distill_blocks=true pairs block i of student and teacher, but the teacher has "
                          f"{config.num_blocks} blocks of width {config.hidden_size} and the student "
                          f"{student_config.num_blocks} of width {student_config.hidden_size}; use a teacher with "
                          "the same block count and hidden size, or train.distill_blocks=false.")
    return directory, config


@torch.no_grad()
def build_teacher(config, context, device: torch.device, dtype: torch.dtype) -> LanguageModel:
    """This rank's shards of the teacher ``config.train.distill_from``, as ``build_model`` builds
    the student (meta -> parallelize -> materialize from the folder), in eval mode, frozen, in ``dtype``."""
    train = config.train
    directory, model_config = teacher_config(train.distill_from, config.model, train.distill_blocks)
    try:
        check_layout(config.parallel, model_config, context.world_size, train.seq_len)
    except ConfigError as error:
        raise ConfigError(f"train.distill_from={train.distill_from}: the teacher does not fit the layout: "
                          f"{error}") from error
    with torch.device("meta"):
        teacher = LanguageModel(model_config, seed=train.seed)
    teacher = parallelize_model(teacher, context, config.parallel.vocab_pad_multiple)
    set_load_balancing_sum(teacher, summing_over(context.dp_cp_group))
    materialize(teacher, context, weights_source(directory), device)
    for param in teacher.parameters():
        param.requires_grad_(False)
        param.data = param.data.to(dtype)
    return teacher.eval()


def local_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's fp32 logits [b, s, V'/tp] (all of them in one process)."""
    if hasattr(model, "local_logits"):  # TensorParallelLanguageModel
        return model.local_logits(hidden)
    return model.head_logits(hidden)


class Distillation:
    """The teacher and the loss of one student micro-batch (see the module docstring)."""

    def __init__(self, teacher: LanguageModel, train, context):
        self.teacher, self.context = teacher, context
        self.kind, self.temperature = train.distill_loss, train.distill_temperature
        self.weight, self.block_wise = train.distill_weight, train.distill_blocks

    @classmethod
    def build(cls, config, context, device: torch.device, dtype: torch.dtype) -> Distillation | None:
        """None when the run does not distill (``train.distill_from`` unset)."""
        if config.train.distill_from is None:
            return None
        return cls(build_teacher(config, context, device, dtype), config.train, context)

    def forward(self, model, batch: dict[str, torch.Tensor]) -> LMOutput:
        """The student's output on ``batch`` with the total loss and its terms ('lm', 'distill',
        and the model's MoE / MTP terms), as ``model(...)`` returns it."""
        if self.block_wise:
            return self.block_wise_forward(model, batch)
        input_ids, labels = batch["input_ids"], batch["labels"]
        with torch.no_grad():
            teacher_logits = local_logits(self.teacher, self.teacher_states(batch)[-1])
        context = self.sequence_context(batch, dropout=True)
        hidden = model.run_blocks(model.embed(input_ids, context), context)
        logits = local_logits(model, hidden)
        vocab = model.config.vocab_size
        distill = vocab_parallel_distillation(logits, teacher_logits, labels, self.context, vocab, self.kind,
                                              self.temperature)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.weight < 1):  # w = 1: logged only
            lm = vocab_parallel_cross_entropy(logits, labels, self.context, vocab)
        output = LMOutput(logits=None, losses={"lm": lm, "distill": distill})
        total = (1 - self.weight) * lm + self.weight * distill
        if context.moe_losses:
            output.tokens_per_expert = [losses.tokens_per_expert for losses in context.moe_losses]
            output.losses.update(model.moe_loss_terms(context))
            total = model.add_moe_losses(total, output.losses)
        if model.mtp is not None:
            mtp_context = SequenceContext(position_ids=context.position_ids, dropout_key=context.dropout_key)
            per_depth = model.mtp(hidden, input_ids, labels, model, mtp_context, fused_loss=True)
            output.losses.update({f"mtp_{depth}": loss for depth, loss in enumerate(per_depth, start=1)})
            output.losses["mtp"] = torch.stack(per_depth).mean()
            total = total + model.config.mtp_loss_coeff * output.losses["mtp"]
        output.loss = total
        return output

    def block_wise_forward(self, model, batch: dict[str, torch.Tensor]) -> LMOutput:
        """Each student block on the teacher's input to that block, against the teacher's output."""
        with torch.no_grad():
            states = self.teacher_states(batch)
        context = self.sequence_context(batch, dropout=True)
        errors = [self.mean_squared_error(block(states[index].detach(), context), states[index + 1])
                  for index, block in enumerate(model.blocks)]
        distill = torch.stack(errors).sum()
        output = model(batch["input_ids"], batch["labels"], position_ids=batch.get("position_ids"),
                       return_logits=False, dropout_key=batch.get("dropout_key"))
        output.loss = output.loss + self.weight * (distill - output.losses["lm"])
        output.losses["distill"] = distill
        output.losses.update({f"distill_block_{index}": error for index, error in enumerate(errors)})
        return output

    def teacher_states(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The teacher's hidden state after the embedding and after each block (forward only)."""
        context = self.sequence_context(batch, dropout=False)
        states = [self.teacher.embed(batch["input_ids"], context)]
        for block in self.teacher.blocks:
            states.append(block(states[-1], context))
        return states

    def mean_squared_error(self, actual: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean over tokens and hidden units of the squared difference; under SP each rank holds a
        slice of the sequence, so the sum is completed over TP (all-reduce forward, identity backward)."""
        squared = (actual.float() - target.float()).square().sum()
        if not self.context.sequence_parallel:
            return squared / actual.numel()
        return reduce_from_group(squared, self.context.tp_group) / (actual.numel() * self.context.tp_size)

    @staticmethod
    def sequence_context(batch: dict[str, torch.Tensor], dropout: bool) -> SequenceContext:
        return SequenceContext.for_tokens(batch["input_ids"], position_ids=batch.get("position_ids"),
                                          dropout_key=batch.get("dropout_key") if dropout else None)


__all__ = ["Distillation", "build_teacher", "local_logits", "teacher_config"]
