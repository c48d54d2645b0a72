"""Calibration under pipeline parallelism: the importance forward passed from stage to stage.

``meshlm prune --pp N`` cuts the model into N stages as training does (``rank_chunks``: blocks
balanced by FLOPs, the embedding on the first stage, the final norm and head on the last), so a
model whose weights do not fit on the ranks of one tensor-parallel copy can still be scored.
Calibration only runs forwards, so there is no schedule to speak of: for each batch, stage 0
embeds the tokens and runs its blocks, sends the hidden state [b, s, h] to stage 1, and so on; the
last stage runs the final norm and the head and has the loss. Each stage's hooks
(``importance.ImportanceRecorder``) score the units of its own blocks.

What the stages must combine (``PipelineStages``):

- an embedding channel's per-sample value is the sum of its mean magnitudes at every norm of the
  model, and the norms are spread over the stages, so each batch's per-sample partial values are
  summed over the pipeline group *before* they are squared (``sum_per_sample``);
- the block scores (cosine distances, loss increases) are each filled in by the stage that owns
  the block (the loss by the last stage), zeros elsewhere: summed over the group;
- the head, neuron, Mamba-head and expert sums live on one stage each: gathered as objects and
  merged (``merged``), so that every rank ends with the whole model's scores.

The depth metric "loss" runs one more pipeline pass per block with that block skipped, on every
stage (the stage that owns it passes its input through). Virtual stages (vp > 1) are not used:
calibration is forward-only, so interleaving would only add messages.
"""

from __future__ import annotations

import torch

from meshlm.models.context import SequenceContext
from meshlm.parallel.collectives import all_reduce_
from meshlm.parallel.pipeline.p2p import ACTIVATION, Message, PointToPoint
from meshlm.parallel.plain_collectives import all_gather_objects


class PipelineStages:
    """This rank's stage of a forward-only pipeline over ``context.pp_group``."""

    def __init__(self, context, hidden_dtype: torch.dtype):
        self.context, self.group, self.hidden_dtype = context, context.pp_group, hidden_dtype
        self.rank, self.size = context.pp_rank, context.pp_size
        self.first, self.last = self.rank == 0, self.rank == self.size - 1

    def forward_loss(self, model, input_ids: torch.Tensor, labels: torch.Tensor, skip: int | None = None,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's mean LM loss on the last stage (block ``skip`` replaced by the identity); 0
        on the other stages, which pass the hidden state on."""
        context = SequenceContext.for_tokens(input_ids, position_ids=position_ids)
        shape, dtype = (*input_ids.shape, model.config.hidden_size), self.hidden_dtype  # the embedding's dtype
        links = PointToPoint(self.group, shape, dtype, input_ids.device, num_virtual_stages=self.size)
        if self.first:
            hidden = model.embed(input_ids, context)
        else:
            hidden = links.exchange([], Message(ACTIVATION, 0, self.rank, self.group.ranks[self.rank - 1]))
        for index, block in model.blocks.items():
            if int(index) != skip:
                hidden = block(hidden, context)
        if not self.last:
            links.exchange([(Message(ACTIVATION, 0, self.rank + 1, self.group.ranks[self.rank + 1]),
                             hidden.to(dtype))], None)
            links.wait_sends()
            return torch.zeros((), device=input_ids.device)
        return model.head_loss(hidden, labels).float()

    def sum_per_sample(self, value: torch.Tensor | None, batch_size: int, width: int) -> torch.Tensor:
        """A per-sample partial value [b, width] summed over the stages (zeros where a stage has none)."""
        value = torch.zeros(batch_size, width) if value is None else value.float().cpu()
        on_device = value.to(self.group.device)
        all_reduce_(on_device, self.group)
        return on_device.cpu()

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum a CPU tensor in place over the stages."""
        on_device = tensor.to(self.group.device)
        all_reduce_(on_device, self.group)
        tensor.copy_(on_device.cpu())

    def merged(self, sums: dict[tuple, torch.Tensor]) -> dict[tuple, torch.Tensor]:
        """Every stage's per-block sums in one dict (the embedding channels' are the same on every stage)."""
        merged: dict[tuple, torch.Tensor] = {}
        for stage_sums in all_gather_objects(sums, self.group):
            for key, value in stage_sums.items():
                merged.setdefault(key, value)
        return merged


def stage_blocks(model):
    """(global index, block) of the blocks this rank runs: all of them without a pipeline."""
    blocks = model.blocks
    if hasattr(blocks, "items"):  # StageBlocks: keyed by global index
        return [(int(index), block) for index, block in blocks.items()]
    return list(enumerate(blocks))


__all__ = ["PipelineStages", "stage_blocks"]
