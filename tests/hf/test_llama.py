import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402

from meshlm.checkpoint.model_files import load_model
from meshlm.errors import ConfigError
from meshlm.hf import hf_to_meshlm
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.hf import llama  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      random_ids)


def tiny_llama(**overrides) -> LlamaConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 500.0})
    values.update(overrides)
    return LlamaConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True, "head_dim": 16, "num_key_value_heads": 1},
], ids=["plain", "tied-biases-headdim"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(tiny_llama(**overrides), tmp_path)
    assert model.config.pattern == "*-*-*-" and model.config.rope_theta == 500.0
    assert model.config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                                    "intermediate_size", "rms_norm_eps", "attention_bias", "mlp_bias",
                                    "rope_parameters", "bos_token_id", "eos_token_id"))


def test_meshlm_model_round_trips_through_llama(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=40, rope_theta=1234.0, norm_eps=1e-6)
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "LlamaForCausalLM")


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0,
             "beta_slow": 1.0},
    "yarn mscale no truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
}
"""Scalings whose frequencies move within the tests' 24 positions (an original context of 8)."""


@pytest.mark.parametrize("name", list(ROPE_SCALINGS))
def test_scaled_rope_matches_transformers_and_round_trips(name, tmp_path):
    """Llama 3.1's, linear and YaRN scaling: meshlm's logits equal transformers' on a converted
    random model (positions past the original context), and the scaling survives the round trip."""
    parameters = {"rope_theta": 500.0, **ROPE_SCALINGS[name]}
    model = convert_and_compare(tiny_llama(rope_parameters=parameters, max_position_embeddings=32,
                                           head_dim=16), tmp_path)
    assert model.config.rope_scaling == parameters["rope_type"]
    assert model.config.rope_scaling_factor == parameters["factor"]
    # DeepSeek's mscale pair is written back as the attention factor it gives (the same cos and sin)
    same_fields = ("max_position_embeddings",) + (("rope_parameters",) if "mscale" not in parameters else ())
    assert_hf_round_trip(tmp_path, same_fields)
    again = hf_to_meshlm(tmp_path / "hf_again", tmp_path / "meshlm again")[0]
    assert load_model(again).config == model.config


def test_rope_scaling_changes_the_logits(tmp_path):
    """The scaled comparison above is not vacuous: the same weights without the scaling differ."""
    model = convert_and_compare(tiny_llama(rope_parameters={"rope_theta": 500.0, **ROPE_SCALINGS["llama3"]},
                                           max_position_embeddings=32, head_dim=16), tmp_path)
    plain = LanguageModel(dataclasses.replace(model.config, rope_scaling="none"))
    plain.load_state_dict(model.state_dict())
    ids = random_ids()
    with torch.no_grad():
        assert (plain.eval()(ids).logits - model.eval()(ids).logits).abs().max() > 1e-3


def test_legacy_rope_fields_and_refused_scaling():
    config = llama.config_from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
                                   "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 50,
                                   "rope_theta": 250000.0, "rope_scaling": None})
    assert config.rope_theta == 250000.0 and config.pattern == "*-"
    legacy = llama.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                                   "rope_theta": 500000.0, "max_position_embeddings": 131072,
                                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}})
    assert (legacy.rope_scaling, legacy.rope_scaling_factor, legacy.rope_original_max_positions) == ("llama3", 8.0, 8192)
    with pytest.raises(ConfigError, match="rope type 'dynamic' is not supported"):
        llama.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                              "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        llama.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                              "hidden_act": "gelu"})


def test_unexpressible_config_names_the_blocking_field():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, qk_norm=True,
                         mlp_activation="gelu")
    with pytest.raises(ConfigError) as error:
        llama.config_to_hf(config)
    assert "model.qk_norm=True" in str(error.value) and "model.mlp_activation='gelu'" in str(error.value)
