"""``Starcoder2ForCausalLM`` <-> meshlm: LayerNorm with biases, biases on every linear layer (or
none), a non-gated GELU-tanh MLP (c_fc, c_proj), RoPE with grouped KV heads, a window in every layer."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Starcoder2Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, starcoder2  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_starcoder2(**overrides) -> Starcoder2Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    values.update(overrides)
    return Starcoder2Config(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"sliding_window": 5, "tie_word_embeddings": False, "norm_epsilon": 1e-6},
    {"use_bias": False, "hidden_act": "gelu", "attention_dropout": 0.1, "residual_dropout": 0.1},
], ids=["starcoder2-like", "windowed-untied", "no-biases-exact-gelu-dropout"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_starcoder2(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.pattern, config.norm, config.position_embedding) == ("*-" * 3, "layernorm", "rope")
    assert config.attention_bias == config.mlp_bias == hf_config.use_bias
    assert config.mlp_activation == {"gelu_pytorch_tanh": "gelu_tanh"}.get(hf_config.hidden_act, hf_config.hidden_act)
    assert config.sliding_window == hf_config.sliding_window
    assert (config.attention_dropout, config.hidden_dropout) == (hf_config.attention_dropout,
                                                                 hf_config.residual_dropout)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "hidden_act",
                                    "norm_epsilon", "use_bias", "sliding_window", "tie_word_embeddings"))


def test_a_starcoder2_shaped_meshlm_model_exports_as_starcoder2(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         norm="layernorm", attention_bias=True, mlp_bias=True, mlp_activation="gelu_tanh",
                         ffn_hidden_size=64, sliding_window=6)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == starcoder2.NAME
    assert_meshlm_round_trip(model, tmp_path, starcoder2.NAME)
    mixed = ModelConfig(**{**config.to_dict(), "mlp_bias": False})
    with pytest.raises(ConfigError, match="StarCoder2's use_bias puts biases on every linear layer or none"):
        choose_architecture(mixed, requested=starcoder2.NAME)


def test_an_activation_meshlm_lacks_is_refused_by_name():
    with pytest.raises(ConfigError, match="hidden_act='gelu_fast' is not supported"):
        starcoder2.config_from_hf({"architectures": [starcoder2.NAME], "hidden_size": 32, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "num_hidden_layers": 2, "hidden_act": "gelu_fast"})
