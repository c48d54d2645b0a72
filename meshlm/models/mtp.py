"""Multi-token prediction (MTP) heads (Gloeckle et al. 2024; DeepSeek-V3 §2.2; Nemotron 3).

Besides the next token, the model learns to predict tokens further ahead, sequentially: depth k
takes depth k-1's hidden state at position t (depth 0 is the main model's last hidden state),
combines it with the *embedding* of token t+k, runs a few blocks, and predicts token t+k+1
with the shared output head:

    h'_t^k = W_k [ Norm(h_t^{k-1}) ; Norm(Embed(x_{t+k})) ]       (concat, then project 2h -> h)
    h_t^k  = Blocks_k(h'_t^k)
    loss_k = CE(Head(FinalNorm_k(h_t^k)), x_{t+k+1})

Tensors keep their full length by shifting left (the last k positions have no target and are
ignored), so the causal blocks inside each depth see ordinary sequences. The model adds
``mtp_loss_coeff * mean_k loss_k`` to its loss. At inference the depths serve as a draft model
for self-speculative decoding (``meshlm/inference/speculative.py``: ``meshlm generate
--speculative mtp``), each depth with a cache of its own blocks' states.

With packed documents kept apart (``context.document_ids``) no depth looks or predicts across a
boundary: where token t+k lies in another document than t, depth k sees the fill token 0 and has
no target there, exactly as at the end of a document run on its own.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.models.block import Block, pair_parallel_residual_blocks
from meshlm.models.losses import IGNORE_INDEX, language_model_loss
from meshlm.models.norms import model_norm
from meshlm.models.pattern import parse_pattern


def shift_left(tensor: torch.Tensor, steps: int, fill: int) -> torch.Tensor:
    """tensor[:, t + steps] at position t; the last ``steps`` positions are ``fill``."""
    shifted = tensor.roll(-steps, dims=1)
    shifted[:, -steps:] = fill
    return shifted


class MTPDepth(nn.Module):
    def __init__(self, config, first_layer_index: int):
        super().__init__()
        norm = lambda: model_norm(config)  # noqa: E731
        self.hidden_norm, self.embedding_norm, self.final_norm = norm(), norm(), norm()
        self.projection = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        kinds = parse_pattern(config.mtp_pattern, "model.mtp_pattern").kinds
        self.blocks = nn.ModuleList(Block(kind, config, first_layer_index + i) for i, kind in enumerate(kinds))
        pair_parallel_residual_blocks(self.blocks, config)

    def forward(self, previous_hidden: torch.Tensor, future_embeddings: torch.Tensor, context) -> torch.Tensor:
        combined = torch.cat((self.hidden_norm(previous_hidden), self.embedding_norm(future_embeddings)), dim=-1)
        hidden = self.projection(combined)
        for block in self.blocks:
            hidden = block(hidden, context)
        return hidden


class MultiTokenPrediction(nn.Module):
    def __init__(self, config):
        super().__init__()
        blocks_per_depth = len(parse_pattern(config.mtp_pattern, "model.mtp_pattern").kinds)
        self.depths = nn.ModuleList(
            MTPDepth(config, config.num_blocks + depth * blocks_per_depth) for depth in range(config.mtp_depth))
        self.shift = shift_left
        """How tokens are shifted along the sequence; context parallelism replaces it with a shift
        across its ranks' chunks (``meshlm.parallel.context.context_parallel.ContextParallelShift``)."""

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                model, context, fused_loss: bool = False) -> list[torch.Tensor]:
        """Loss of each depth (mean CE over positions with a target), depth 1 first; with
        ``fused_loss`` through ``model.head_loss`` (no full logits)."""
        losses = []
        for k, depth in enumerate(self.depths, start=1):
            future_ids, future_labels = self.shift(input_ids, k, fill=0), self.shift(labels, k, fill=IGNORE_INDEX)
            if context.document_ids is not None:  # nothing from the next document (module docstring)
                other_document = self.shift(context.document_ids, k, fill=0) != context.document_ids
                future_ids = future_ids.masked_fill(other_document, 0)
                future_labels = future_labels.masked_fill(other_document, IGNORE_INDEX)
            hidden = depth(hidden, model.embed(future_ids), context)
            normed = depth.final_norm(hidden)
            if fused_loss:
                losses.append(model.head_loss(normed, future_labels, normed=True))
            else:
                losses.append(language_model_loss(model.head_logits(normed, normed=True), future_labels))
        return losses
