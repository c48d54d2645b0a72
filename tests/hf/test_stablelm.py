"""``StableLmForCausalLM`` (StableLM 2, StableLM-3B-4E1T) <-> meshlm: Llama's layer with LayerNorm
(with biases), RoPE on a quarter of each head, and biases on q/k/v alone (``use_qkv_bias``); StableLM
2 12B's parallel layer and LayerNorm of each head of q and k (``qk_layernorm``)."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import StableLmConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, stablelm  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_stablelm(**overrides) -> StableLmConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, bos_token_id=0, eos_token_id=2)
    values.update(overrides)
    return StableLmConfig(**values)


@pytest.mark.parametrize("overrides", [
    {"use_qkv_bias": True},
    {"num_key_value_heads": 4, "tie_word_embeddings": True, "layer_norm_eps": 1e-6,
     "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
    {"use_qkv_bias": True, "use_parallel_residual": True},
    {"use_parallel_residual": True, "qk_layernorm": True},
], ids=["stablelm2-like", "stablelm-3b-like-half-rotary-tied", "stablelm2-12b-like-parallel",
        "stablelm2-12b-like-qk-layernorm"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_stablelm(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.pattern, config.norm, config.mlp_activation) == ("*-" * 3, "layernorm", "swiglu")
    assert config.rope_fraction == hf_config.rope_parameters["partial_rotary_factor"]
    assert config.attention_bias == hf_config.use_qkv_bias and not config.resolved_attention_output_bias
    assert config.parallel_residual == config.parallel_residual_shared_norm == hf_config.use_parallel_residual
    assert config.qk_norm == config.qk_norm_per_head == hf_config.qk_layernorm
    if config.qk_norm:  # head h's LayerNorm is row h of meshlm's weight
        assert config.qk_norm_type == "layernorm" and not config.qk_norm_bias
        assert model.blocks[0].mixer.k_norm.weight.shape == (hf_config.num_key_value_heads, 8)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "layer_norm_eps",
                                    "use_qkv_bias", "tie_word_embeddings", "rope_parameters", "use_parallel_residual",
                                    "qk_layernorm"))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-layernorm-per-head"])
def test_a_layernorm_swiglu_meshlm_model_exports_as_stablelm_and_back(qk_norm, tmp_path):
    torch.manual_seed(0)
    qk = dict(qk_norm=True, qk_norm_type="layernorm", qk_norm_per_head=True) if qk_norm else {}
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         norm="layernorm", rope_fraction=0.25, attention_bias=True, attention_output_bias=False,
                         ffn_hidden_size=48, **qk)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == stablelm.NAME
    assert_meshlm_round_trip(model, tmp_path, stablelm.NAME)


def test_what_stablelm_cannot_hold_is_refused_by_name():
    shared_qk_norm = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4,
                                 norm="layernorm", qk_norm=True, qk_norm_type="layernorm")
    with pytest.raises(ConfigError, match="StableLM's q/k LayerNorms have a weight per head"):
        choose_architecture(shared_qk_norm, requested=stablelm.NAME)
    own_norms = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, norm="layernorm",
                            parallel_residual=True)
    with pytest.raises(ConfigError, match="StableLM's parallel layer has one norm for attention and MLP"):
        choose_architecture(own_norms, requested=stablelm.NAME)
    biased = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, norm="layernorm",
                         mlp_bias=True)
    with pytest.raises(ConfigError, match="StableLM's o_proj and MLP have no biases"):
        choose_architecture(biased, requested=stablelm.NAME)
