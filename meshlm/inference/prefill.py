"""The cached forward of generation, and the prompt run through it in chunks (chunked prefill).

Generation needs logits only where a token is drawn, so its forward stops at the last block
(``hidden_states``) and the caller applies the head (``model.head_logits``) to the positions it
needs: the last one of a prompt, or the few of a speculative verification. A whole-prompt
forward that returned logits would hold [batch, prompt, vocab] fp32 numbers for nothing -- at
a 128k prompt and a 128k vocabulary, 64 GiB per sequence.

**Chunked prefill.** Even without logits, one forward over a long prompt holds activations
[batch, prompt, width] in every layer, and attention's scores for all query/key pairs. Running
the prompt N columns at a time through the cache bounds that to N columns (attention reads the
cached keys of the earlier chunks, a Mamba block continues from its conv window and SSM state),
while the result is the same as one forward, up to rounding: this is what the cache does
during decoding anyway, N tokens instead of one per step (vLLM and SGLang call it chunked
prefill). Left padding needs nothing special: padding is always before a row's real tokens,
whichever chunk it falls in, and the cache records each chunk's mask.
"""

from __future__ import annotations

import torch

from meshlm.models.cache import InferenceCache
from meshlm.models.context import SequenceContext


def hidden_states(model, input_ids: torch.Tensor, cache: InferenceCache,
                  token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The last block's output [b, t, hidden] for ``input_ids`` [b, t] after everything ``cache``
    has seen (no final norm, no head); the cache takes in the new tokens."""
    context = SequenceContext.for_tokens(input_ids, token_mask, cache)
    return model.run_blocks(model.embed(input_ids, context), context)


def column_slices(length: int, chunk_size: int | None) -> list[slice]:
    """[0, length) in consecutive pieces of ``chunk_size`` (the last may be shorter; None: one piece)."""
    step = length if chunk_size is None else chunk_size
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]


def prefill(model, input_ids: torch.Tensor, token_mask: torch.Tensor | None, cache: InferenceCache,
            chunk_size: int | None = None, keep_all: bool = False) -> torch.Tensor:
    """Run the prompts ``input_ids`` [b, T] into ``cache``, ``chunk_size`` columns per forward.

    Returns the last block's output at the last position [b, 1, hidden], or with ``keep_all`` at
    every position [b, T, hidden] (what the MTP draft depths of speculative decoding read)."""
    every_position = []
    for columns in column_slices(input_ids.shape[1], chunk_size):
        mask = None if token_mask is None else token_mask[:, columns]
        hidden = hidden_states(model, input_ids[:, columns], cache, mask)
        if keep_all:
            every_position.append(hidden)
    return torch.cat(every_position, dim=1) if keep_all else hidden[:, -1:]
