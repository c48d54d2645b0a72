"""RoPE scaling (meshlm/models/rope.py): the frequencies and attention factor of each scaling
against transformers' RoPE functions and against the formulas by hand, cached decoding with a
scaled model, attention blocks without RoPE (``model.rope_pattern``), and the settings the
configuration refuses. (Logits of converted Llama checkpoints
with each scaling: tests/hf/test_llama.py; context parallelism: tests/parallel/context.)"""

from __future__ import annotations

import math

import pytest
import torch

from meshlm.errors import ConfigError
from meshlm.models.cache import InferenceCache
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel
from meshlm.models.rope import RopeScaling, RotaryEmbedding, rope_frequencies

SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, RopeScaling("linear", 4.0)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, RopeScaling("llama3", 8.0, 64, 1.0, 4.0)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
             RopeScaling("yarn", 4.0, 64)),
    "yarn untruncated": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                          "truncate": False}, RopeScaling("yarn", 4.0, 64, yarn_truncate=False)),
    "yarn attention factor": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "attention_factor": 1.3}, RopeScaling("yarn", 4.0, 64, attention_factor=1.3)),
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_equal_transformers(name):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters, scaling = SCALINGS[name]
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=256,
                                      rope_parameters={"rope_theta": 10000.0, **parameters})
    expected, expected_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config, "cpu")
    frequencies, factor = rope_frequencies(64, 10000.0, scaling)
    torch.testing.assert_close(frequencies, expected.float(), rtol=0, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


SHORT = [1.0 + 0.05 * pair for pair in range(32)]
LONG = [1.0 + 0.9 * pair for pair in range(32)]


@pytest.mark.parametrize("attention_factor", [None, 1.2])
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_longrope_frequencies_equal_transformers(long, attention_factor):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 64}
    if attention_factor is not None:
        parameters["attention_factor"] = attention_factor
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                                      rope_parameters={"rope_theta": 10000.0, **parameters})
    expected, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=65 if long else 64)
    scaling = RopeScaling("longrope", 512 / 64, 64, attention_factor=attention_factor, short_factors=tuple(SHORT),
                          long_factors=tuple(LONG))
    frequencies, factor = rope_frequencies(64, 10000.0, scaling, long=long)
    torch.testing.assert_close(frequencies, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)  # sqrt(1 + ln 8 / ln 64) without one given


def test_longrope_switches_to_the_long_factors_past_the_original_context():
    """A forward whose largest position is below L rotates with the short factors, one that reaches L
    with the long ones -- every position of it, as transformers does."""
    scaling = RopeScaling("longrope", 8.0, 64, short_factors=tuple(SHORT), long_factors=tuple(LONG))
    rotary = RotaryEmbedding(64, 10000.0, scaling)
    short_frequencies, factor = rope_frequencies(64, 10000.0, scaling)
    long_frequencies, _ = rope_frequencies(64, 10000.0, scaling, long=True)
    for length, frequencies in ((64, short_frequencies), (65, long_frequencies)):
        positions = torch.arange(length)[None]
        cos, sin = rotary(positions)
        angles = positions[..., None].float() * frequencies
        torch.testing.assert_close(cos, torch.cat((angles, angles), -1).cos() * factor, rtol=0, atol=0)
        torch.testing.assert_close(sin, torch.cat((angles, angles), -1).sin() * factor, rtol=0, atol=0)
    assert not torch.allclose(short_frequencies, long_frequencies)


def test_llama3_keeps_short_wavelengths_and_divides_long_ones():
    """By hand: wavelengths under L / high keep their frequency, over L / low are divided by s, and
    those between blend; YaRN's default factor is 0.1 ln(s) + 1."""
    base, _ = rope_frequencies(64, 10000.0)
    scaled, _ = rope_frequencies(64, 10000.0, RopeScaling("llama3", 8.0, 64, 1.0, 4.0))
    wavelength = 2 * math.pi / base
    short, long = wavelength < 64 / 4, wavelength > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], base[short])
    torch.testing.assert_close(scaled[long], base[long] / 8)
    middle = ~short & ~long
    assert ((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all()
    assert rope_frequencies(64, 10000.0, RopeScaling("yarn", 4.0, 64))[1] == pytest.approx(0.1 * math.log(4) + 1)


def test_rotary_tables_carry_yarns_attention_factor():
    rotary = RotaryEmbedding(16, 500.0, RopeScaling("yarn", 4.0, 8, attention_factor=1.5))
    plain = RotaryEmbedding(16, 500.0, RopeScaling("yarn", 4.0, 8, attention_factor=1.0))
    positions = torch.arange(12)[None]
    (cos, sin), (plain_cos, plain_sin) = rotary(positions), plain(positions)
    torch.testing.assert_close(cos, 1.5 * plain_cos)
    torch.testing.assert_close(sin, 1.5 * plain_sin)


@pytest.mark.parametrize("scaling", ["llama3", "yarn"])
def test_cached_decoding_of_a_scaled_model_equals_the_full_forward(scaling):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, rope_scaling=scaling, rope_scaling_factor=4.0, rope_original_max_positions=8)
    model = LanguageModel(config).eval()
    sequence = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(sequence).logits
        cache = InferenceCache()
        stepped = [model(sequence[:, :6], cache=cache).logits]
        stepped += [model(sequence[:, position:position + 1], cache=cache).logits for position in range(6, 20)]
    torch.testing.assert_close(torch.cat(stepped, dim=1), full, atol=1e-5, rtol=1e-4)


def test_partial_rotary_rotates_the_first_channels_as_a_narrower_head_and_keeps_the_rest():
    """``model.rope_fraction``: the first d of each head's channels turn as a d-channel head's would
    (d = int(head_dim * fraction)), the others pass unchanged; scores of the rotated part still
    depend on the positions' difference only, those of the rest not at all."""
    from meshlm.models.rope import apply_rotary
    config = ModelConfig(vocab_size=97, hidden_size=32, pattern="*-", num_attention_heads=2, rope_fraction=0.25)
    attention = LanguageModel(config).blocks[0].mixer
    assert config.rotary_dim == attention.rotary.head_dim == 4
    x = torch.randn(1, 2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(6)[None]
    cos, sin = attention.rotary(positions)
    rotated = apply_rotary(x, cos, sin)
    narrow_cos, narrow_sin = RotaryEmbedding(4, config.rope_theta)(positions)
    torch.testing.assert_close(rotated[..., :4], apply_rotary(x[..., :4], narrow_cos, narrow_sin), rtol=0, atol=0)
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    shifted_cos, shifted_sin = attention.rotary(positions + 7)
    shifted = apply_rotary(x, shifted_cos, shifted_sin)
    torch.testing.assert_close(shifted @ shifted.transpose(-1, -2), rotated @ rotated.transpose(-1, -2),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(shifted, rotated)


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_cached_decoding_with_partial_rotary_equals_the_full_forward(fraction):
    from tests.helpers.cached_decoding import (assert_cached_generation_equals_the_full_forward,
                                               assert_decode_step_equals_the_cached_forward)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, hidden_size=64, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, rope_fraction=fraction)
    model = LanguageModel(config).eval()
    assert_cached_generation_equals_the_full_forward(model)
    assert_decode_step_equals_the_cached_forward(model)


def test_rope_pattern_leaves_the_n_blocks_unrotated_and_only_those():
    """'RN' cycles over the attention blocks, MTP's included: blocks 0 and 4 rotate, block 2 and the
    MTP depth's second attention block do not. The same weights with only block 2's rotation taken
    out by hand give the same logits; with it left in they differ."""
    torch.manual_seed(0)
    fields = dict(vocab_size=97, hidden_size=64, pattern="*-*-*-", num_attention_heads=4, num_kv_heads=2,
                  init_std=0.1, rope_fraction=0.5, rope_scaling="linear", rope_scaling_factor=2.0)
    nope = LanguageModel(ModelConfig(**fields, rope_pattern="RN")).eval()
    assert [block.mixer.rotary is None for block in nope.blocks if hasattr(block.mixer, "rotary")] == [False, True,
                                                                                                        False]
    assert nope.config.for_block(2).position_embedding == "none" and nope.config.for_block(4).rope_fraction == 0.5
    rotating = LanguageModel(ModelConfig(**fields)).eval()
    rotating.load_state_dict(nope.state_dict())
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = nope(ids).logits
        assert not torch.allclose(rotating(ids).logits, expected, atol=1e-4)
        rotating.blocks[2].mixer.rotary = None
        torch.testing.assert_close(rotating(ids).logits, expected, rtol=0, atol=0)
    mtp = ModelConfig(**{**fields, "pattern": "*-"}, rope_pattern="RN", mtp_depth=1, mtp_pattern="*-")
    assert [mtp.block_rotates(index) for index in mtp.attention_blocks] == [True, False]


def test_cached_decoding_with_unrotated_blocks_equals_the_full_forward():
    from tests.helpers.cached_decoding import (assert_cached_generation_equals_the_full_forward,
                                               assert_decode_step_equals_the_cached_forward)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=97, hidden_size=64, pattern="*-*-*-*-", num_attention_heads=4, num_kv_heads=2,
                         init_std=0.1, rope_pattern="RRRN", sliding_window=6, sliding_window_pattern="SSSF")
    model = LanguageModel(config).eval()
    assert_cached_generation_equals_the_full_forward(model)
    assert_decode_step_equals_the_cached_forward(model)


@pytest.mark.parametrize("fields,match", [
    ({"rope_fraction": 0.0}, "model.rope_fraction=0.0 must lie in"),
    ({"rope_fraction": 1.5}, "model.rope_fraction=1.5 must lie in"),
    ({"rope_fraction": 0.4}, r"= 3\) must be a positive even number"),
    ({"rope_fraction": 0.1}, "a positive even number"),
    ({"rope_fraction": 0.5, "position_embedding": "none"}, "needs model.position_embedding=rope"),
    ({"rope_scaling": "dynamic"}, "model.rope_scaling='dynamic' is not one of"),
    ({"rope_scaling": "linear", "rope_scaling_factor": 0.5}, "model.rope_scaling_factor=0.5 must be >= 1"),
    ({"rope_scaling": "yarn", "rope_original_max_positions": 0}, "model.rope_original_max_positions=0 must be"),
    ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 1.0}, "need 0 < low < high"),
    ({"rope_scaling": "yarn", "rope_beta_fast": 1.0, "rope_beta_slow": 2.0}, "need 0 < slow < fast"),
    ({"rope_scaling": "yarn", "rope_attention_factor": 0.0}, "model.rope_attention_factor=0.0 must be > 0"),
    ({"rope_scaling": "linear", "position_embedding": "none"}, "model.position_embedding='none'; set model.rope_scaling=none"),
    ({"rope_pattern": "RS"}, "model.rope_pattern='RS' must be a string of R"),
    ({"rope_scaling": "longrope", "rope_short_factors": [1.0] * 4}, "model.rope_long_factors must list 4 positive"),
    ({"rope_scaling": "longrope", "rope_short_factors": [1.0] * 3, "rope_long_factors": [1.0] * 4},
     r"model.rope_short_factors must list 4 positive numbers .* \(rotary_dim 8 / 2\)"),
    ({"rope_scaling": "longrope", "rope_short_factors": [1.0, 0.0, 1.0, 1.0], "rope_long_factors": [1.0] * 4},
     "model.rope_short_factors must list 4 positive"),
    ({"rope_short_factors": [1.0] * 4}, "model.rope_short_factors holds LongRoPE's divisors"),
    ({"rope_pattern": ""}, "model.rope_pattern='' must be a string of R"),
    ({"rope_pattern": "RN", "position_embedding": "learned", "max_position_embeddings": 8},
     "needs model.position_embedding=rope .it is 'learned'"),
])
def test_bad_rope_scaling_is_refused_by_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(vocab_size=97, hidden_size=32, pattern="*-", num_attention_heads=4, **fields).validate()
