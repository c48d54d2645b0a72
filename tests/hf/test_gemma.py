"""``GemmaForCausalLM`` <-> meshlm: Llama's layer with a GeGLU MLP, zero-centered RMSNorms, embeddings
scaled by sqrt(hidden_size) and a tied head; a legacy ``hidden_act: gelu`` is the tanh GELU."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GemmaConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gemma  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_gemma(**overrides) -> GemmaConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6)
    values.update(overrides)
    return GemmaConfig(**values)


@pytest.mark.parametrize("hidden_act", ["gelu_pytorch_tanh", "gelu"])
def test_logits_match_transformers_and_round_trip(hidden_act, tmp_path):
    model = convert_and_compare(tiny_gemma(hidden_act=hidden_act), tmp_path)
    config = model.config
    assert (config.mlp_activation, config.norm_zero_centered, config.block_output_norm) == ("geglu", True, False)
    assert config.embedding_multiplier == 32 ** 0.5 and config.tie_embeddings and config.resolved_num_kv_heads == 1
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "head_dim", "num_key_value_heads", "intermediate_size",
                                    "rope_parameters"))


def test_meshlm_gemma_layers_export_as_gemma(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         mlp_activation="geglu", norm_zero_centered=True, embedding_multiplier=32 ** 0.5,
                         tie_embeddings=True, ffn_hidden_size=48)
    assert choose_architecture(config).name == "GemmaForCausalLM"
    assert_meshlm_round_trip(with_trained_norms_and_biases(LanguageModel(config)), tmp_path, "GemmaForCausalLM")


def test_what_gemma_cannot_hold_is_named():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, mlp_activation="geglu",
                         norm_zero_centered=True, embedding_multiplier=32 ** 0.5, sliding_window=8)
    with pytest.raises(ConfigError, match="model.sliding_window=8"):
        gemma.config_to_hf(config)
    with pytest.raises(ConfigError, match="hidden_act='relu'"):
        gemma.config_from_hf({**tiny_gemma().to_dict(), "hidden_act": "relu"})
