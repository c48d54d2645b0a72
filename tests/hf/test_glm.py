"""``GlmForCausalLM`` and ``Glm4ForCausalLM`` (GLM-4-9B, GLM-4-0414, GLM-Z1) <-> meshlm: Llama's layer
rotating the first half of each head in interleaved pairs (reordered into meshlm's rotate-half
pairs), biases on q/k/v alone, a fused gate_up_proj; GLM-4-0414 with a norm after each sublayer."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Glm4Config, GlmConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, glm  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)

CLASSES = {"glm": GlmConfig, "glm4": Glm4Config}


def tiny_glm(kind: str, **overrides):
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    values.update(overrides)
    return CLASSES[kind](**values)


@pytest.mark.parametrize("kind", ["glm", "glm4"])
@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": False, "tie_word_embeddings": True, "num_key_value_heads": 4,
     "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}},
], ids=["glm-4-like", "bias-free-tied-quarter-rotary"])
def test_logits_match_transformers_and_round_trip(kind, overrides, tmp_path):
    hf_config = tiny_glm(kind, **overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert config.block_output_norm == (kind == "glm4") and config.rotary_dim == 16 * config.rope_fraction
    assert config.attention_bias == hf_config.attention_bias and not config.resolved_attention_output_bias
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "head_dim", "intermediate_size",
                                    "attention_bias", "rms_norm_eps", "rope_parameters", "tie_word_embeddings"))


@pytest.mark.parametrize("post_norms", [False, True], ids=["glm", "glm4"])
def test_a_glm_shaped_meshlm_model_exports_and_back(post_norms, tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         rope_fraction=0.5, attention_bias=True, attention_output_bias=False, ffn_hidden_size=48,
                         block_output_norm=post_norms)
    model = with_trained_norms_and_biases(LanguageModel(config))
    name = glm.GLM4_NAME if post_norms else glm.GLM_NAME
    if post_norms:
        assert choose_architecture(config).name == name
    assert_meshlm_round_trip(model, tmp_path, name)


def test_what_glm_cannot_hold_is_refused_by_name():
    sandwich = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, rope_fraction=0.5,
                           block_output_norm=True)
    with pytest.raises(ConfigError, match="model.block_output_norm=True .GLM's layers do not normalize"):
        choose_architecture(sandwich, requested=glm.GLM_NAME)
    biased_o = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, attention_bias=True)
    with pytest.raises(ConfigError, match="GLM-4-0414's o_proj and MLP have no biases"):
        choose_architecture(biased_o, requested=glm.GLM4_NAME)
