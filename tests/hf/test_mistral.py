import pytest
import torch

pytest.importorskip("transformers")
from transformers import MistralConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, mistral  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


def tiny_mistral(**overrides) -> MistralConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, sliding_window=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    values.update(overrides)
    return MistralConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"head_dim": 16, "hidden_size": 40, "tie_word_embeddings": True},  # Mistral-Nemo's head_dim != hidden / heads
    {"sliding_window": 5},  # Mistral 7B v0.1's sliding window (4096 there), here shorter than the 24 tokens
], ids=["plain", "nemo-head-dim-tied", "sliding-window"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(tiny_mistral(**overrides), tmp_path)
    config = model.config
    assert config.pattern == "*-*-*-" and not config.qk_norm and config.rope_theta == 500.0
    assert config.sliding_window == overrides.get("sliding_window") and config.sliding_window_pattern == "S"
    assert config.resolved_head_dim == overrides.get("head_dim", 8)
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                                    "intermediate_size", "rms_norm_eps", "sliding_window", "rope_parameters",
                                    "max_position_embeddings", "bos_token_id", "eos_token_id"))


def test_meshlm_model_round_trips_through_mistral(tmp_path):
    """meshlm -> Mistral -> meshlm, for a model recorded as imported from Mistral (by default the
    same model is written as Llama, which comes first in the export order)."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=40, rope_theta=1234.0, norm_eps=1e-6)
    model = LanguageModel(config)
    assert choose_architecture(config).name == "LlamaForCausalLM"
    assert_meshlm_round_trip(model, tmp_path, mistral.NAME, imported_from=mistral.NAME)


HF_BASE = {"architectures": ["MistralForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2}


def test_a_null_window_is_full_attention_and_an_absent_one_transformers_default():
    assert mistral.config_from_hf({**HF_BASE, "sliding_window": None}).sliding_window is None
    assert mistral.config_from_hf({**HF_BASE, "sliding_window": 4096}).sliding_window == 4096
    assert mistral.config_from_hf(HF_BASE).sliding_window == 4096  # transformers reads an absent window as 4096


def test_a_model_sliding_in_every_layer_exports_as_mistral_and_others_are_refused(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=40, sliding_window=6)
    assert choose_architecture(config).name == mistral.NAME  # Llama has no window
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, mistral.NAME)
    alternating = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                              sliding_window=6, sliding_window_pattern="SF")
    with pytest.raises(ConfigError, match="sliding_window_pattern='SF' .Mistral slides in every layer or none"):
        mistral.config_to_hf(alternating)


def test_unexpressible_config_names_the_blocking_field():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, attention_bias=True,
                         qk_norm=True)
    with pytest.raises(ConfigError) as error:
        mistral.config_to_hf(config)
    assert "model.attention_bias=True" in str(error.value) and "model.qk_norm=True" in str(error.value)
