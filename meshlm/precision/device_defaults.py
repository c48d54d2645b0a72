"""What precision a run gets on its device when the config does not say: ``precision.dtype: auto``.

A GPU since Ampere does its matmuls in bf16 on tensor cores at about 15x its plain-fp32 rate
(A100 and H100 data sheets), and bf16 has fp32's exponent range, so it needs no loss scaling
(``mixed_precision.py`` keeps fp32 masters): ``auto`` means bf16 on CUDA. A CPU has no such
fast path in most builds (bf16 matmuls often run slower than fp32 there), so ``auto`` means fp32
on CPU. The choice is made once, at start-up, against the device the run resolved
(``meshlm.training.trainer.resolve_device``), and the resolved name is what every later piece
sees and what the run's logs and checkpoints record.
"""

from __future__ import annotations

import dataclasses

import torch


def resolve_dtype(name: str, device: torch.device) -> str:
    """``precision.dtype`` as the run will use it: 'auto' becomes 'bf16' on CUDA, 'fp32' elsewhere."""
    if name != "auto":
        return name
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def resolve_precision(config, device: torch.device):
    """A copy of a ``PrecisionConfig`` with its dtype resolved for ``device`` (the input is not changed)."""
    return dataclasses.replace(config, dtype=resolve_dtype(config.dtype, device))


__all__ = ["resolve_dtype", "resolve_precision"]
