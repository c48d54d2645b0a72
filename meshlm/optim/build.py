"""``optim.optimizer``: the update rule a run steps with, AdamW (``adamw.py``) or Muon (``muon.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlm.optim.adamw import build_adamw
from meshlm.optim.muon import build_muon


def build_optimizer(parameters_by_name: list[tuple[str, torch.nn.Parameter]], config,
                    orthogonalize_many: Callable | None = None) -> torch.optim.Optimizer:
    """The optimizer ``config.optimizer`` names over the (model name, fp32 parameter) pairs.
    ``orthogonalize_many``: how Muon orthogonalizes tensor-parallel shards as whole matrices
    (``meshlm.parallel.tensor.orthogonal_updates.sharded_orthogonalizer``); None in one process."""
    if config.optimizer == "muon":
        return build_muon(parameters_by_name, config, orthogonalize_many)
    return build_adamw(parameters_by_name, config)


__all__ = ["build_optimizer"]
