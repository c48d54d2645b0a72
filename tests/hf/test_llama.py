import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.hf import llama  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


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


def test_legacy_rope_fields_and_refused_scaling():
    config = llama.config_from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
                                   "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 50,
                                   "rope_theta": 250000.0, "rope_scaling": None})
    assert config.rope_theta == 250000.0 and config.pattern == "*-"
    with pytest.raises(ConfigError, match="rope type 'llama3' is not supported"):
        llama.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        llama.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
                              "hidden_act": "gelu"})


def test_unexpressible_config_names_the_blocking_field():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, qk_norm=True,
                         mlp_activation="gelu")
    with pytest.raises(ConfigError) as error:
        llama.config_to_hf(config)
    assert "model.qk_norm=True" in str(error.value) and "model.mlp_activation='gelu'" in str(error.value)
