"""``ArceeForCausalLM`` <-> meshlm: Llama's attention, then a non-gated ReLU-squared MLP."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import ArceeConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import arcee, choose_architecture  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_arcee(**overrides) -> ArceeConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6)
    values.update(overrides)
    return ArceeConfig(**values)


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True, "hidden_act": "gelu"}],
                         ids=["afm", "biases-gelu"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(tiny_arcee(**overrides), tmp_path)
    config = model.config
    assert config.mlp_activation == ("gelu" if overrides else "squared_relu") and config.mlp_bias == bool(overrides)
    assert model.blocks[1].mixer.gate_proj is None
    assert_hf_round_trip(tmp_path, ("hidden_act", "intermediate_size", "attention_bias", "mlp_bias"))


def test_meshlm_non_gated_llama_exports_as_arcee(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         mlp_activation="squared_relu", ffn_hidden_size=64)
    assert choose_architecture(config).name == "ArceeForCausalLM"
    assert_meshlm_round_trip(with_trained_norms_and_biases(LanguageModel(config)), tmp_path, "ArceeForCausalLM")
    with pytest.raises(ConfigError, match="not gated"):
        arcee.config_to_hf(ModelConfig(**{**config.to_dict(), "mlp_activation": "swiglu"}))
