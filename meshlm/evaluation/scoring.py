"""Log-probabilities of tokens given the tokens before them: what every evaluation adds up.

A causal language model gives, at each position t, a distribution over the next token; the
log-probability of the token that actually follows,

    log p(x_{t+1} | x_1 .. x_t) = logits_t[x_{t+1}] - logsumexp(logits_t),

is all that perplexity (summed over a text) and multiple-choice scoring (summed over an answer)
need. ``label_logprobs`` computes it for a batch [b, s] of inputs and labels, the head applied a
chunk of positions at a time so that [b, s, vocab] logits are never held at once (the same
chunking as the training loss, ``meshlm/models/losses.py``). Logits are fp32 whatever the
model's dtype; the sums are taken in fp64.

``score_continuations`` is the log-likelihood request of lm-evaluation-harness: given token
lists (context, continuation), the summed log-probability of the continuation after the
context, and whether greedy decoding would have produced it. Requests are batched longest
first (padding on the right, which a causal model never looks at: a position only attends
to, or carries a state from, the positions before it), and, given a group, split over its
ranks, each request scored by one rank and the results summed over the group. The batches
depend only on the set of requests, not on their order, so a task scored by ``meshlm eval
--task`` and by lm-evaluation-harness goes through the same forwards.

``encode_pair`` tokenizes a (context, continuation) pair as lm-evaluation-harness does for a
causal model: the whole string is encoded and the context's tokens split off, so a word is
tokenized as it would be in running text; trailing spaces of the context move to the
continuation; an empty context becomes the tokenizer's end-of-text (or begin) token.
"""

from __future__ import annotations

import numpy as np
import torch

from meshlm.errors import ConfigError
from meshlm.models.context import SequenceContext
from meshlm.models.losses import IGNORE_INDEX, default_tokens_per_chunk
from meshlm.parallel.plain_collectives import all_reduce_

TARGET_DELIMITER = " "
"""Between a question and each of its answers, as lm-evaluation-harness's default ``target_delimiter``."""


def final_hidden(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The last block's output [b, s, hidden] (before the final norm and the head)."""
    context = SequenceContext.for_tokens(input_ids)
    return model.run_blocks(model.embed(input_ids, context), context)


@torch.no_grad()
def label_logprobs(model, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For inputs and labels [b, s]: log p(labels[b, t] | input_ids[b, :t + 1]) [b, s] in fp32 (0
    where the label is IGNORE_INDEX), and whether each label is the model's most likely token."""
    hidden = final_hidden(model, input_ids)
    rows, columns = labels.shape
    flat_hidden, flat_labels = hidden.reshape(1, rows * columns, -1), labels.reshape(-1)
    logprobs = torch.zeros(rows * columns, dtype=torch.float32, device=labels.device)
    greedy = torch.zeros(rows * columns, dtype=torch.bool, device=labels.device)
    chunk = default_tokens_per_chunk(model.config.vocab_size, labels.device.type)
    for start in range(0, rows * columns, chunk):
        positions = slice(start, start + chunk)
        logits = model.head_logits(flat_hidden[:, positions])[0]
        targets = flat_labels[positions]
        picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[:, None])[:, 0]
        logprobs[positions] = torch.where(targets != IGNORE_INDEX, picked, 0.0)
        greedy[positions] = logits.argmax(-1) == targets
    return logprobs.view(rows, columns), greedy.view(rows, columns)


def encode_pair(tokenizer, context: str, continuation: str, prefix_token_id: int | None) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens), split as lm-evaluation-harness splits them (module docstring)."""
    if context == "":
        continuation_ids = tokenizer.encode(continuation, add_special_tokens=False)
        if prefix_token_id is None:
            raise ConfigError(f"{tokenizer.source}: an empty context is scored after the tokenizer's end-of-text "
                              "or begin token, and this tokenizer names neither; give every question a context.")
        if continuation_ids and continuation_ids[0] == prefix_token_id:
            return continuation_ids[:1], continuation_ids[1:]
        return [prefix_token_id], continuation_ids
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def prefix_token(tokenizer) -> int | None:
    """The token an empty context stands for: end-of-text, else begin-of-text."""
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id


def request_window(context_ids: list[int], continuation_ids: list[int], max_length: int) -> list[int]:
    """The last ``max_length + 1`` tokens of context + continuation (inputs are all but the last)."""
    if len(continuation_ids) > max_length:
        raise ConfigError(f"an answer of {len(continuation_ids)} tokens does not fit in a window of "
                          f"--seq-len {max_length} tokens; raise --seq-len (at most what the model was trained on).")
    return (context_ids + continuation_ids)[-(max_length + 1):]


def score_continuations(model, requests: list[tuple[list[int], list[int]]], max_length: int, batch_size: int,
                        group=None, rank: int = 0, world: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(summed log-probability [n] fp64, greedy [n] bool) of each continuation after its context.

    With a ``group`` of ``world`` ranks this rank scores requests rank, rank + world, ... and the
    results are summed over the group, so every rank returns all of them."""
    windows = [request_window(context, continuation, max_length) for context, continuation in requests]
    device = next(model.parameters()).device
    results = torch.zeros(2, len(requests), dtype=torch.float64, device=device)  # log-likelihood, greedy
    mine = sorted(range(rank, len(requests), world), key=lambda index: (-len(windows[index]), windows[index]))
    for start in range(0, len(mine), batch_size):
        batch = [index for index in mine[start:start + batch_size] if requests[index][1]]
        if not batch:
            continue
        longest = max(len(windows[index]) - 1 for index in batch)
        input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
        labels = torch.full((len(batch), longest), IGNORE_INDEX, dtype=torch.long)
        for row, index in enumerate(batch):
            window, answer_length = windows[index], len(requests[index][1])
            input_ids[row, :len(window) - 1] = torch.tensor(window[:-1])
            labels[row, len(window) - 1 - answer_length:len(window) - 1] = torch.tensor(window[-answer_length:])
        logprobs, greedy = label_logprobs(model, input_ids.to(device), labels.to(device))
        scored = labels.to(device) != IGNORE_INDEX
        batch_index = torch.tensor(batch, device=device)
        results[0, batch_index] = logprobs.double().sum(dim=1)
        results[1, batch_index] = (greedy | ~scored).all(dim=1).double()
    for index in range(rank, len(requests), world):
        if not requests[index][1]:
            results[1, index] = 1.0  # an empty continuation: probability 1, trivially greedy
    all_reduce_(results, group)
    results = results.cpu().numpy()
    return results[0], results[1] > 0.5


__all__ = ["TARGET_DELIMITER", "encode_pair", "final_hidden", "label_logprobs", "prefix_token", "request_window",
           "score_continuations"]
