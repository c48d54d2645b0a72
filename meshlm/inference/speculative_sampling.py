"""Speculative sampling: keep drafted tokens so that every emitted token has the model's own
sampling distribution (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", §2.3; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling", Algorithm 2).

A draft model proposed d_1..d_K, each d_i drawn from its distribution q_i (after the previous
drafts); one forward of the model gave its distributions p_0..p_K after each prefix (p_{i-1} is
where d_i would be sampled from; both after the same temperature, top-k and top-p). Going through
the drafts in order:

    accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i));
    at the first rejection, emit a token drawn from r = max(0, p_{i-1} - q_i) / its sum, and stop;
    if all K are accepted, emit a bonus token drawn from p_K.

For one draft, P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_d min(q(d), p(d))) r(x) = min(q(x),
p(x)) + max(0, p(x) - q(x)) = p(x): each emitted token is distributed exactly as if sampled from
the model, whatever the drafts; the drafts only decide how many tokens one forward yields. With
greedy "sampling" (both distributions one-hot) the rule reduces to keeping the drafts that equal
the model's choices, which ``speculative.py`` does directly.
"""

from __future__ import annotations

import torch


def accept_or_resample(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, torch.Tensor]:
    """(how many of ``drafts`` [K] to keep, the token [1] emitted after them) for the drafts' own
    distributions ``draft_probs`` [K, vocab] and the model's ``target_probs`` [K + 1, vocab] (row i:
    after the first i drafts). Draws K uniforms and one token from ``generator``."""
    count = drafts.shape[0]
    rows = torch.arange(count, device=drafts.device)
    proposed, target = draft_probs[rows, drafts], target_probs[rows, drafts]
    uniforms = torch.rand(count, generator=generator, device=drafts.device)
    kept = int((uniforms * proposed < target).long().cumprod(dim=0).sum())  # u < p/q; q(d) > 0: d was drawn
    if kept == count:
        return kept, torch.multinomial(target_probs[count], 1, generator=generator)
    residual = (target_probs[kept] - draft_probs[kept]).clamp_min(0.0)
    if not residual.sum() > 0:  # p <= q everywhere only when p == q, which cannot reject (up to rounding)
        residual = target_probs[kept]
    return kept, torch.multinomial(residual / residual.sum(), 1, generator=generator)


__all__ = ["accept_or_resample"]
