"""Choosing the next token from the model's logits: greedy, temperature, top-k and top-p.

Given fp32 logits z over the vocabulary for each sequence of the batch:

    greedy          next = argmax_i z_i
    temperature T   p = softmax(z / T)            T < 1 sharpens, T > 1 flattens
    top-k           keep the k largest z_i, drop (set to -inf) the rest
    top-p           sort p descending and keep the smallest prefix whose mass reaches p
                    ("nucleus sampling", Holtzman et al. 2020, "The Curious Case of Neural
                    Text Degeneration", §3.1); the most likely token is always kept
    sample          next ~ Categorical(softmax(filtered z / T))

The filters are applied in that order (temperature, then top-k, then top-p on what is left),
as most inference stacks do. Before them, and before greedy decoding's argmax, the decoding loop
may lower the logits of tokens already seen (``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``: ``penalties.py``). Sampling draws from a ``torch.Generator`` seeded from the
config, so the same seed, model and prompts give the same tokens on the same device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.errors import ConfigError


@dataclass
class SamplingConfig:
    """How ``sample_next`` picks a token; validated on construction."""

    greedy: bool = False
    """Always take the most likely token (the other fields except seed are then unused)."""
    temperature: float = 1.0
    """Divide the logits by this before the softmax; must be > 0."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 turns the filter off."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 turns
    the filter off."""
    seed: int = 0
    """Seed of the random generator used for sampling."""
    repetition_penalty: float = 1.0
    """Divide the positive logits (multiply the negative ones) of every token in the prompt or the
    text generated so far by this (Keskar et al. 2019, CTRL; transformers' and vLLM's
    ``repetition_penalty``); must be > 0, 1 turns it off, above 1 discourages repeats."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token generated so far (OpenAI's ``presence_penalty``,
    in [-2, 2]; 0 turns it off)."""
    frequency_penalty: float = 0.0
    """Subtract this times its count from the logit of every token generated so far (OpenAI's
    ``frequency_penalty``, in [-2, 2]; 0 turns it off)."""

    @property
    def penalized(self) -> bool:
        """Whether any penalty on repeated tokens applies (``penalties.TokenPenalties``)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0; use greedy decoding for "
                              "the limit of temperature 0.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r} must be an integer >= 0 (0 turns the filter off).")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1 turns the filter off).")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 turns it off; above 1 "
                              "discourages repeated tokens).")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name}={getattr(self, name)} must be in [-2, 2] (0 turns it off).")

    def make_generator(self, device: torch.device | str) -> torch.Generator | None:
        """A generator seeded from ``seed`` on ``device``, or None for greedy decoding."""
        if self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` [b, vocab] with all but the k largest of each row set to -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kept = logits.topk(k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, kept.indices, kept.values)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` [b, vocab] keeping, per row, the smallest most-likely set with mass >= p.

    A token is kept when the mass of the tokens ranked strictly above it is still below p, so
    the set stops at the first token that brings the mass to p, and the top token always stays.
    """
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_above < p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def restrict_vocab(logits: torch.Tensor, valid_vocab_size: int | None) -> torch.Tensor:
    """Mask logits [..., vocab] beyond ``valid_vocab_size`` (rows of a vocabulary padded for efficiency)."""
    if valid_vocab_size is None or valid_vocab_size >= logits.shape[-1]:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= valid_vocab_size,
                              float("-inf"))


def token_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The distribution [..., vocab] a sampling ``config`` draws from: the softmax of the logits
    scaled by the temperature and filtered by top-k, then top-p (rows of [b, vocab] at a time)."""
    scaled = logits.float() / config.temperature
    shape = scaled.shape
    flat = scaled.reshape(-1, shape[-1])
    return top_p_filter(top_k_filter(flat, config.top_k), config.top_p).softmax(dim=-1).reshape(shape)


def sample_next(logits: torch.Tensor, config: SamplingConfig,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token id [b] for each row of ``logits`` [b, vocab]."""
    if config.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(token_probs(logits, config), num_samples=1, generator=generator).squeeze(-1)
