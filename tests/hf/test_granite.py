"""``GraniteForCausalLM`` <-> meshlm: Llama's layer with muP-style constants -- scaled embeddings, an
attention multiplier, a residual multiplier on each block's output and a divisor on the logits."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GraniteConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, granite  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402

GRANITE_3 = dict(embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                 logits_scaling=2.0)
"""Constants in the style of Granite 3.0's (an attention multiplier of 1/128, not 1/sqrt(head_dim); a
logits divisor of 2, as a larger one would flatten a tiny random model's logits below the
comparison's floor)."""


def tiny_granite(**overrides) -> GraniteConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, **GRANITE_3)
    values.update(overrides)
    return GraniteConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_multiplier": 8 ** -0.5, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
], ids=["granite-3-constants", "default-scale-tied-biases"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_granite(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.embedding_multiplier, config.residual_multiplier, config.logit_divisor) == (12.0, 0.22, 2.0)
    expected_scale = None if hf_config.attention_multiplier == 8 ** -0.5 else hf_config.attention_multiplier
    assert config.attention_scale == expected_scale
    assert_hf_round_trip(tmp_path, ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                    "logits_scaling", "num_key_value_heads", "attention_bias", "mlp_bias"))


def test_a_meshlm_model_with_the_multipliers_exports_as_granite_and_llama_refuses_them(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, embedding_multiplier=6.0, residual_multiplier=0.5, logit_divisor=4.0,
                         attention_scale=0.1)
    assert choose_architecture(config).name == granite.NAME
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, granite.NAME)
    with pytest.raises(ConfigError, match=r"model.residual_multiplier=0.5 \(only GraniteForCausalLM"):
        choose_architecture(config, requested="LlamaForCausalLM")
    plain = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4)
    assert choose_architecture(plain).name == "LlamaForCausalLM"  # no multipliers: still Llama first
