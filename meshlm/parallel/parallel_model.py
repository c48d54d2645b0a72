"""Turn a full single-process ``LanguageModel`` into this rank's tensor-parallel share, in place.

Every rank builds the whole model with the same seed, so initialization does not depend on the
layout; ``parallelize_model`` then keeps each rank's slices (Shoeybi et al. 2019) and, with
sequence parallelism, shards the residual stream along the sequence (Korthikanti et al. 2022):

    embedding       vocabulary-parallel; summed over the group (SP: reduce-scattered along s)
    each block      h + mixer(norm(h)); the norm is replicated (SP: runs on the rank's tokens)
      attention     split by heads: q/k/v column-parallel, o row-parallel. KV heads are split
                    when tp divides them; when there are fewer KV heads than ranks every rank
                    keeps the full k/v projections and computes the one KV head its query heads
                    share. QK-norm weights act on local heads only: partial gradients.
      MLP           gate/up column-parallel, down row-parallel: the FFN width is split
      Mamba-2, MoE  ``parallelize_mamba`` / ``parallelize_moe`` (meshlm/parallel/tp_mamba.py,
                    tp_moe.py)
    final norm      replicated (SP: on the rank's tokens, then the sequence is all-gathered)
    head + loss     column-parallel over the padded vocabulary; the training loss is the
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

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from meshlm.models.attention import SelfAttention
from meshlm.models.config import ConfigError
from meshlm.models.dropout import HiddenDropout
from meshlm.models.language_model import LanguageModel
from meshlm.models.mlp import MLP
from meshlm.parallel.tensor_parallel import (ColumnParallelLinear, ReplicatedRowsLinear, RowParallelLinear,
                                             column_parallel_input, mark_partial_grad)
from meshlm.parallel.vocab_parallel import (VocabParallelEmbedding, gather_vocab_logits, padded_vocab_size,
                                            vocab_parallel_cross_entropy, vocab_parallel_head)


class TensorParallelSelfAttention(SelfAttention):
    """``SelfAttention`` over this rank's heads; the input is gathered once for q, k and v."""

    parallel_context = None

    @property
    def head_offset(self) -> int:
        return self.parallel_context.tp_rank * self.num_heads

    def forward(self, x: torch.Tensor, context) -> torch.Tensor:
        return super().forward(column_parallel_input(x, self.parallel_context), context)


class TensorParallelMLP(MLP):
    """``MLP`` over this rank's share of the FFN width; the input is gathered once for gate and up."""

    parallel_context = None

    def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:
        return super().forward(column_parallel_input(x, self.parallel_context), context)


def kv_rows_for_rank(num_heads: int, num_kv_heads: int, head_dim: int, tp_rank: int, tp_size: int) -> slice:
    """Rows of the full k/v projection that this rank's query heads read (GQA: query head h reads
    KV head h // (num_heads / num_kv_heads))."""
    local_heads, group = num_heads // tp_size, num_heads // num_kv_heads
    first = tp_rank * local_heads // group
    last = ((tp_rank + 1) * local_heads - 1) // group
    return slice(first * head_dim, (last + 1) * head_dim)


@torch.no_grad()
def parallelize_attention(attention: SelfAttention, context) -> None:
    tp, heads, kv_heads = context.tp_size, attention.num_heads, attention.num_kv_heads
    if heads % tp:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by parallel.tp={tp}; each rank "
                          "must hold whole heads.")
    attention.q_proj = ColumnParallelLinear.from_full(attention.q_proj, context, gather_input=False)
    if kv_heads % tp == 0:
        attention.k_proj = ColumnParallelLinear.from_full(attention.k_proj, context, gather_input=False)
        attention.v_proj = ColumnParallelLinear.from_full(attention.v_proj, context, gather_input=False)
        attention.num_kv_heads = kv_heads // tp
    elif tp % kv_heads == 0:
        rows = kv_rows_for_rank(heads, kv_heads, attention.head_dim, context.tp_rank, tp)
        attention.k_proj = ReplicatedRowsLinear(attention.k_proj, context, rows, gather_input=False)
        attention.v_proj = ReplicatedRowsLinear(attention.v_proj, context, rows, gather_input=False)
        attention.num_kv_heads = (rows.stop - rows.start) // attention.head_dim
    else:
        raise ConfigError(f"model.num_kv_heads={kv_heads} and parallel.tp={tp}: KV heads are either split "
                          "(kv_heads divisible by tp) or replicated (tp divisible by kv_heads); neither holds.")
    attention.o_proj = RowParallelLinear.from_full(attention.o_proj, context)
    attention.num_heads = heads // tp
    mark_partial_grad(attention.q_norm, attention.k_norm)  # shared by all heads, applied to local ones
    attention.__class__ = TensorParallelSelfAttention
    attention.parallel_context = context


@torch.no_grad()
def parallelize_mlp(mlp: MLP, context) -> None:
    if mlp.gate_proj is not None:
        mlp.gate_proj = ColumnParallelLinear.from_full(mlp.gate_proj, context, gather_input=False)
    mlp.up_proj = ColumnParallelLinear.from_full(mlp.up_proj, context, gather_input=False)
    mlp.down_proj = RowParallelLinear.from_full(mlp.down_proj, context)
    mlp.__class__ = TensorParallelMLP
    mlp.parallel_context = context


def parallelize_block(block, context) -> None:
    """The mixer split over the group; under SP the pre-norm runs on this rank's tokens."""
    if block.kind == "*":
        parallelize_attention(block.mixer, context)
    elif block.kind == "-":
        parallelize_mlp(block.mixer, context)
    elif block.kind == "M":
        _import_parallelizer("tp_mamba", "parallelize_mamba", "Mamba-2 ('M')")(block.mixer, context)
    elif block.kind == "E":
        _import_parallelizer("tp_moe", "parallelize_moe", "MoE ('E')")(block.mixer, context)
    else:
        raise ConfigError(f"block kind {block.kind!r} has no tensor-parallel version; use parallel.tp=1.")
    if context.sequence_parallel:
        mark_partial_grad(block.norm)


def _import_parallelizer(module: str, function: str, what: str):
    import importlib

    try:
        return getattr(importlib.import_module(f"meshlm.parallel.{module}"), function)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"{what} blocks cannot be split by tensor parallelism in this build ({error}); "
                          "use parallel.tp=1 or a pattern without them.") from error


class TensorParallelLanguageModel(LanguageModel):
    """A ``LanguageModel`` whose head holds this rank's vocabulary slice: the training loss
    (``head_loss``, used when the caller does not ask for logits) is the vocab-parallel
    cross-entropy of the local logits; asked for logits, the model gathers them in full."""

    parallel_context = None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
        parallel = self.parallel_context
        if parallel.sequence_parallel and kwargs.get("cache") is not None:
            with sequence_parallel_off(parallel):  # decoding one token at a time cannot split the sequence
                return super().forward(input_ids, labels, **kwargs)
        if parallel.sequence_parallel and input_ids.shape[1] % parallel.tp_size:
            raise ConfigError(f"sequence parallelism splits the sequence over parallel.tp={parallel.tp_size} ranks, "
                              f"but this batch has {input_ids.shape[1]} positions; use a multiple of tp.")
        return super().forward(input_ids, labels, **kwargs)

    def local_logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """Final norm (on this rank's tokens under SP), then this rank's logits [b, s, V'/t] in fp32."""
        if not normed:
            hidden = self.final_norm(hidden)
        full = column_parallel_input(hidden, self.parallel_context)
        return F.linear(full, self.output_weight()).float()

    def head_logits(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """The full logits [b, s, vocab] (gathered over the vocabulary, padding dropped): for
        evaluation and generation. Their gradient is exact (each rank keeps its own slice)."""
        return gather_vocab_logits(self.local_logits(hidden, normed), self.parallel_context, self.config.vocab_size)

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """The training loss: vocab-parallel cross-entropy of the local logits, never gathered."""
        return vocab_parallel_cross_entropy(self.local_logits(hidden, normed), labels, self.parallel_context,
                                            self.config.vocab_size)


@contextmanager
def sequence_parallel_off(context):
    """Run the model with the residual stream replicated instead of sequence-sharded (every layer
    reads the flag at call time); the KV and SSM caches hold local heads either way."""
    saved, context.sequence_parallel = context.sequence_parallel, False
    try:
        yield context
    finally:
        context.sequence_parallel = saved


@torch.no_grad()
def parallelize_model(model: LanguageModel, context, vocab_pad_multiple: int = 1) -> LanguageModel:
    """Split ``model`` in place over ``context``'s TP group (see the module docstring); with tp 1
    the model is returned unchanged (but for its MoE blocks when ep > 1 or etp > 1: see
    ``meshlm.parallel.expert_parallel``). ``vocab_pad_multiple`` is ``parallel.vocab_pad_multiple``."""
    if context.tp_size == 1:
        from meshlm.parallel.expert_parallel import parallelize_experts
        return parallelize_experts(model, context)
    if context.sequence_parallel:
        mark_partial_grad(model.final_norm)
    for module in model.modules():
        if isinstance(module, HiddenDropout):  # under SP it masks this rank's slice of the sequence
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


__all__ = ["parallelize_model", "parallelize_attention", "parallelize_mlp", "parallelize_block",
           "TensorParallelLanguageModel", "TensorParallelSelfAttention", "TensorParallelMLP", "kv_rows_for_rank",
           "sequence_parallel_off"]
