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
Under CP the teacher runs on the same chunks (ring attention, as the student): the per-token
terms are local to the chunk, so each rank's share is its sum over its labelled tokens divided by
the whole sequences' count (as ``share_losses`` does for the LM loss), and the block-wise error
1/cp of its local mean. Under PP the teacher has stages of its own beside the student's and runs
a forward-only pipeline pass before each step's schedule (``distillation_pipeline.py``, which
also says what that holds in memory). So the run equals the single-process run at every
tp/sp/dp/ep/ZeRO/pp (vp)/cp layout.

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
from meshlm.models.losses import IGNORE_INDEX
from meshlm.models.moe.layer import set_load_balancing_sum
from meshlm.parallel.collectives import reduce_from_group, summing_over
from meshlm.parallel.context.context_parallel import (apply_context_parallel, check_context_parallel_model,
                                                      share_losses)
from meshlm.parallel.mesh import check_layout
from meshlm.parallel.parallelize import parallelize_model
from meshlm.parallel.pipeline.stages import keep_stage_modules, rank_chunks
from meshlm.parallel.tensor.vocab_parallel import (
    vocab_parallel_cross_entropy,
    vocab_parallel_distillation,
)


def frozen_model_config(setting: str, path: str, student_config):
    """(folder, model config) of the frozen model named by ``setting`` (e.g. ``train.distill_from``)
    at ``path``, refused (ConfigError, one sentence naming the setting) when it is missing, not a
    meshlm model, or has another vocabulary than the run's model: its distribution is compared to
    the run's token by token."""
    if not Path(path).exists():
        raise ConfigError(f"{setting}={path} does not exist; give a meshlm model folder, training checkpoint "
                          "(step_N) or run directory.")
    try:
        directory = resolve_model_dir(path)
        config = read_model_config(directory)
    except CheckpointError as error:
        raise ConfigError(f"{setting}={path} is not a meshlm model: {error}") from error
    if config.vocab_size != student_config.vocab_size:
        raise ConfigError(f"{setting}={path} has a vocabulary of {config.vocab_size} tokens but the run's "
                          f"model has {student_config.vocab_size}; its distribution is compared with the run's "
                          "token by token, so use a model with the run's tokenizer.")
    return directory, config


def teacher_config(path: str, student_config, block_wise: bool):
    """The teacher folder's model config, refused (ConfigError, one sentence) when it cannot
    teach this student: another vocabulary, or for block-wise distillation other blocks."""
    directory, config = frozen_model_config("train.distill_from", path, student_config)
    if block_wise and (config.num_blocks, config.hidden_size) != (student_config.num_blocks,
                                                                 student_config.hidden_size):
        raise ConfigError(f"train.distill_blocks=true pairs block i of student and teacher, but the teacher has "
                          f"{config.num_blocks} blocks of width {config.hidden_size} and the student "
                          f"{student_config.num_blocks} of width {student_config.hidden_size}; use a teacher with "
                          "the same block count and hidden size, or train.distill_blocks=false.")
    return directory, config


@torch.no_grad()
def build_frozen_model(setting: str, directory, model_config, config, context, device: torch.device,
                       dtype: torch.dtype, cut_by=None):
    """(model, its chunks): this rank's shards of the frozen model in ``directory`` (named by the
    config key ``setting`` in errors), built as ``build_model`` builds the run's model (meta ->
    parallelize -> CP -> pipeline stages -> materialize from the folder), in eval mode, frozen,
    in ``dtype``; the chunks (``stages.ModelChunk``) this rank runs under pp > 1 (stages cut by
    ``cut_by``, default its own config), else None. A teacher for distillation; the reference
    model of preference optimization and RL."""
    train = config.train
    try:
        check_layout(config.parallel, model_config, context.world_size, train.seq_len)
        check_context_parallel_model(model_config, config.parallel.cp, train.seq_len)
    except ConfigError as error:
        raise ConfigError(f"{setting}: the model in {directory} does not fit the layout: {error}") from error
    with torch.device("meta"):
        model = LanguageModel(model_config, seed=train.seed)
    model = parallelize_model(model, context, config.parallel.vocab_pad_multiple)
    apply_context_parallel(model, context)  # ring attention, Mamba state hand-off (cp > 1)
    set_load_balancing_sum(model, summing_over(context.dp_cp_group))
    chunks = None
    if context.pp_size > 1:  # its stage k on the rank of the run's stage k
        chunks = rank_chunks(cut_by or model_config, context.pp_size, context.vp_size, context.pp_rank,
                             train.seq_len)
        keep_stage_modules(model, chunks, context.pp_rank, context.pp_size)
    materialize(model, context, weights_source(directory), device)
    for param in model.parameters():
        param.requires_grad_(False)
        param.data = param.data.to(dtype)
    return model.eval(), chunks


def build_teacher(config, context, device: torch.device, dtype: torch.dtype):
    """(teacher, its chunks): this rank's shards of the teacher ``config.train.distill_from``
    (``build_frozen_model``); block-wise, its pipeline stages are cut as the student's, so that
    teacher block i sits beside student block i."""
    train = config.train
    directory, model_config = teacher_config(train.distill_from, config.model, train.distill_blocks)
    return build_frozen_model(f"train.distill_from={train.distill_from}", directory, model_config, config,
                              context, device, dtype, cut_by=config.model if train.distill_blocks else None)


def local_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's fp32 logits [b, s, V'/tp] (all of them in one process)."""
    if hasattr(model, "local_logits"):  # TensorParallelLanguageModel
        return model.local_logits(hidden)
    return model.head_logits(hidden)


class Distillation:
    """The teacher and the loss of one student micro-batch (see the module docstring)."""

    def __init__(self, teacher: LanguageModel, train, context, teacher_chunks=None):
        self.teacher, self.context, self.teacher_chunks = teacher, context, teacher_chunks
        self.kind, self.temperature = train.distill_loss, train.distill_temperature
        self.weight, self.block_wise = train.distill_weight, train.distill_blocks

    @classmethod
    def build(cls, config, context, device: torch.device, dtype: torch.dtype) -> Distillation | None:
        """None when the run does not distill (``train.distill_from`` unset)."""
        if config.train.distill_from is None:
            return None
        teacher, chunks = build_teacher(config, context, device, dtype)
        return cls(teacher, config.train, context, chunks)

    def term_names(self, num_blocks: int) -> list[str]:
        """The loss terms distillation adds to the model's ('lm', MoE, MTP)."""
        return ["distill"] + ([f"distill_block_{index}" for index in range(num_blocks)] if self.block_wise else [])

    def forward(self, model, batch: dict[str, torch.Tensor]) -> LMOutput:
        """The student's output on ``batch`` with the total loss and its terms ('lm', 'distill',
        and the model's MoE / MTP terms), as ``model(...)`` returns it; under CP this rank's
        share of each (``share_losses``): summed over the CP group they give the micro-batch's."""
        if self.block_wise:
            with torch.no_grad():
                teacher_states = self.teacher_states(batch)
            errors = self.block_errors(model, range(len(model.blocks)), teacher_states, batch)
            output = model(batch["input_ids"], batch["labels"], position_ids=batch.get("position_ids"),
                           return_logits=False, dropout_key=batch.get("dropout_key"),
                           document_ids=batch.get("document_ids"),
                           document_positions=batch.get("document_positions"))
            output = share_losses(output, batch, self.context, model.config.mtp_loss_coeff)
            return self.add_block_errors(output.loss, output.losses, errors, output)
        with torch.no_grad():
            teacher_hidden = self.teacher_states(batch)[-1]  # the other states are freed here
        context = self.sequence_context(batch, dropout=True)
        hidden = model.run_blocks(model.embed(batch["input_ids"], context), context)
        return self.head_output(model, hidden, batch, context, teacher_hidden)

    def head_output(self, model, hidden: torch.Tensor, batch: dict[str, torch.Tensor], context: SequenceContext,
                    teacher_hidden: torch.Tensor) -> LMOutput:
        """Logit distillation from the student's and the teacher's last hidden states: what
        ``model.finish`` is to the plain LM loss (also the last pipeline stage's head), this rank's share."""
        input_ids, labels, vocab = batch["input_ids"], batch["labels"], model.config.vocab_size
        with torch.no_grad():
            teacher_logits = local_logits(self.teacher, teacher_hidden)
        logits = local_logits(model, hidden)
        distill = vocab_parallel_distillation(logits, teacher_logits, labels, self.context, vocab, self.kind,
                                              self.temperature, reduction="sum") / labelled_targets(batch)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.weight < 1):  # w = 1: logged only
            lm = vocab_parallel_cross_entropy(logits, labels, self.context, vocab)
        output = LMOutput(logits=None, losses={"lm": lm})
        total = lm
        if context.moe_losses:
            output.tokens_per_expert = [losses.tokens_per_expert for losses in context.moe_losses]
            output.losses.update(model.moe_loss_terms(context))
            total = model.add_moe_losses(total, output.losses)
        if model.mtp is not None:
            mtp_context = SequenceContext(position_ids=context.position_ids, dropout_key=context.dropout_key,
                                          document_ids=context.document_ids,
                                          document_positions=context.document_positions)
            per_depth = model.mtp(hidden, input_ids, labels, model, mtp_context, fused_loss=True)
            output.losses.update({f"mtp_{depth}": loss for depth, loss in enumerate(per_depth, start=1)})
            output.losses["mtp"] = torch.stack(per_depth).mean()
            total = total + model.config.mtp_loss_coeff * output.losses["mtp"]
        output.loss = total
        output = share_losses(output, batch, self.context, model.config.mtp_loss_coeff)
        output.loss = output.loss + self.weight * (distill - output.losses["lm"])
        output.losses["distill"] = distill
        return output

    def block_errors(self, model, blocks, teacher_states: list[torch.Tensor],
                     batch: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Global block index -> this rank's share of the block's mean squared error: student block
        ``blocks[j]`` on ``teacher_states[j]`` (the teacher's input to that block) against
        ``teacher_states[j + 1]`` (its output)."""
        context = self.sequence_context(batch, dropout=True)
        return {index: self.mean_squared_error(model.blocks[index](teacher_states[j].detach(), context),
                                               teacher_states[j + 1])
                for j, index in enumerate(blocks)}

    def add_block_errors(self, total, losses: dict, errors: dict[int, torch.Tensor], output=None):
        """``total`` (None: nothing yet) plus w * the blocks' errors, minus w * the LM term where
        ``losses`` has it; ``losses`` gains 'distill' and each block's term. Returns ``output``
        with them, or (total, losses) without."""
        distill = torch.stack(list(errors.values())).sum()
        extra = self.weight * (distill - losses["lm"]) if "lm" in losses else self.weight * distill
        total = extra if total is None else total + extra
        losses = {**losses, "distill": distill, **{f"distill_block_{index}": error for index, error in errors.items()}}
        if output is None:
            return total, losses
        output.loss, output.losses = total, losses
        return output

    def teacher_states(self, batch: dict[str, torch.Tensor], blocks=None, first_state=None) -> list[torch.Tensor]:
        """The teacher's hidden state entering ``blocks`` (default: all; after the embedding, or
        ``first_state``) and after each of them (forward only)."""
        context = self.sequence_context(batch, dropout=False)
        states = [self.teacher.embed(batch["input_ids"], context) if first_state is None else first_state]
        for block in (self.teacher.blocks if blocks is None else (self.teacher.blocks[index] for index in blocks)):
            states.append(block(states[-1], context))
        return states

    def mean_squared_error(self, actual: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean over tokens and hidden units of the squared difference: this rank's share. Under SP
        each rank holds a slice of the sequence, so the sum is completed over TP (all-reduce forward,
        identity backward); under CP each holds 1/cp of the tokens, and the CP group sums the shares."""
        squared = (actual.float() - target.float()).square().sum()
        count = actual.numel() * self.context.cp_size
        if not self.context.sequence_parallel:
            return squared / count
        return reduce_from_group(squared, self.context.tp_group) / (count * self.context.tp_size)

    @staticmethod
    def sequence_context(batch: dict[str, torch.Tensor], dropout: bool) -> SequenceContext:
        return SequenceContext.for_tokens(batch["input_ids"], position_ids=batch.get("position_ids"),
                                          dropout_key=batch.get("dropout_key") if dropout else None,
                                          document_ids=batch.get("document_ids"),
                                          document_positions=batch.get("document_positions"))


def labelled_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The micro-batch's labelled next-token targets, over the whole sequences under CP (so that a
    sum over this rank's tokens divided by it is this rank's share of the mean), at least 1."""
    labels = batch.get("sequence_labels", batch["labels"])
    return (labels != IGNORE_INDEX).sum().clamp_min(1)


__all__ = ["Distillation", "build_teacher", "local_logits", "teacher_config"]
