"""``Ernie4_5ForCausalLM`` (ERNIE 4.5 dense) <-> meshlm: Llama's layer rotating interleaved pairs over
the whole head (reordered into meshlm's rotate-half pairs), one switch for every bias, a tied head."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Ernie4_5Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, ernie4_5  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_ernie(**overrides) -> Ernie4_5Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return Ernie4_5Config(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"use_bias": True, "tie_word_embeddings": False, "num_key_value_heads": 4,
     "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
], ids=["ernie-4.5-0.3b-like", "biased-untied"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_ernie(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    bias = hf_config.use_bias
    assert (config.attention_bias, config.resolved_attention_output_bias, config.mlp_bias) == (bias, bias, bias)
    assert config.rope_fraction == 1.0 and config.tie_embeddings == hf_config.tie_word_embeddings
    assert config.rope_theta == (5000.0 if bias else ernie4_5.ROPE_THETA)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "head_dim", "intermediate_size",
                                    "use_bias", "rms_norm_eps", "rope_parameters", "tie_word_embeddings"))


def test_an_ernie_shaped_meshlm_model_exports_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         attention_bias=True, mlp_bias=True, ffn_hidden_size=48)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert_meshlm_round_trip(model, tmp_path, ernie4_5.NAME, imported_from=ernie4_5.NAME)


def test_what_ernie_cannot_hold_is_refused_by_name():
    mixed = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, attention_bias=True)
    with pytest.raises(ConfigError, match=r"model.mlp_bias=False with model.attention_bias=True \(ERNIE 4.5's "
                                          r"use_bias gives every projection a bias or none\)"):
        choose_architecture(mixed, requested=ernie4_5.NAME)
    windowed = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, sliding_window=8)
    with pytest.raises(ConfigError, match=r"model.sliding_window=8 \(ERNIE 4.5 attends to every earlier token"):
        choose_architecture(windowed, requested=ernie4_5.NAME)
