"""Tensor-parallel MLP: gate/up column-parallel, down row-parallel -- the FFN width is split.

One all-reduce in forward and one in backward per MLP (Shoeybi et al. 2019, §3): the input
enters the parallel region once for gate and up, the activation between them stays local.
"""

from __future__ import annotations

import torch

from meshlm.models.mlp import MLP
from meshlm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, column_parallel_input


class TensorParallelMLP(MLP):
    """``MLP`` over this rank's share of the FFN width; the input is gathered once for gate and up."""

    parallel_context = None

    def forward(self, x: torch.Tensor, context=None) -> torch.Tensor:
        return super().forward(column_parallel_input(x, self.parallel_context), context)


@torch.no_grad()
def parallelize_mlp(mlp: MLP, context) -> None:
    if mlp.gate_proj is not None:
        mlp.gate_proj = ColumnParallelLinear.from_full(mlp.gate_proj, context, gather_input=False)
    mlp.up_proj = ColumnParallelLinear.from_full(mlp.up_proj, context, gather_input=False)
    mlp.down_proj = RowParallelLinear.from_full(mlp.down_proj, context)
    mlp.__class__ = TensorParallelMLP
    mlp.parallel_context = context


__all__ = ["TensorParallelMLP", "parallelize_mlp"]
