"""Autoregressive generation with a KV cache (attention) and a recurrent-state cache (Mamba-2).

Generating n tokens by re-running the model on the growing sequence costs O(n) full forwards.
With a cache, one *prefill* forward runs the whole prompt and leaves behind each block's
state -- an attention block's keys and values of every token, a Mamba-2 block's conv window
and SSM state (Dao & Gu 2024, "Transformers are SSMs", §7: the SSD layer run as a recurrence)
-- and every later *decode* step feeds a single new token, which attends to the cached keys or
advances the recurrence by one step. The tokens are the same as without the cache; only the
work per step shrinks from the whole sequence to one token.

Prompts of different lengths share one batch by **left padding**: each row is padded on the
left to the longest prompt, so all rows end at the same column and the next token of every
row is predicted from the last column. A ``token_mask`` (False on padding) travels with the
batch: attention never attends to a padded key, Mamba zeroes padded positions so they leave
its state untouched, and positions count real tokens only, so every row produces exactly
the tokens it would produce alone. A row that emits ``eos_token_id`` is finished and dropped
from the batch (and from the cache, with ``InferenceCache.select``).
"""

from __future__ import annotations

import torch

from meshlm.errors import ConfigError
from meshlm.inference.sampling import SamplingConfig, sample_next
from meshlm.models.cache import InferenceCache


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Raise ConfigError unless every prompt is a non-empty list of ids in [0, vocab_size)."""
    if not prompts:
        raise ConfigError("no prompts given; pass at least one prompt.")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {index} is empty; every prompt needs at least one token.")
        bad = [token for token in prompt if not 0 <= token < vocab_size]
        if bad:
            raise ConfigError(f"prompt {index} holds token id {bad[0]}, outside the model's vocabulary "
                              f"[0, {vocab_size}); check the tokenizer matches the model.")


def left_pad(prompts: list[list[int]], pad_token_id: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [b, longest] padded on the left, and the mask of real tokens (None if no padding)."""
    longest = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)
    token_mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        input_ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        token_mask[row, longest - len(prompt):] = True
    return input_ids.to(device), (None if bool(token_mask.all()) else token_mask.to(device))


def restrict_vocab(logits: torch.Tensor, valid_vocab_size: int | None) -> torch.Tensor:
    """Mask logits beyond ``valid_vocab_size`` (rows of a vocabulary padded for efficiency)."""
    if valid_vocab_size is None or valid_vocab_size >= logits.shape[-1]:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= valid_vocab_size,
                              float("-inf"))


def generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
             eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
             valid_vocab_size: int | None = None) -> list[list[int]]:
    """The new tokens of each prompt: at most ``max_new_tokens``, ending at eos if one is drawn.

    ``eos_token_id`` may be one id or several (Hugging Face configs list several end tokens).
    ``valid_vocab_size`` limits sampling to the first ids of a padded vocabulary. The eos token,
    when drawn, is included as the last token of its row.
    """
    vocab_size = model.config.vocab_size
    check_prompts(prompts, vocab_size)
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    if valid_vocab_size is not None and not 0 < valid_vocab_size <= vocab_size:
        raise ConfigError(f"valid_vocab_size={valid_vocab_size} must be in [1, {vocab_size}] "
                          "(the model's vocab_size).")
    new_tokens: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return new_tokens
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            _decode(model, prompts, max_new_tokens, sampling, eos_token_id, pad_token_id,
                    valid_vocab_size, new_tokens)
    finally:
        model.train(was_training)
    return new_tokens


def _decode(model, prompts, max_new_tokens, sampling, eos_token_id, pad_token_id,
            valid_vocab_size, new_tokens: list[list[int]]) -> None:
    """Prefill the padded batch, then decode one token per step, appending into ``new_tokens``."""
    device = next(model.parameters()).device
    generator = sampling.make_generator(device)
    input_ids, token_mask = left_pad(prompts, pad_token_id, device)
    cache = InferenceCache(max_tokens=input_ids.shape[1] + max_new_tokens)  # KV buffers allocated once
    logits = model(input_ids, token_mask=token_mask, cache=cache).logits[:, -1]
    rows = list(range(len(prompts)))  # the prompt each batch row belongs to
    for step in range(max_new_tokens):
        next_ids = sample_next(restrict_vocab(logits, valid_vocab_size), sampling, generator)
        for row, token in zip(rows, next_ids.tolist()):
            new_tokens[row].append(token)
        if eos_token_id is not None:
            eos_ids = torch.tensor(eos_token_id, device=device).reshape(-1)
            unfinished = (~torch.isin(next_ids, eos_ids)).nonzero().squeeze(-1)
            if len(unfinished) < len(rows):
                rows = [rows[i] for i in unfinished.tolist()]
                next_ids = next_ids[unfinished]
                cache.select(unfinished)
        if not rows or step == max_new_tokens - 1:
            return
        new_column_mask = torch.ones(len(rows), 1, dtype=torch.bool, device=device)
        logits = model(next_ids[:, None], token_mask=new_column_mask, cache=cache).logits[:, -1]
