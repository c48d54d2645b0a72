"""Activation recomputation: trade a second forward for the memory of saved activations.

Backward needs tensors saved by the forward (a matmul's input, a softmax's output, ...). For a
transformer layer in 2-byte precision without parallelism these add up to about
``s*b*h*(34 + 5*a*s/h)`` bytes (Korthikanti et al. 2022, eq. 1; s sequence, b batch, h hidden,
a heads). Recomputation drops some of them and reruns the forward piece that made them when
backward reaches it (``torch.utils.checkpoint``, non-reentrant, RNG state preserved):

- ``selective`` (Korthikanti et al. 2022, §5): only the attention core -- scores, softmax and the
  weighted sum of values. That is the ``5*a*s/h`` term, quadratic in s, which dominates long
  sequences, while the core costs few flops to redo relative to the layer. Only q, k and v are
  kept. With a fused (flash) attention kernel the scores are never stored anyway, and the saving
  shrinks to the kernel's own output and log-sum-exp.
- ``full``: the whole norm + mixer of every ``every``-th block. Only the block input is kept
  (``2*s*b*h`` bytes), the block's forward runs twice. Works for every block kind (attention,
  MLP, Mamba-2, MoE); MoE auxiliary losses come from the first run, so they are counted once.

Gradients are the same as without recomputation: the backward graph is the one recorded by the
first forward; only the values it reads are produced again, by the same operations.
"""

from __future__ import annotations

from torch import nn

from meshlm.config import RECOMPUTE
from meshlm.errors import ConfigError
from meshlm.models.attention import SelfAttention
from meshlm.models.block import Block


def apply_recompute(model: nn.Module, mode: str, every: int = 1) -> None:
    """Switch recomputation on the model's blocks: 'none', 'selective' or 'full'.

    Blocks are counted in module order (the main stack, then MTP depths); with 'full', blocks
    0, every, 2*every, ... recompute. Calling it again replaces the previous setting.
    """
    if mode not in RECOMPUTE:
        raise ConfigError(f"train.recompute={mode!r} is not one of {', '.join(RECOMPUTE)}.")
    if every < 1:
        raise ConfigError(f"train.recompute_every={every} must be a positive integer.")
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    for index, block in enumerate(blocks):
        block.recompute = mode == "full" and index % every == 0
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.recompute_core = mode == "selective"
