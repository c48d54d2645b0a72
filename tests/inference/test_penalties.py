"""Penalties on repeated tokens (meshlm/inference/penalties.py): the three formulas on hand-computed
logits; greedy decoding under them equals a reference that recomputes everything from the token
list each step; a left-padded batch whose rows end apart, and rows of the continuous batcher beside
unpenalized ones, get what each gets alone; bad values are refused naming the field or flag."""

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.inference.continuous_batching import ContinuousBatcher, GenerationRequest
from meshlm.inference.generate import generate
from meshlm.inference.penalties import TokenPenalties
from meshlm.inference.sampling import SamplingConfig
from tests.inference.test_generate import PATTERNS, PROMPTS, tiny_model

PENALIZED = SamplingConfig(greedy=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)


def test_the_three_penalties_on_hand_computed_logits():
    config = SamplingConfig(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    penalties = TokenPenalties(config, [[1]], vocab_size=5, device=torch.device("cpu"))
    for token in (3, 2, 3):
        penalties.add(torch.tensor([token]))
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0]])
    # seen: 1 (prompt), 2 and 3 (generated once and twice); 0 and 4 untouched
    expected = [2.0, -1.0 * 2, 0.5 / 2 - 0.5 * 1 - 1.0, 3.0 / 2 - 0.5 * 2 - 1.0, -4.0]
    assert penalties.apply(logits)[0].tolist() == pytest.approx(expected)
    assert not SamplingConfig().penalized and config.penalized


def reference_penalized_greedy(model, prompt: list[int], new_tokens: int, config: SamplingConfig) -> list[int]:
    """Greedy decoding by a full forward every step, the penalties computed from the token list in Python."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([tokens])).logits[0, -1].tolist()
            generated = tokens[len(prompt):]
            for token in set(tokens):
                if logits[token] > 0:
                    logits[token] /= config.repetition_penalty
                else:
                    logits[token] *= config.repetition_penalty
            for token in set(generated):
                logits[token] -= config.frequency_penalty * generated.count(token) + config.presence_penalty
            tokens.append(max(range(len(logits)), key=logits.__getitem__))
    return tokens[len(prompt):]


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_penalized_greedy_decoding_equals_the_reference_and_repeats_less(name):
    model = tiny_model(PATTERNS[name])
    plain_repeats = penalized_repeats = 0
    for prompt in PROMPTS:
        penalized = generate(model, [prompt], 16, PENALIZED)[0]
        assert penalized == reference_penalized_greedy(model, prompt, 16, PENALIZED)
        plain = generate(model, [prompt], 16, SamplingConfig(greedy=True))[0]
        plain_repeats += len(plain) - len(set(plain))
        penalized_repeats += len(penalized) - len(set(penalized))
    assert penalized_repeats < plain_repeats


def test_a_penalized_batch_whose_rows_end_apart_equals_each_prompt_alone():
    model = tiny_model(PATTERNS["hybrid"])
    alone = [generate(model, [prompt], 12, PENALIZED)[0] for prompt in PROMPTS]
    eos = alone[1][3]  # ends the second row early, and maybe others: rows leave the batch's counts
    ended = [tokens[:tokens.index(eos) + 1] if eos in tokens else tokens for tokens in alone]
    assert generate(model, PROMPTS, 12, PENALIZED, eos_token_id=eos) == ended
    assert sum(len(tokens) < 12 for tokens in ended) >= 1


def test_penalized_rows_of_the_continuous_batcher_draw_as_alone():
    model = tiny_model(PATTERNS["dense"])
    samplings = [PENALIZED, SamplingConfig(greedy=True), SamplingConfig(temperature=1.1, seed=3, presence_penalty=1.5),
                 SamplingConfig(top_k=8, seed=9)]
    alone = [generate(model, [prompt], 10, sampling)[0] for prompt, sampling in zip(PROMPTS, samplings)]
    batcher = ContinuousBatcher(model, max_batch_size=4)
    try:
        requests = [batcher.submit(GenerationRequest(prompt, 10, sampling))
                    for prompt, sampling in zip(PROMPTS, samplings)]
        assert [request.wait() for request in requests] == alone
    finally:
        batcher.close()


def test_bad_penalties_are_refused_by_field_and_by_flag():
    with pytest.raises(ConfigError, match="repetition_penalty=0 must be > 0"):
        SamplingConfig(repetition_penalty=0)
    with pytest.raises(ConfigError, match=r"frequency_penalty=2.5 must be in \[-2, 2\]"):
        SamplingConfig(frequency_penalty=2.5)
    from types import SimpleNamespace

    from meshlm.inference.cli import penalties_from_args

    with pytest.raises(ConfigError, match="^--presence-penalty=3 must be in"):
        penalties_from_args(SimpleNamespace(repetition_penalty=1.0, presence_penalty=3, frequency_penalty=0.0))
    model = tiny_model(PATTERNS["dense"])
    with pytest.raises(ConfigError, match="not speculative decoding"):
        generate(model, [[1, 2]], 4, PENALIZED, speculative="mtp")
