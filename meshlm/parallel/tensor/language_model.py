"""The tensor-parallel language model: a vocabulary-parallel head whose loss never gathers logits.

The head is column-parallel over the padded vocabulary (``vocab_parallel.py``): the training
loss is the vocab-parallel cross-entropy of each rank's local logits, and logits are gathered in
full only when asked for (evaluation, generation). Under sequence parallelism the final norm
runs on the rank's tokens and the sequence is all-gathered before the head.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from meshlm.errors import ConfigError
from meshlm.models.language_model import LanguageModel
from meshlm.parallel.tensor.layers import column_parallel_input
from meshlm.parallel.tensor.vocab_parallel import gather_vocab_logits, vocab_parallel_cross_entropy


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
        """Final norm (on this rank's tokens under SP), then this rank's logits [b, s, V'/t] in fp32
        (divided and soft-capped as ``finished_logits`` says: elementwise, so each rank its own slice)."""
        if not normed:
            hidden = self.final_norm(hidden)
        full = column_parallel_input(hidden, self.parallel_context)
        return self.finished_logits(F.linear(full, self.output_weight(), self.output_bias()).float())

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


__all__ = ["TensorParallelLanguageModel", "sequence_parallel_off"]
