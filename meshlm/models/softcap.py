"""Soft-capping: scores and logits bounded smoothly by a tanh (Gemma 2).

    softcap(z) = cap * tanh(z / cap)          d softcap / dz = 1 - (softcap(z) / cap)^2

Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size", §2)
caps the attention scores at 50 (``model.attention_softcap``) and the output logits at 30
(``model.final_logit_softcap``), after Grok-1 and Bello et al. 2016. Near zero the map is the
identity (slope 1); it bends smoothly towards +-cap, so no score or logit leaves (-cap, cap) and
none can grow without bound during training; it is increasing, so a greedy argmax is unchanged.
Its slope is a function of its output, so a backward that kept the capped values needs nothing else
(``soft_cap_slope``, or ``soft_cap_slope_`` in the capped values' own storage: the explicit attention
core and the fused cross-entropy, meshlm/models/losses.py, use it on each chunk).

**Attention with capped scores.** The fused attention kernels take a mask but no function of the
scores, so a block with ``model.attention_softcap`` runs the explicit, query-chunked attention core
of ``meshlm/models/explicit_attention.py`` with the cap; ring attention's blocks take the cap in
their reference path (``meshlm/models/block_attention.py``).
"""

from __future__ import annotations

import torch


def soft_cap(values: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(values / cap), in the dtype of ``values``."""
    return torch.tanh(values / cap) * cap


def soft_cap_slope(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """The derivative of ``soft_cap`` at the point whose capped value is ``capped``: 1 - (capped / cap)^2."""
    return 1 - (capped / cap).square()


def soft_cap_slope_(capped: torch.Tensor, cap: float) -> torch.Tensor:
    """``soft_cap_slope`` computed in the storage of ``capped`` (a buffer no longer needed)."""
    return capped.div_(cap).square_().neg_().add_(1)


__all__ = ["soft_cap", "soft_cap_slope", "soft_cap_slope_"]
