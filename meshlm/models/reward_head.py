"""The reward head: one score per attribute, read at the last token of a sequence.

A reward model is a language model whose next-token head is replaced by a small linear map
(Nemotron-4 340B-Reward, NVIDIA 2024; the reward models of InstructGPT, Ouyang et al. 2022):

    h        = FinalNorm(blocks(Embed(tokens)))          [batch, seq, hidden]
    r_b      = W h[b, last_b]                            [batch, attributes]   W: [attributes, hidden]

where ``last_b`` is the position of row b's last real token (the end-of-turn marker of the
reply being judged; rows are right-padded, and causal attention keeps the padding from changing
any earlier position). With one attribute (the default ``model.reward_attributes=[reward]``) r is
the scalar of a Bradley-Terry preference model; with several it is a vector of attribute scores
such as HelpSteer's helpfulness, correctness, coherence, complexity and verbosity (Wang et al.
2024, "HelpSteer2"), regressed on human ratings. The LM head is dropped (``model.head=reward``):
a reward model started from an SFT checkpoint keeps its backbone and gets a fresh ``reward_head``
(``meshlm/training/initial_weights.py``).

**Tensor parallelism.** W is tiny (attributes x hidden), so it is replicated rather than split:
the normed hidden state, replicated over the TP group after the final norm (under sequence
parallelism each rank holds a slice of the sequence, so it is first gathered with ``gather_along``,
whose backward keeps each rank's own slice of the gradient, no reduction), goes through the same W
on every rank. Each rank then holds the whole gradient of W and of the hidden state: W's gradient
needs no TP reduction (it is not a partial gradient), and under SP the final norm's gradient is
this rank's tokens' share, summed over TP like every SP norm's (``mark_partial_grad``). The
training code does that gather (``meshlm/training/preference.py``); this module is single-device.
"""

from __future__ import annotations

import torch
from torch import nn


def build_reward_head(hidden_size: int, num_attributes: int) -> nn.Linear:
    """The head W: hidden -> attributes, no bias (a bias cancels out of every pairwise loss)."""
    return nn.Linear(hidden_size, num_attributes, bias=False)


def last_token_rewards(head: nn.Linear, normed_hidden: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """fp32 scores [batch, attributes]: ``head`` applied to ``normed_hidden`` [batch, seq, hidden]
    (after the final norm, the whole sequence) at each row's ``last_index`` [batch]."""
    rows = torch.arange(normed_hidden.shape[0], device=normed_hidden.device)
    return head(normed_hidden[rows, last_index.to(normed_hidden.device)]).float()


__all__ = ["build_reward_head", "last_token_rewards"]
