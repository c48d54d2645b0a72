"""What a block needs to know about its tokens besides their hidden states.

Every mixer has the same signature, ``mixer(hidden, context)``, so that a pattern string can put
any block kind anywhere and parallel wrappers can treat blocks alike. The context carries:

- ``position_ids`` [batch, seq]: global token positions (RoPE). With left-padded prompts they
  count real tokens only; under context parallelism they will be each chunk's global offsets.
- ``token_mask`` [batch, seq] bool or None: False marks padding. Attention never attends to a
  padded key; Mamba zeroes padded positions so they leave its conv and SSM states untouched.
- ``cache``: an ``InferenceCache`` during generation, else None.
- ``moe_losses``: MoE blocks append their auxiliary losses here for the model to collect.
- ``dropout_key``: which draw of the run this forward is (seed, step, global sample indices),
  for the layout-independent dropout masks of ``meshlm/models/dropout.py``; None outside training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshlm.models.cache import InferenceCache
from meshlm.models.dropout import DropoutKey


@dataclass
class SequenceContext:
    position_ids: torch.Tensor
    token_mask: torch.Tensor | None = None
    cache: InferenceCache | None = None
    moe_losses: list = field(default_factory=list)
    dropout_key: DropoutKey | None = None

    @staticmethod
    def for_tokens(input_ids: torch.Tensor, token_mask: torch.Tensor | None = None,
                   cache: InferenceCache | None = None,
                   position_ids: torch.Tensor | None = None,
                   dropout_key: DropoutKey | None = None) -> "SequenceContext":
        """Build the context for a forward over ``input_ids`` [batch, seq].

        Positions default to 0, 1, 2, ... after whatever the cache has already seen, counting
        only real (unmasked) tokens, so a left-padded prompt starts at position 0 like an
        unpadded one.
        """
        batch, seq = input_ids.shape
        cached_positions = None
        if cache is not None:
            cached_positions = cache.append_token_mask(token_mask, batch, seq, input_ids.device)
        if position_ids is None:
            if cache is not None:
                position_ids = cached_positions
            elif token_mask is not None:
                position_ids = (token_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
        return SequenceContext(position_ids=position_ids, token_mask=token_mask, cache=cache, dropout_key=dropout_key)
