import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.inference.generate import generate, restrict_vocab
from meshlm.inference.sampling import SamplingConfig
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

GREEDY = SamplingConfig(greedy=True)
PATTERNS = {"dense": "*-*-", "hybrid": "M*-M-", "moe": "*E*-", "hybrid_moe": "ME*E"}
PROMPTS = [[5, 17, 3, 42, 8, 1, 60, 22, 9], [11, 2], [70, 70, 4, 13, 96], [33]]


def tiny_model(pattern: str) -> LanguageModel:
    """A random model whose logits are spread enough that argmax is not decided by rounding."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, hidden_size=32, pattern=pattern, num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, mamba_head_dim=8, mamba_chunk_size=8, moe_num_experts=4, moe_top_k=2,
                         moe_ffn_hidden_size=32)
    return LanguageModel(config).eval()


def generate_without_cache(model: LanguageModel, prompt: list[int], max_new_tokens: int,
                           eos_token_id: int | None = None, valid_vocab_size: int | None = None) -> list[int]:
    """The reference: greedy decoding by a full forward over the whole sequence every step."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens])).logits[:, -1]
            tokens.append(int(restrict_vocab(logits, valid_vocab_size).argmax()))
            if tokens[-1] == eos_token_id:
                break
    return tokens[len(prompt):]


@pytest.mark.parametrize("name", PATTERNS)
def test_cached_logits_match_full_forward(name):
    model = tiny_model(PATTERNS[name])
    sequence = torch.tensor([PROMPTS[0] + [7, 50, 21, 64]])
    prompt_length = len(PROMPTS[0])
    with torch.no_grad():
        full = model(sequence).logits
        cache = InferenceCache()
        stepped = [model(sequence[:, :prompt_length], cache=cache).logits]
        for position in range(prompt_length, sequence.shape[1]):
            stepped.append(model(sequence[:, position:position + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(stepped, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", PATTERNS)
def test_cached_greedy_equals_full_forward_greedy(name):
    model = tiny_model(PATTERNS[name])
    for prompt in PROMPTS[:3]:
        expected = generate_without_cache(model, prompt, 14)
        assert generate(model, [prompt], 14, GREEDY) == [expected]
        assert len(set(expected)) > 2  # the test would be weak if the model repeated one token


@pytest.mark.parametrize("name", ["dense", "hybrid", "hybrid_moe"])
def test_left_padded_batch_equals_each_prompt_alone(name):
    model = tiny_model(PATTERNS[name])
    batched = generate(model, PROMPTS, 12, GREEDY, pad_token_id=3)
    alone = [generate(model, [prompt], 12, GREEDY)[0] for prompt in PROMPTS]
    assert batched == alone
    assert batched == [generate_without_cache(model, prompt, 12) for prompt in PROMPTS]


@pytest.mark.parametrize("name", ["dense", "hybrid"])
def test_eos_ends_its_row_and_the_others_continue(name):
    model = tiny_model(PATTERNS[name])
    prompts = PROMPTS[:3]
    reference = [generate_without_cache(model, prompt, 12) for prompt in prompts]
    eos = next(token for token in reference[0][1:] if all(token not in row for row in reference[1:]))
    result = generate(model, prompts, 12, GREEDY, eos_token_id=eos)
    assert result[0] == reference[0][:reference[0].index(eos) + 1]  # eos kept as the last token
    assert result[1:] == reference[1:]  # rows after the dropped one keep their cache rows


def test_valid_vocab_size_keeps_padded_ids_out():
    model = tiny_model(PATTERNS["dense"])
    result = generate(model, PROMPTS[:2], 12, GREEDY, valid_vocab_size=10)
    assert all(token < 10 for row in result for token in row)
    assert result == [generate_without_cache(model, prompt, 12, valid_vocab_size=10) for prompt in PROMPTS[:2]]


def test_sampling_is_reproducible_from_the_seed():
    model = tiny_model(PATTERNS["hybrid"])
    first, second, other = (generate(model, PROMPTS, 12, SamplingConfig(temperature=1.5, top_p=0.95, seed=seed))
                            for seed in (5, 5, 6))
    assert first == second
    assert first != other
    assert all(len(row) == 12 for row in first)


def test_restores_training_mode_and_handles_zero_tokens():
    model = tiny_model(PATTERNS["dense"]).train()
    assert generate(model, PROMPTS[:2], 0, GREEDY) == [[], []]
    generate(model, PROMPTS[:2], 3, GREEDY)
    assert model.training


@pytest.mark.parametrize("prompts, message", [([], "no prompts"), ([[1, 2], []], "prompt 1 is empty"),
                                              ([[1, 97]], "token id 97")])
def test_bad_prompts_are_rejected(prompts, message):
    with pytest.raises(ConfigError, match=message):
        generate(tiny_model(PATTERNS["dense"]), prompts, 4, GREEDY)


def test_any_of_several_eos_ids_ends_a_row():
    model = tiny_model(PATTERNS["dense"])
    reference = [generate_without_cache(model, prompt, 12) for prompt in PROMPTS[:2]]
    first_eos, second_eos = reference[0][3], reference[1][5]
    result = generate(model, PROMPTS[:2], 12, GREEDY, eos_token_id=[first_eos, second_eos])
    for row, expected in zip(result, reference):
        stop = min(expected.index(t) for t in (first_eos, second_eos) if t in expected)
        assert row == expected[:stop + 1]
