"""``FalconForCausalLM`` (Falcon-7B, 40B, 180B, Falcon 2) <-> meshlm: parallel layers with one norm
(7B) or two (the new decoder architecture), sequential ones, one KV head (``multi_query``), grouped
KV heads or one per query head, each in its own layout of the fused ``query_key_value``."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import FalconConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, falcon  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)

LAYOUT_FIELDS = ("new_decoder_architecture", "multi_query", "parallel_attn", "bias", "num_hidden_layers",
                 "ffn_hidden_size", "activation", "layer_norm_epsilon", "tie_word_embeddings")


def tiny_falcon(**overrides) -> FalconConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_hidden_size=48,
                  bos_token_id=0, eos_token_id=2)
    values.update(overrides)
    return FalconConfig(**values)


@pytest.mark.parametrize("overrides, kv_heads, shared_norm", [
    ({}, 1, True),  # Falcon-7B: multi-query, one norm for attention and MLP
    ({"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True, "tie_word_embeddings": False}, 2, False),
    ({"multi_query": False, "parallel_attn": False, "activation": "gelu_pytorch_tanh",
      "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, 4, None),
    ({"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1}, 2, True),
], ids=["falcon-7b-like", "falcon-40b-like-biased-untied", "sequential-mha", "new-architecture-one-norm"])
def test_logits_match_transformers_and_round_trip(overrides, kv_heads, shared_norm, tmp_path):
    hf_config = tiny_falcon(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.pattern, config.norm, config.resolved_num_kv_heads) == ("*-" * 3, "layernorm", kv_heads)
    assert config.parallel_residual == (shared_norm is not None)
    assert config.parallel_residual_shared_norm == bool(shared_norm)
    assert config.attention_bias == config.mlp_bias == hf_config.bias
    assert_hf_round_trip(tmp_path, LAYOUT_FIELDS)


@pytest.mark.parametrize("fields, layout", [
    (dict(num_kv_heads=2, parallel_residual=True), "new_decoder_architecture"),
    (dict(num_kv_heads=1, parallel_residual=True, parallel_residual_shared_norm=True), "multi_query"),
    (dict(parallel_residual=True, parallel_residual_shared_norm=True, attention_bias=True, mlp_bias=True), "per head"),
], ids=["grouped-two-norms", "multi-query-shared-norm", "mha-shared-norm-biased"])
def test_meshlm_models_export_as_falcon_and_back(fields, layout, tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, norm="layernorm",
                         mlp_activation="gelu", ffn_hidden_size=48, **fields)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == falcon.NAME
    hf_config = falcon.config_to_hf(config)
    assert hf_config["new_decoder_architecture"] == (layout == "new_decoder_architecture")
    assert hf_config["multi_query"] == (layout != "per head")
    assert_meshlm_round_trip(model, tmp_path, falcon.NAME)


def test_the_fused_rows_follow_each_layout():
    """Where meshlm's q, k and v rows live in query_key_value, head_dim 8: grouped per KV head
    (2 query heads each: [q0 q1 k0 v0 q2 q3 k1 v1]), multi-query ([q0 q1 q2 q3 k v]), per head."""
    base = dict(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, norm="layernorm",
                mlp_activation="gelu")
    grouped = ModelConfig(**base, num_kv_heads=2, parallel_residual=True)
    blocks = falcon.qkv_row_order(grouped)[::8] // 8
    assert blocks.tolist() == [0, 1, 4, 5, 2, 6, 3, 7]
    single = ModelConfig(**base, num_kv_heads=1, parallel_residual=True, parallel_residual_shared_norm=True)
    assert (falcon.qkv_row_order(single)[::8] // 8).tolist() == list(range(6))
    per_head = ModelConfig(**base)
    assert (falcon.qkv_row_order(per_head)[::8] // 8).tolist() == \
        [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]


def test_what_falcon_cannot_hold_is_refused_by_name():
    with pytest.raises(ConfigError, match="alibi=True is not supported"):
        falcon.config_from_hf({"architectures": [falcon.NAME], "hidden_size": 32, "num_attention_heads": 4,
                               "num_hidden_layers": 1, "alibi": True})
    sequential_grouped = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4,
                                     num_kv_heads=2, norm="layernorm", mlp_activation="gelu")
    with pytest.raises(ConfigError, match="Falcon groups KV heads only in its new decoder architecture"):
        choose_architecture(sequential_grouped, requested=falcon.NAME)
