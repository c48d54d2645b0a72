"""``PhiForCausalLM`` (phi-1, phi-1.5, Phi-2) <-> meshlm: attention and MLP side by side through one
LayerNorm, RoPE on part of each head, biases on every linear layer and on the output head."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import PhiConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, phi  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_phi(**overrides) -> PhiConfig:
    values = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  bos_token_id=0, eos_token_id=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4})
    values.update(overrides)
    return PhiConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"num_key_value_heads": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-6,
     "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
    {"qk_layernorm": True},
], ids=["phi2-like", "grouped-kv-exact-gelu", "qk-layernorm"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_phi(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert config.parallel_residual and config.parallel_residual_shared_norm and config.output_bias
    assert config.rope_fraction == hf_config.rope_parameters["partial_rotary_factor"]
    assert config.rotary_dim == int(12 * config.rope_fraction)  # 0.4: 4 of 12 channels (int(4.8), as transformers)
    assert "output.bias" in model.state_dict() and "blocks.1.norm.weight" not in model.state_dict()
    assert config.qk_norm == config.qk_norm_bias == hf_config.qk_layernorm and not config.qk_norm_per_head
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "hidden_act",
                                    "layer_norm_eps", "rope_parameters", "tie_word_embeddings", "qk_layernorm"))


def test_a_phi_shaped_meshlm_model_exports_as_phi_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, norm="layernorm",
                         attention_bias=True, mlp_bias=True, mlp_activation="gelu_tanh", ffn_hidden_size=48,
                         rope_fraction=0.5, parallel_residual=True, parallel_residual_shared_norm=True,
                         output_bias=True)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == phi.NAME
    assert_meshlm_round_trip(model, tmp_path, phi.NAME)


def test_what_phi_cannot_hold_is_refused_by_name():
    base = {"architectures": [phi.NAME], "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1}
    with pytest.raises(ConfigError, match="tie_word_embeddings=True is not supported.*bias of its own"):
        phi.config_from_hf({**base, "tie_word_embeddings": True})
    biased_head = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, output_bias=True)
    with pytest.raises(ConfigError, match="model.output_bias=True .only PhiForCausalLM"):
        choose_architecture(biased_head, requested="LlamaForCausalLM")
    unbiased_qk = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, norm="layernorm",
                              attention_bias=True, mlp_bias=True, mlp_activation="gelu_tanh", rope_fraction=0.5,
                              parallel_residual=True, parallel_residual_shared_norm=True, output_bias=True,
                              qk_norm=True, qk_norm_type="layernorm")
    with pytest.raises(ConfigError, match="model.qk_norm_bias=False .Phi's q/k LayerNorms have a bias"):
        choose_architecture(unbiased_qk, requested=phi.NAME)
    with pytest.raises(ConfigError, match="output_bias=true puts a bias on the untied language-model head"):
        ModelConfig(pattern="*-", output_bias=True, tie_embeddings=True)
