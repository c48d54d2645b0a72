"""Calibration under context parallelism: each rank scores its chunks of every sequence.

``meshlm prune --cp N`` splits each calibration sequence over N ranks as training does (two
chunks per rank, paired for causal balance: ``meshlm/parallel/context/``), with ring attention
and the Mamba state hand-off between them, so long calibration sequences need not fit on one
rank. Minitron's scores are per-sample means over the sequence, then an L2 norm over samples, so
what the ranks hold must be combined *before* squaring (``SequenceShards``):

- a unit's per-sample value is the mean over the tokens of its magnitude; every rank holds the
  mean over its own seq/N tokens, so the whole sequence's mean is the sum over the CP group
  divided by N (``average``);
- the cosine distances of the blocks and the experts' routing counts are sums over tokens: summed
  over the group, and so is the token count they are divided by (``sum_``);
- the loss (for the depth metric) is each rank's mean over its labelled tokens: weighted by their
  count, summed, and divided by the whole sequences' count (``mean_loss``).
"""

from __future__ import annotations

import torch

from meshlm.models.losses import IGNORE_INDEX
from meshlm.parallel.collectives import all_reduce_


class SequenceShards:
    """This rank's share of each calibration sequence, over ``context.cp_group``."""

    def __init__(self, context):
        self.group, self.size = context.cp_group, context.cp_size

    def _summed(self, tensor: torch.Tensor) -> torch.Tensor:
        on_device = tensor.to(self.group.device)
        all_reduce_(on_device, self.group)
        return on_device.to(tensor.device)

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """Per-sample means over this rank's tokens -> over the whole sequences' (equal shares)."""
        return self._summed(value.float()) / self.size

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum a CPU tensor in place over the group."""
        tensor.copy_(self._summed(tensor).cpu())

    def mean_loss(self, local_mean: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The whole sequences' mean loss from this rank's mean over its labelled ``labels``."""
        count = (labels != IGNORE_INDEX).sum().double()
        totals = self._summed(torch.stack([local_mean.double() * count, count]).cpu())
        return (totals[0] / totals[1].clamp(min=1)).float()


__all__ = ["SequenceShards"]
