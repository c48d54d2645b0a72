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

A long prompt can be prefilled ``prefill_chunk`` tokens per forward (``prefill.py``), which
bounds the memory of the prefill without changing the tokens; only the last position's logits
are ever computed. With ``speculative="mtp"`` the model's multi-token-prediction depths draft
tokens that one forward verifies (``speculative.py``): the same greedy tokens, fewer forwards.
Either way a ``GenerationStats`` passed in collects speed and cache size (``stats.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlm.errors import ConfigError
from meshlm.inference.constrained.token_constraint import DecodingConstraint
from meshlm.inference.decode_step import DecodeStep
from meshlm.inference.penalties import TokenPenalties
from meshlm.inference.prefill import hidden_states, prefill
from meshlm.inference.sampling import SamplingConfig, restrict_vocab, sample_next
from meshlm.inference.speculative import check_speculative, speculative_generate
from meshlm.inference.stats import GenerationStats
from meshlm.models.cache import InferenceCache
from meshlm.models.position_embedding import check_positions_fit


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


def check_rope_factors_stay(config, longest: int, new_tokens: int, prefill_chunk: int | None,
                            speculative: bool = False) -> None:
    """Refuse a generation over which LongRoPE would change factors where the cache cannot follow
    (``models/rope.py``).

    A forward rotates with the short factors while its largest position stays below the original
    context L and with the long ones, every position anew, from there on. Plain decoding meets that
    as transformers does, by running the whole sequence again when it first passes L
    (``longrope_crossing``); speculative decoding does not, and a chunked prefill of a prompt past L
    would rotate its first chunks with the short factors."""
    if config.rope_scaling != "longrope":
        return
    original = config.rope_original_max_positions
    furthest = longest + new_tokens - 1  # the longest sequence a forward of this generation rotates
    if speculative and longest <= original < furthest:
        raise ConfigError(f"a prompt of {longest} tokens and {new_tokens - 1} tokens more would take this model's "
                          f"LongRoPE (model.rope_scaling=longrope) past its original context of {original} tokens, "
                          "where every cached key is rotated anew with its long factors, which speculative "
                          f"decoding does not do; keep the prompt plus the new tokens within {original + 1}, start "
                          f"from a prompt longer than {original}, or decode without --speculative.")
    if prefill_chunk is not None and prefill_chunk <= original < longest:
        raise ConfigError(f"prefill_chunk={prefill_chunk}: the first chunk of this {longest}-token prompt would "
                          f"rotate with LongRoPE's short factors and the prompt as a whole with its long ones (past "
                          f"{original} tokens); prefill in one piece or in chunks longer than {original}.")


def longrope_crossing(config, length: int) -> bool:
    """Whether a forward over sequences of at most ``length`` tokens is LongRoPE's first past the
    original context (the one before it, a token shorter, rotated with the short factors)."""
    return config.rope_scaling == "longrope" and length - 1 <= config.rope_original_max_positions < length


def generate(model, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
             eos_token_id: int | list[int] | None = None, pad_token_id: int = 0,
             valid_vocab_size: int | None = None, prefill_chunk: int | None = None,
             speculative: str | None = None, draft_tokens: int | None = None,
             stats: GenerationStats | None = None, compile: bool = False,
             on_token: Callable[[int, int], bool] | None = None,
             constraints: list[DecodingConstraint | None] | None = None) -> list[list[int]]:
    """The new tokens of each prompt: at most ``max_new_tokens``, ending at eos if one is drawn.

    ``eos_token_id`` may be one id or several (Hugging Face configs list several end tokens).
    ``valid_vocab_size`` limits sampling to the first ids of a padded vocabulary. The eos token,
    when drawn, is included as the last token of its row. ``prefill_chunk``: run the prompts
    this many tokens per forward (None: all at once). ``speculative="mtp"``: draft with the
    model's MTP depths and verify (greedy or sampled; prompts decoded one at a time), ``draft_tokens``
    a step (default: one per depth). ``stats``, if given, is added to. ``compile``: decode with
    the compiled step (``decode_step.py``; plain decoding only), whose compile time ``stats`` keeps
    apart from the decode time. ``on_token(prompt index, token)`` is called for each new token as
    it is drawn (plain decoding only: a server streams with it); returning True ends that prompt
    there, the token kept, as an eos would (a stop string found in the text so far). ``constraints``:
    per prompt, None or the grammar its reply is held to (``constrained/token_constraint.py``; plain
    decoding only): only the tokens it allows are drawn, and the reply ends where it allows none.
    """
    vocab_size = model.config.vocab_size
    check_prompts(prompts, vocab_size)
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    if valid_vocab_size is not None and not 0 < valid_vocab_size <= vocab_size:
        raise ConfigError(f"valid_vocab_size={valid_vocab_size} must be in [1, {vocab_size}] "
                          "(the model's vocab_size).")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or prefill_chunk < 1):
        raise ConfigError(f"prefill_chunk={prefill_chunk!r} must be a number of tokens >= 1, or None to "
                          "prefill each prompt in one forward.")
    longest = max((len(prompt) for prompt in prompts), default=0)
    check_positions_fit(model.config, longest + max_new_tokens,
                        f"a prompt of {longest} tokens and max_new_tokens={max_new_tokens}",
                        "shorten the prompt or ask for fewer new tokens")
    drafts = (draft_tokens or model.config.mtp_depth) if speculative is not None else 0
    check_rope_factors_stay(model.config, longest, max_new_tokens + drafts, prefill_chunk, speculative is not None)
    if speculative is not None and sampling.penalized:
        raise ConfigError("repetition, presence and frequency penalties apply to plain decoding, not speculative "
                          "decoding; drop the penalties or --speculative.")
    if constraints is not None and len(constraints) != len(prompts):
        raise ConfigError(f"constraints must hold one entry (or None) per prompt: {len(constraints)} for "
                          f"{len(prompts)} prompts.")
    if speculative is not None and constraints is not None:
        raise ConfigError("constrained decoding (a JSON schema) applies to plain decoding, not speculative "
                          "decoding; drop the constraint or --speculative.")
    if speculative is not None and on_token is not None:
        raise ConfigError("streaming each token (on_token) applies to plain decoding, not speculative decoding.")
    if speculative is not None and compile:
        raise ConfigError("compiling the decode step applies to plain decoding, not speculative decoding; "
                          "drop --compile or --speculative.")
    if speculative is not None:
        check_speculative(model, speculative, sampling, draft_tokens)
    elif draft_tokens is not None:
        raise ConfigError(f"draft_tokens={draft_tokens} sets the drafts of speculative decoding; add "
                          "--speculative mtp (speculative='mtp'), or drop --draft-tokens.")
    new_tokens: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return new_tokens
    stats = GenerationStats() if stats is None else stats
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            if speculative is not None:
                for row, prompt in enumerate(prompts):
                    new_tokens[row] = speculative_generate(model, prompt, max_new_tokens, eos_token_id,
                                                           valid_vocab_size, prefill_chunk, stats, draft_tokens,
                                                           sampling)
            else:
                _decode(model, prompts, max_new_tokens, sampling, eos_token_id, pad_token_id,
                        valid_vocab_size, prefill_chunk, stats, new_tokens, compile, on_token, constraints)
    finally:
        model.train(was_training)
    return new_tokens


def held_to(logits: torch.Tensor, constraints: list[DecodingConstraint | None]) -> torch.Tensor:
    """``logits`` [b, vocab] with each row's tokens its constraint refuses at -inf (rows without one as they are)."""
    if all(constraint is None for constraint in constraints):
        return logits
    return torch.stack([row if constraint is None else constraint.mask_logits(row)
                        for row, constraint in zip(logits, constraints)])


def _decode(model, prompts, max_new_tokens, sampling, eos_token_id, pad_token_id, valid_vocab_size,
            prefill_chunk, stats: GenerationStats, new_tokens: list[list[int]], compile: bool = False,
            on_token: Callable[[int, int], bool] | None = None,
            constraints: list[DecodingConstraint | None] | None = None) -> None:
    """Prefill the padded batch, then decode one token per step, appending into ``new_tokens``
    (with ``compile``, by the compiled ``DecodeStep`` where the model and cache allow it)."""
    device = next(model.parameters()).device
    generator = sampling.make_generator(device)
    input_ids, token_mask = left_pad(prompts, pad_token_id, device)
    cache = InferenceCache(max_tokens=input_ids.shape[1] + max_new_tokens)  # KV buffers allocated once
    with stats.timing("prefill", device):
        logits = model.head_logits(prefill(model, input_ids, token_mask, cache, prefill_chunk))[:, -1]
    stats.prefill_tokens += sum(len(prompt) for prompt in prompts)
    stats.saw_cache_bytes(cache.nbytes)
    eos_ids = None if eos_token_id is None else torch.tensor(eos_token_id, device=device).reshape(-1)
    rows = list(range(len(prompts)))  # the prompt each batch row belongs to
    compiled_step = DecodeStep(model, compile=True) if compile else None
    penalties = TokenPenalties(sampling, prompts, logits.shape[-1], device) if sampling.penalized else None
    with stats.timing("decode", device):
        for step in range(max_new_tokens):
            logits = restrict_vocab(logits, valid_vocab_size)
            if constraints is not None:
                logits = held_to(logits, [constraints[row] for row in rows])
            next_ids = sample_next(logits if penalties is None else penalties.apply(logits), sampling, generator)
            if penalties is not None:
                penalties.add(next_ids)
            tokens = next_ids.tolist()
            for row, token in zip(rows, tokens):
                new_tokens[row].append(token)
            stats.decode_tokens += len(rows)
            going = None if eos_ids is None else ~torch.isin(next_ids, eos_ids)
            if constraints is not None:
                for row, token in zip(rows, tokens):
                    if constraints[row] is not None:
                        constraints[row].advance(token)
                open_ended = torch.tensor([constraints[row] is None or not constraints[row].finished for row in rows],
                                          device=next_ids.device)
                going = open_ended if going is None else going & open_ended
            if on_token is not None:  # every row's callback, eos or not: each sees all of its tokens
                called = torch.tensor([not on_token(row, token) for row, token in zip(rows, tokens)],
                                      device=next_ids.device)
                going = called if going is None else going & called
            if going is not None and not bool(going.all()):
                unfinished = going.nonzero().squeeze(-1)
                rows = [rows[i] for i in unfinished.tolist()]
                next_ids = next_ids[unfinished]
                cache.select(unfinished)
                if penalties is not None:
                    penalties.select(unfinished)
            if not rows or step == max_new_tokens - 1:
                break
            if longrope_crossing(model.config, max(len(prompts[row]) + len(new_tokens[row]) for row in rows)):
                # LongRoPE's first forward past the original context rotates every position anew: run
                # the whole sequences again into a fresh cache, as transformers does
                sequences = [prompts[row] + new_tokens[row] for row in rows]
                input_ids, token_mask = left_pad(sequences, pad_token_id, device)
                cache = InferenceCache(max_tokens=input_ids.shape[1] + max_new_tokens - step - 1)
                logits = model.head_logits(prefill(model, input_ids, token_mask, cache))[:, -1]
                stats.prefill_tokens += sum(len(sequence) for sequence in sequences)
                continue
            # the new column holds no padding (no mask): nothing in a step looks at all cached tokens
            if compiled_step is not None and compiled_step.supports(cache):
                logits = compiled_step(next_ids, cache)
            else:
                logits = model.head_logits(hidden_states(model, next_ids[:, None], cache))[:, -1]
    if compiled_step is not None:  # the first compiled step paid for compiling: count that apart
        stats.compile_seconds += compiled_step.compile_seconds
        stats.decode_seconds -= compiled_step.compile_seconds
    stats.saw_cache_bytes(cache.nbytes)
