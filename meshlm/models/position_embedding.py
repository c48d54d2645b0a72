"""Learned absolute position embeddings (GPT-2, BERT): a trained vector per position, added to the
token embeddings before the first block.

    h_0 = E_token[x_t] + E_position[p_t]          (model.position_embedding=learned)

The table has ``model.max_position_embeddings`` rows (GPT-2: 1024), the longest sequence such a
model reads: unlike RoPE, it cannot extend past what it was trained on, so a longer training
sequence or a longer generation is refused (``train.seq_len``; ``meshlm generate``). p_t is the
position RoPE would rotate by (``SequenceContext.rotary_positions``): the token's place in its
sequence, in its own document when packed documents are kept apart, the cache's count while
generating.

**Layouts.** The table is small and replicated (not split over the vocabulary like the token
embedding). Each rank looks up the positions of the tokens it holds: under context parallelism
its chunks' global positions, under sequence parallelism its slice of the sequence (the token
embedding arrives reduce-scattered along it), so its gradient there holds only those rows and is
summed over the TP group with the other partial gradients; under pipeline parallelism it lives
with the token embedding on the first stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.errors import ConfigError
from meshlm.models.init import normal


def sequence_parallel_rows(positions: torch.Tensor, parallel_context) -> torch.Tensor:
    """``positions`` [b, s], or under sequence parallelism this rank's contiguous 1/tp of them: the
    rows of the residual stream it holds."""
    if parallel_context is not None and parallel_context.sequence_parallel and parallel_context.tp_size > 1:
        return positions.tensor_split(parallel_context.tp_size, dim=1)[parallel_context.tp_rank]
    return positions


def check_positions_fit(config, positions: int, what: str, fix: str) -> None:
    """ConfigError unless a model ``config`` (a ``ModelConfig``) with a learned position table has room
    for ``positions`` positions (``what`` needs them; ``fix`` says how to need fewer)."""
    length = config.max_position_embeddings
    if config.position_embedding == "learned" and positions > length:
        raise ConfigError(f"{what} needs {positions} positions, and this model's learned position table has "
                          f"model.max_position_embeddings={length} (it cannot read further than it was "
                          f"trained to); {fix}.")


class LearnedPositions(nn.Module):
    """``weight`` [max_position_embeddings, hidden]; ``forward(positions)`` -> its rows at this
    rank's ``positions`` [b, s] (``parallel_context``: set by ``parallelize_model``)."""

    parallel_context = None

    def __init__(self, length: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(length, hidden))

    def init_rules(self, config) -> dict:
        return {"weight": normal(config.init_std)}

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(sequence_parallel_rows(positions, self.parallel_context), self.weight)

    def extra_repr(self) -> str:
        return f"positions={self.weight.shape[0]}, hidden={self.weight.shape[1]}"


__all__ = ["LearnedPositions", "check_positions_fit", "sequence_parallel_rows"]
