"""Speculative sampling (meshlm/inference/speculative_sampling.py and the sampled path of
meshlm/inference/speculative.py): every emitted token has the model's own sampling distribution.

The acceptance rule alone, on fixed distributions p (the model's) and q (the draft's), emits
tokens with p's frequencies whatever q is: the first token after one or two drafts, and the
second one after an accepted first. Through the model: with a one-token top-k (sampling, but
deterministic) the tokens are greedy decoding's; with top-k 4 the second generated token's
frequencies over 300 seeds match its exact marginal, computed from the model's distributions,
while drafts are both kept and rejected; the same seed gives the same tokens.
"""

import pytest
import torch

from meshlm.inference.generate import generate
from meshlm.inference.sampling import SamplingConfig, token_probs
from meshlm.inference.speculative_sampling import accept_or_resample
from meshlm.inference.stats import GenerationStats
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

P = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05], [0.05, 0.05, 0.2, 0.3, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2]])
"""The model's distributions after 0, 1 and 2 drafts."""
Q = torch.tensor([[0.1, 0.1, 0.4, 0.2, 0.2], [0.6, 0.1, 0.1, 0.1, 0.1]])
"""The drafts' distributions: far from P, so keeping every draft would show."""
DRAWS = 20000


def emitted(drafts: torch.Tensor, generator: torch.Generator) -> list[int]:
    kept, token = accept_or_resample(drafts, Q[:len(drafts)], P[:len(drafts) + 1], generator)
    return drafts[:kept].tolist() + token.tolist()


def frequencies(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=5).double() / len(tokens)


def test_the_rule_emits_the_models_distribution_whatever_the_drafts():
    generator = torch.Generator().manual_seed(0)
    first_of_one, first_of_two, second_after_kept = [], [], []
    for _ in range(DRAWS):
        one = torch.multinomial(Q[0], 1, generator=generator)
        first_of_one.append(emitted(one, generator)[0])
        two = torch.cat([torch.multinomial(Q[row], 1, generator=generator) for row in (0, 1)])
        tokens = emitted(two, generator)
        first_of_two.append(tokens[0])
        if tokens[0] == two[0]:  # the first draft kept: the next token is p_1's
            second_after_kept.append(tokens[1])
    for tokens, expected in ((first_of_one, P[0]), (first_of_two, P[0]), (second_after_kept, P[1])):
        assert (frequencies(tokens) - expected.double()).abs().max() < 0.015, (frequencies(tokens), expected)
    assert len(second_after_kept) > 0.3 * DRAWS  # kept drafts: the acceptance branch is exercised


def test_a_draft_equal_to_the_model_is_always_kept():
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        draft = torch.multinomial(P[0], 1, generator=generator)
        kept, _ = accept_or_resample(draft, P[:1], P[:2], generator)
        assert kept == 1


CYCLE = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


@pytest.fixture(scope="module")
def trained_model() -> LanguageModel:
    """Two MTP depths trained with the model for a few steps to continue CYCLE: about two drafts in
    three are kept, and the drafts' distributions still differ from the model's."""
    config = ModelConfig(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, mtp_depth=2, mtp_pattern="*-", mtp_loss_coeff=1.0)
    model = LanguageModel(config, seed=0).train()
    sequence = torch.tensor([(CYCLE * 4)[:41]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(8):
        loss = model(sequence[:, :-1], labels=sequence[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_a_one_token_top_k_samples_the_greedy_tokens(trained_model):
    model = trained_model
    prompts = [[5, 17, 3, 42], CYCLE[:4]]
    sampled = generate(model, prompts, 12, SamplingConfig(top_k=1, seed=3), speculative="mtp")
    assert sampled == generate(model, prompts, 12, SamplingConfig(greedy=True))


def test_the_second_token_follows_its_exact_marginal_and_seeds_repeat(trained_model):
    model, prompt, sampling = trained_model, CYCLE[:5], SamplingConfig(top_k=4, temperature=2.0)
    with torch.no_grad():  # exact: P(x2) = sum over x1 of p(x1 | prompt) p(x2 | prompt, x1)
        first = token_probs(model(torch.tensor([prompt])).logits[0, -1], sampling)
        support = first.nonzero().flatten()
        rows = torch.tensor([prompt + [int(token)] for token in support])
        marginal = (first[support, None] * token_probs(model(rows).logits[:, -1], sampling)).sum(0)
    stats, seconds = GenerationStats(), []
    for seed in range(300):
        tokens = generate(model, [prompt], 3, SamplingConfig(top_k=4, temperature=2.0, seed=seed),
                          speculative="mtp", stats=stats)[0]
        seconds.append(tokens[1])
    observed = torch.bincount(torch.tensor(seconds), minlength=97).double() / len(seconds)
    # total variation 0.03 here; keeping every draft gives 0.19, drawing a rejected draft's
    # replacement from p rather than max(0, p - q) 0.13
    assert 0.5 * (observed - marginal.double()).abs().sum() < 0.1
    assert stats.accepted_tokens > 0.2 * stats.drafted_tokens  # drafts kept and rejected both happen
    assert stats.accepted_tokens < stats.drafted_tokens
    again = [generate(model, [prompt], 8, SamplingConfig(top_k=4, temperature=2.0, seed=seed), speculative="mtp")
             for seed in (7, 7, 8)]
    assert again[0] == again[1] and again[0] != again[2]
