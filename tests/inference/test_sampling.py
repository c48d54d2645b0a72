import math

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.inference.sampling import SamplingConfig, sample_next, top_k_filter, top_p_filter

# A hand-made distribution, deliberately not sorted: token 1 is the most likely, then 3, 2, 0.
PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


def kept_tokens(filtered_logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(filtered_logits[0]).nonzero().flatten().tolist())


def sample_many(config: SamplingConfig, draws: int = 20000) -> torch.Tensor:
    logits = PROBS.log().expand(draws, -1)
    return sample_next(logits, config, config.make_generator("cpu"))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample_next(logits, SamplingConfig(greedy=True)), logits.argmax(-1))


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, 50)
    config = SamplingConfig(temperature=1.7, top_k=1, seed=3)
    assert torch.equal(sample_next(logits, config, config.make_generator("cpu")), logits.argmax(-1))


def test_top_k_filter_keeps_the_k_largest():
    logits = PROBS.log()[None]
    assert kept_tokens(top_k_filter(logits, 2)) == {1, 3}
    assert kept_tokens(top_k_filter(logits, 0)) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_p, expected", [(0.05, {1}), (0.4, {1}), (0.7, {1, 3}), (0.9, {1, 3, 2}),
                                             (0.97, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    assert kept_tokens(top_p_filter(PROBS.log()[None], top_p)) == expected


def test_sampling_follows_the_distribution():
    counts = torch.bincount(sample_many(SamplingConfig(seed=1)), minlength=4).float()
    assert torch.allclose(counts / counts.sum(), PROBS, atol=0.015)


def test_top_p_sampling_renormalizes_over_the_nucleus():
    counts = torch.bincount(sample_many(SamplingConfig(top_p=0.7, seed=2)), minlength=4).float()
    assert counts[0] == 0 and counts[2] == 0
    assert math.isclose(float(counts[1] / counts.sum()), 0.5 / 0.8, abs_tol=0.015)


def test_low_temperature_concentrates_on_the_most_likely_token():
    samples = sample_many(SamplingConfig(temperature=0.1, seed=4), draws=2000)
    assert (samples == 1).float().mean() > 0.98


def test_same_seed_same_tokens_and_other_seed_other_tokens():
    logits = torch.zeros(1000, 64)
    first, second, other = (sample_next(logits, config, config.make_generator("cpu"))
                            for config in (SamplingConfig(seed=7), SamplingConfig(seed=7), SamplingConfig(seed=8)))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("field, value", [("temperature", 0.0), ("temperature", -1.0), ("top_p", 0.0),
                                          ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5)])
def test_invalid_values_are_rejected(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingConfig(**{field: value})
