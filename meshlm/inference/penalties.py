"""Penalties on repeated tokens: the logits of tokens already seen, lowered before a token is drawn.

Small models, and greedy decoding of any model, fall into loops: once a phrase repeats, repeating
it again is the likeliest continuation. Three penalties, as inference servers offer them, push
the logits z of tokens already seen down before the next token is chosen (greedy or sampled):

    repetition   z_i -> z_i / r  if z_i > 0,  z_i * r  otherwise,   for every token i in the prompt
                 or generated so far (Keskar et al. 2019, "CTRL", §4.1; transformers' and vLLM's
                 ``repetition_penalty``, r > 1 discourages)
    frequency    z_i -> z_i - f * c_i       c_i: how often token i was generated so far
    presence     z_i -> z_i - p * [c_i > 0]                    (OpenAI's API, both in [-2, 2])

in that order (vLLM's). Frequency and presence count the generated tokens only, as OpenAI and
vLLM define them; the repetition penalty also looks at the prompt. ``TokenPenalties`` keeps, per
sequence of a batch, the counts [batch, vocab] of generated tokens and which tokens the prompt
holds, and follows the batch as rows finish (``select``). It is built only when a penalty is on
(``SamplingConfig.penalized``): plain decoding keeps no counts.
"""

from __future__ import annotations

import torch

from meshlm.inference.sampling import SamplingConfig


class TokenPenalties:
    """The counts behind ``sampling``'s penalties for a batch of ``prompts`` (module docstring)."""

    def __init__(self, sampling: SamplingConfig, prompts: list[list[int]], vocab_size: int, device: torch.device):
        self.sampling = sampling
        self.generated_counts = torch.zeros(len(prompts), vocab_size, dtype=torch.float32, device=device)
        """[batch, vocab]: how often each token was generated so far (float: it scales logits)."""
        self.in_prompt = None
        """[batch, vocab] bool: the tokens of each prompt (kept only for the repetition penalty)."""
        if sampling.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(len(prompts), vocab_size, dtype=torch.bool, device=device)
            for row, prompt in enumerate(prompts):
                self.in_prompt[row, torch.tensor(prompt, device=device)] = True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [batch, vocab] penalized (a new tensor, fp32)."""
        logits = logits.float()
        config, counts = self.sampling, self.generated_counts
        if config.repetition_penalty != 1.0:
            seen = self.in_prompt | (counts > 0)
            penalized = torch.where(logits > 0, logits / config.repetition_penalty, logits * config.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        if config.frequency_penalty:
            logits = logits - config.frequency_penalty * counts
        if config.presence_penalty:
            logits = logits - config.presence_penalty * (counts > 0).float()
        return logits

    def add(self, tokens: torch.Tensor) -> None:
        """Count one new token per row, ``tokens`` [batch]."""
        self.generated_counts[torch.arange(len(tokens), device=tokens.device), tokens] += 1

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the batch (finished sequences dropped)."""
        self.generated_counts = self.generated_counts[rows]
        if self.in_prompt is not None:
            self.in_prompt = self.in_prompt[rows]


__all__ = ["TokenPenalties"]
