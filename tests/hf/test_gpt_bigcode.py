"""``GPTBigCodeForCausalLM`` (SantaCoder, StarCoder) <-> meshlm: GPT-2's layer with multi-query
attention (one key/value head after the queries in the fused ``c_attn``) or multi-head attention
(``c_attn`` rows grouped per head, regrouped), and plain ``nn.Linear`` weights."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPTBigCodeConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gpt_bigcode  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_bigcode(**overrides) -> GPTBigCodeConfig:
    values = dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return GPTBigCodeConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"multi_query": False, "tie_word_embeddings": False, "n_inner": 48, "activation_function": "gelu",
     "scale_attn_weights": False},
], ids=["starcoder-like-mqa", "multi-head-untied-exact-gelu-unscaled"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_bigcode(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert config.position_embedding == "learned" and config.max_position_embeddings == 32
    assert config.resolved_num_kv_heads == (1 if hf_config.multi_query else 4)
    assert_hf_round_trip(tmp_path, ("n_layer", "n_head", "n_inner", "multi_query", "activation_function",
                                    "scale_attn_weights", "n_positions", "layer_norm_epsilon"))


def test_a_multi_query_gpt2_style_meshlm_model_exports_as_gpt_bigcode_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=1,
                         position_embedding="learned", max_position_embeddings=24, norm="layernorm",
                         attention_bias=True, mlp_bias=True, mlp_activation="gelu_tanh", tie_embeddings=True,
                         ffn_hidden_size=128)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == gpt_bigcode.NAME  # GPT-2 has no multi-query attention
    assert_meshlm_round_trip(model, tmp_path, gpt_bigcode.NAME)


def test_what_gpt_bigcode_cannot_hold_is_refused_by_name():
    grouped = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, num_kv_heads=2,
                          position_embedding="learned", max_position_embeddings=24, norm="layernorm",
                          attention_bias=True, mlp_bias=True, mlp_activation="gelu_tanh")
    with pytest.raises(ConfigError, match="GPTBigCode has one key/value head, multi_query, or one per query head"):
        choose_architecture(grouped, requested=gpt_bigcode.NAME)
    with pytest.raises(ConfigError, match="add_cross_attention=True is not supported"):
        gpt_bigcode.config_from_hf({"architectures": [gpt_bigcode.NAME], "add_cross_attention": True})
