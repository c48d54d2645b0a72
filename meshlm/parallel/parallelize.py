"""Turn a full single-process ``LanguageModel`` into this rank's share of the model, in place.

``parallelize_model`` keeps each rank's slices (Shoeybi et al. 2019) and, with
sequence parallelism, shards the residual stream along the sequence (Korthikanti et al. 2022).
The model may be on the ``meta`` device (the trainer's way: ``meshlm/training/build.py`` then
fills only the shards) or hold values (a test's way: the slices keep them):

    embedding       vocabulary-parallel; summed over the group (SP: reduce-scattered along s);
                    learned positions replicated (SP: the rank's slice of positions, partial gradient)
    each block      h + mixer(norm(h)); the norm is replicated (SP: runs on the rank's tokens)
      attention     split by heads (``tensor/attention.py``): q/k/v column-parallel, o row-parallel. KV heads are split
                    when tp divides them; when there are fewer KV heads than ranks every rank
                    keeps the full k/v projections and computes the one KV head its query heads
                    share. QK-norm weights act on local heads only: partial gradients.
      MLP           gate/up column-parallel, down row-parallel: the FFN width is split
                    (``tensor/mlp.py``)
      Mamba-2       by heads and groups (``tensor/mamba.py``)
      MoE           experts split on their FFN width (``tensor/moe.py``), or over the expert
                    grid when ep > 1, etp != tp or cp > 1 (``expert/expert_parallel.py``)
      linear (L)    replicated: its one h x h matrix is small, and splitting it would add a
                    collective per block; every rank applies it to the tokens it holds (under
                    SP its rank's slice, so its gradient, like the norm's, is partial)
      no-op (0)     nothing to split
                    Every block is split by its own sizes (``model.block_overrides``): the
                    modules were built from ``config.for_block(i)`` and carry them.
    final norm      replicated (SP: on the rank's tokens, then the sequence is all-gathered)
    head + loss     column-parallel over the padded vocabulary (``tensor/language_model.py``); the training loss is the
                    vocab-parallel cross-entropy; logits are gathered only when asked for
    MTP depths      like the main stack; their norms and 2h -> h projection are replicated
    dropout         masks keyed by global coordinates (meshlm/models/dropout.py): under SP each
                    residual-stream dropout masks its rank's slice of the positions, attention
                    dropout knows its global head indices

Attention and the MLP enter the parallel region once per block (one all-reduce in backward, or
one all-gather under SP) however many column-parallel layers read the input. Modules keep
their names (only their class changes, as FSDP2's ``fully_shard`` does), so parameter names --
and with ``gather_full_state_dict`` whole checkpoints -- are those of the single-process model.
"""

from __future__ import annotations

import torch

from meshlm.errors import ConfigError
from meshlm.models.dropout import HiddenDropout
from meshlm.models.language_model import LanguageModel
from meshlm.models.position_embedding import LearnedPositions
from meshlm.models.pattern import LINEAR, NO_OP
from meshlm.parallel.expert.expert_parallel import needs_expert_parallel, parallelize_expert_moe, parallelize_experts
from meshlm.parallel.tensor.attention import parallelize_attention
from meshlm.parallel.tensor.language_model import TensorParallelLanguageModel
from meshlm.parallel.tensor.mamba import parallelize_mamba
from meshlm.parallel.tensor.mlp import parallelize_mlp
from meshlm.parallel.tensor.moe import parallelize_moe
from meshlm.parallel.tensor.sharding import mark_partial_grad
from meshlm.parallel.tensor.vocab_parallel import VocabParallelEmbedding, padded_vocab_size, vocab_parallel_head


def parallelize_block(block, context) -> None:
    """The mixer split over the group; under SP the pre-norm runs on this rank's tokens."""
    if block.kind == "*":
        parallelize_attention(block.mixer, context)
    elif block.kind == "-":
        parallelize_mlp(block.mixer, context)
    elif block.kind == "M":
        parallelize_mamba(block.mixer, context)
    elif block.kind == "E":
        parallelize_moe_block(block.mixer, context)
    elif block.kind == NO_OP:
        return
    elif block.kind == LINEAR:
        block.mixer.parallel_context = context  # (its adapter's dropout keys this rank's sequence slice)
        if context.sequence_parallel:
            mark_partial_grad(block.mixer)
    else:
        raise ConfigError(f"block kind {block.kind!r} has no tensor-parallel version; use parallel.tp=1.")
    if context.sequence_parallel:
        mark_partial_grad(block.norm, block.output_norm)  # (a None is skipped)


def parallelize_moe_block(layer, context):
    """An MoE layer over the expert grid when the layout asks for one (ep > 1, etp != tp or cp > 1:
    ``needs_expert_parallel``), else with its experts split on the FFN width over TP."""
    if needs_expert_parallel(context):
        return parallelize_expert_moe(layer, context)
    return parallelize_moe(layer, context)


@torch.no_grad()
def parallelize_model(model: LanguageModel, context, vocab_pad_multiple: int = 1) -> LanguageModel:
    """Split ``model`` in place over ``context``'s TP group (see the module docstring); with tp 1
    the model is returned unchanged (but for its MoE blocks when ep > 1 or etp > 1: see
    ``meshlm/parallel/expert/expert_parallel.py``). ``vocab_pad_multiple`` is ``parallel.vocab_pad_multiple``."""
    if context.tp_size == 1:
        return parallelize_experts(model, context)
    if context.sequence_parallel:
        mark_partial_grad(model.final_norm)
        if model.position_embedding is not None:  # each rank adds the rows of its slice of the sequence
            mark_partial_grad(model.position_embedding)
    for module in model.modules():
        if isinstance(module, (HiddenDropout, LearnedPositions)):  # under SP: this rank's slice of the sequence
            module.parallel_context = context
    for block in model.blocks:
        parallelize_block(block, context)
    if model.mtp is not None:
        for depth in model.mtp.depths:
            for block in depth.blocks:
                parallelize_block(block, context)
            if context.sequence_parallel:
                mark_partial_grad(depth.hidden_norm, depth.embedding_norm, depth.final_norm, depth.projection)

    padded = padded_vocab_size(model.config.vocab_size, context.tp_size, vocab_pad_multiple)
    model.embedding = VocabParallelEmbedding.from_full(model.embedding, context, padded)
    if model.output is not None:
        model.output = vocab_parallel_head(model.output, context, padded)
    model.__class__ = TensorParallelLanguageModel
    model.parallel_context = context
    return model


__all__ = ["parallelize_block", "parallelize_model", "parallelize_moe_block"]
