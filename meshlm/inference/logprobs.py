"""The log-probabilities of a sequence's tokens under the model, and the likeliest alternatives.

OpenAI's API returns them on request (``logprobs``): for each token of a reply, log p(token | what
precedes it) and the top few tokens the model weighed at that position; with ``echo`` the prompt's
tokens are scored too -- the first has nothing before it -- which is how evaluation harnesses
compute a continuation's log-likelihood through a server (lm-evaluation-harness's
``local-completions``: ``echo``, ``max_tokens`` 0, ``logprobs`` 1).

``sequence_log_probs`` scores a whole token sequence in one cached forward (``prefill``), keeping
every position's last hidden state, then applies the output head a chunk of positions at a time,
so the [positions x vocabulary] logits are never all held (a 4096-token prompt and a 128k
vocabulary would be 2 GiB of them). The numbers are the model's own distribution -- a log-softmax
of the logits over the tokenizer's ids, before a request's temperature, top-k/p or penalties
reshape it for sampling -- as vLLM returns by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshlm.inference.prefill import prefill
from meshlm.inference.sampling import restrict_vocab
from meshlm.models.cache import InferenceCache

POSITIONS_PER_CHUNK = 256
"""Positions whose logits are computed at once."""


@dataclass
class TokenLogProb:
    """One token of a scored sequence."""

    token: int
    logprob: float | None
    """log p(token | the tokens before it); None for a sequence's first token (nothing precedes it)."""
    top: list[tuple[int, float]] = field(default_factory=list)
    """The likeliest tokens at its position, most likely first, with their log-probabilities."""

    def keeping(self, count: int) -> "TokenLogProb":
        """The same token with only its ``count`` likeliest alternatives."""
        return TokenLogProb(self.token, self.logprob, self.top[:count])


def drawn_log_probs(logits: torch.Tensor, tokens: list[int], top: int = 0) -> list[TokenLogProb]:
    """Each row's drawn token scored by that row of ``logits`` [rows, vocabulary] (a decode step's,
    the padded vocabulary's ids already masked out): its log-probability and the ``top`` likeliest
    tokens (``sequence_log_probs`` scores a sequence's positions a chunk of rows at a time with it)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    best = log_probs.topk(top, dim=-1) if top else None
    return [TokenLogProb(token, logprob, [] if best is None else list(zip(best.indices[row].tolist(),
                                                                           best.values[row].tolist())))
            for row, (token, logprob) in enumerate(zip(tokens, chosen))]


def sequence_log_probs(model, ids: list[int], first: int = 0, top: int = 0,
                       valid_vocab_size: int | None = None) -> list[TokenLogProb]:
    """``ids[first:]`` scored: each token's log-probability given ``ids`` before it, and the ``top``
    likeliest tokens there (``valid_vocab_size``: only the first ids of a padded vocabulary count)."""
    scored = [TokenLogProb(ids[0], None)] if first == 0 and ids else []
    start = max(first, 1)  # the first token scored with a distribution: the one at position ``start``
    if start >= len(ids):
        return scored
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            hidden = prefill(model, torch.tensor([ids[:-1]], device=device), None, InferenceCache(), keep_all=True)
            for chunk_start in range(start - 1, len(ids) - 1, POSITIONS_PER_CHUNK):
                positions = slice(chunk_start, min(chunk_start + POSITIONS_PER_CHUNK, len(ids) - 1))
                logits = restrict_vocab(model.head_logits(hidden[:, positions])[0], valid_vocab_size)
                scored += drawn_log_probs(logits, ids[positions.start + 1:positions.stop + 1], top)
    finally:
        model.train(was_training)
    return scored


__all__ = ["POSITIONS_PER_CHUNK", "TokenLogProb", "drawn_log_probs", "sequence_log_probs"]
