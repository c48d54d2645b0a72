"""``SeedOssForCausalLM`` (Seed-OSS-36B) <-> meshlm: Llama's layer with q/k/v biases, an output bias
of its own (``attention_out_bias``) and MLP biases, each on or off; residual dropout as hidden dropout."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import SeedOssConfig  # noqa: E402

from meshlm.hf import choose_architecture, seed_oss  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_seed_oss(**overrides) -> SeedOssConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, attention_dropout=0.0, residual_dropout=0.0, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return SeedOssConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_bias": False, "attention_out_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
     "residual_dropout": 0.1},
], ids=["seed-oss-like", "output-and-mlp-biases-tied-dropout"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_seed_oss(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.attention_bias, config.resolved_attention_output_bias, config.mlp_bias) == (
        hf_config.attention_bias, hf_config.attention_out_bias, hf_config.mlp_bias)
    assert config.hidden_dropout == hf_config.residual_dropout and config.resolved_head_dim == 16
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "head_dim", "intermediate_size",
                                    "attention_bias", "attention_out_bias", "mlp_bias", "residual_dropout",
                                    "rope_parameters"))


def test_a_meshlm_model_with_biases_on_q_k_v_and_the_mlp_exports_as_seed_oss_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         attention_bias=True, attention_output_bias=False, mlp_bias=True, ffn_hidden_size=48)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == seed_oss.NAME  # Qwen2 has no MLP biases, Llama none apart on o
    assert_meshlm_round_trip(model, tmp_path, seed_oss.NAME)
