"""Checks that cached generation computes what the full forward computes, shared by the tests of
layer features that touch the cache or the decode step (sliding windows, soft-capping, learned
positions): greedy tokens against a full forward per step, and the decode step against a cached
forward, over left-padded prompts of different lengths."""

from __future__ import annotations

import torch

from meshlm.inference.decode_step import DecodeStep
from meshlm.inference.generate import generate, left_pad
from meshlm.inference.prefill import prefill
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.cache import InferenceCache

PROMPTS = [[5, 17, 3, 42, 8, 1, 60, 22, 9, 31, 77, 2], [11, 2], [70, 70, 4, 13, 96]]
"""Three prompts of 12, 2 and 5 tokens (ids below 97): a batch of them is left-padded."""
GREEDY = SamplingConfig(greedy=True)


def generate_without_cache(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by a full forward over the whole sequence at every step (the reference)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def assert_cached_generation_equals_the_full_forward(model, new_tokens: int = 12) -> None:
    """``generate`` (cache, decode step) gives the reference's tokens for a left-padded batch, with
    the prompts prefilled 3 tokens at a time, and one prompt at a time."""
    expected = [generate_without_cache(model, prompt, new_tokens) for prompt in PROMPTS]
    assert len(set(expected[0])) > 2  # the check would be weak if the model repeated one token
    assert generate(model, PROMPTS, new_tokens, GREEDY, pad_token_id=3) == expected  # left-padded batch
    assert generate(model, PROMPTS, new_tokens, GREEDY, prefill_chunk=3) == expected  # prefill in chunks of 3
    assert [generate(model, [prompt], new_tokens, GREEDY)[0] for prompt in PROMPTS] == expected


@torch.inference_mode()
def assert_decode_step_equals_the_cached_forward(model, steps: int = 5) -> None:
    """The (eager) ``DecodeStep`` gives a cached forward's logits, step after step, after the same
    left-padded prefill."""
    input_ids, token_mask = left_pad(PROMPTS, 0, torch.device("cpu"))
    caches = [InferenceCache(max_tokens=input_ids.shape[1] + steps + 1) for _ in range(2)]
    for cache in caches:
        prefill(model, input_ids, token_mask, cache)
    step, tokens = DecodeStep(model), torch.tensor([3, 4, 5])
    assert step.supports(caches[0])
    for _ in range(steps):
        logits = step(tokens, caches[0])
        torch.testing.assert_close(logits, model(tokens[:, None], cache=caches[1]).logits[:, -1],
                                   rtol=1e-5, atol=1e-5)
        tokens = logits.argmax(-1)


__all__ = ["GREEDY", "PROMPTS", "assert_cached_generation_equals_the_full_forward",
           "assert_decode_step_equals_the_cached_forward", "generate_without_cache"]
