import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.inference.generate import generate, left_pad, restrict_vocab
from meshlm.inference.prefill import prefill
from meshlm.inference.sampling import SamplingConfig
from meshlm.inference.stats import GenerationStats
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
    """The reference: greedy decoding by a full forward over the whole sequence every step (on the
    model's device: tests/gpu uses it on CUDA)."""
    tokens, device = list(prompt), next(model.parameters()).device
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([tokens], device=device)).logits[:, -1]
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


@pytest.mark.parametrize("name", ["dense", "hybrid", "moe"])
@pytest.mark.parametrize("chunk", [1, 4])
def test_chunked_prefill_equals_one_forward(name, chunk):
    """Left-padded prompts of different lengths (longest 9, so chunks of 4 leave a short last one)."""
    model = tiny_model(PATTERNS[name])
    input_ids, token_mask = left_pad(PROMPTS, 3, torch.device("cpu"))
    with torch.no_grad():
        whole = model.head_logits(prefill(model, input_ids, token_mask, InferenceCache()))
        chunked = model.head_logits(prefill(model, input_ids, token_mask, InferenceCache(), chunk_size=chunk))
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-4)
    assert generate(model, PROMPTS, 10, GREEDY, prefill_chunk=chunk) == generate(model, PROMPTS, 10, GREEDY)


def test_chunked_prefill_never_holds_a_whole_prompt_of_activations_or_logits():
    model = tiny_model(PATTERNS["hybrid"])
    widths, head_inputs = [], []
    model.blocks[0].register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    head_logits = model.head_logits
    model.head_logits = lambda hidden, **kwargs: head_inputs.append(hidden.shape) or head_logits(hidden, **kwargs)
    generate(model, PROMPTS, 3, GREEDY, prefill_chunk=4)
    assert widths == [4, 4, 1, 1, 1]  # 9 prompt columns in chunks of 4, then one token per step
    assert all(shape[:2] == (len(PROMPTS), 1) for shape in head_inputs)  # logits of one position only


def test_generation_stats_count_tokens_and_cache_bytes():
    model = tiny_model(PATTERNS["hybrid"])
    stats = GenerationStats()
    generate(model, PROMPTS, 6, GREEDY, stats=stats)
    summary = stats.summary()
    assert summary["prefill_tokens"] == sum(map(len, PROMPTS)) and summary["decode_tokens"] == 6 * len(PROMPTS)
    assert summary["prefill_tokens_per_s"] > 0 and summary["decode_tokens_per_s"] > 0
    assert 0 < summary["cache_bytes"] == stats.cache_bytes
    assert "acceptance_rate" not in summary


def test_bad_prefill_chunk_is_rejected():
    with pytest.raises(ConfigError, match="prefill_chunk=0"):
        generate(tiny_model(PATTERNS["dense"]), PROMPTS, 4, GREEDY, prefill_chunk=0)


def test_decode_steps_hand_attention_a_key_mask_only_when_a_prompt_was_padded():
    """The cache remembers whether it saw padding, instead of checking every cached token each step."""
    model = tiny_model(PATTERNS["dense"])
    attention = model.blocks[0].mixer
    core, key_masks = attention.core, []
    attention.core = lambda query, key, value, key_mask=None: key_masks.append(key_mask) or core(query, key, value,
                                                                                               key_mask)
    generate(model, [PROMPTS[0], PROMPTS[0][:5]], 3, GREEDY)  # left-padded
    assert all(mask is not None for mask in key_masks)
    key_masks.clear()
    generate(model, [PROMPTS[0], PROMPTS[0]], 3, GREEDY)  # no padding
    assert key_masks == [None, None, None]


def test_compiled_decoding_gives_the_same_tokens_and_times_compiling_apart(monkeypatch):
    import functools

    import meshlm.inference.generate as generate_module

    # aot_eager: Dynamo's graph and the custom op, without Inductor's minutes of code generation
    monkeypatch.setattr(generate_module, "DecodeStep",
                        functools.partial(generate_module.DecodeStep, backend="aot_eager"))
    torch._dynamo.reset()
    model = tiny_model("M*-M-")
    stats = GenerationStats()
    compiled = generate(model, PROMPTS, 6, GREEDY, eos_token_id=7, compile=True, stats=stats)
    assert compiled == generate(model, PROMPTS, 6, GREEDY, eos_token_id=7)
    assert stats.compile_seconds > 0 and stats.summary()["compile_seconds"] >= 0
    with pytest.raises(ConfigError, match="drop --compile or --speculative"):
        generate(tiny_model("M*-"), PROMPTS[:1], 4, GREEDY, speculative="mtp", compile=True)


def longrope_model(**overrides) -> LanguageModel:
    """Phi-3.5's LongRoPE in small: the long factors past 12 positions."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, rope_scaling="longrope", rope_scaling_factor=4.0, rope_original_max_positions=12,
                         rope_short_factors=[1.0, 1.1, 1.3, 1.6], rope_long_factors=[1.0, 3.0, 9.0, 27.0], **overrides)
    return LanguageModel(config).eval()


def test_longrope_generation_within_and_past_the_original_context_equals_the_full_forward():
    """Cached generation with one set of factors throughout -- the short within 12 positions, the long
    from a prompt past them -- gives the tokens of a full forward over each prefix (transformers' rule)."""
    model = longrope_model()
    within, past = PROMPTS[0], PROMPTS[0] + PROMPTS[2]  # 9 tokens (+4 new: up to 12 positions), 14 tokens
    assert generate(model, [within], 4, GREEDY) == [generate_without_cache(model, within, 4)]
    assert generate(model, [past], 6, GREEDY) == [generate_without_cache(model, past, 6)]
    assert generate(model, [past], 6, GREEDY, prefill_chunk=13) == [generate_without_cache(model, past, 6)]
    ids = torch.tensor([past])
    with torch.no_grad():  # the factors matter: the 14-token prefix's last logits change with its first 12 tokens'
        assert not torch.allclose(model(ids[:, :12]).logits[:, -1], model(ids[:, :13]).logits[:, -2], atol=1e-4)


def test_longrope_generation_past_the_original_context_runs_the_sequence_again():
    """A generation whose sequence grows past 12 positions switches to the long factors there and
    runs every position again, as transformers does: the tokens of a full forward over each prefix.
    In a batch the longest row decides (transformers' rule, the batch's largest position): that row
    gets its own tokens."""
    model = longrope_model()
    assert generate(model, [PROMPTS[0]], 8, GREEDY) == [generate_without_cache(model, PROMPTS[0], 8)]
    stats = GenerationStats()
    batched = generate(model, [PROMPTS[0], PROMPTS[1]], 8, GREEDY, stats=stats, compile=False)
    assert batched[0] == generate_without_cache(model, PROMPTS[0], 8)
    assert stats.prefill_tokens == 9 + 2 + (9 + 4) + (2 + 4)  # the prompts, then both rows again at 13 tokens
    with pytest.raises(ConfigError, match="prefill_chunk=4: the first chunk of this 14-token prompt"):
        generate(model, [PROMPTS[0] + PROMPTS[2]], 2, GREEDY, prefill_chunk=4)
    drafting = longrope_model(mtp_depth=1, mtp_pattern="*-")
    with pytest.raises(ConfigError, match="which speculative decoding does not do"):
        generate(drafting, [PROMPTS[0]], 5, GREEDY, speculative="mtp")
