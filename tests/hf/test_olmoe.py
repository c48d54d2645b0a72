"""``OlmoeForCausalLM`` (OLMoE-1B-7B) <-> meshlm: pre-norm attention with QK-norm over all heads, a
softmax-routed MoE block of SwiGLU experts in every layer, renormalized with ``norm_topk_prob``."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import OlmoeConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, olmoe  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_olmoe(**overrides) -> OlmoeConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, pad_token_id=0, eos_token_id=2)
    values.update(overrides)
    return OlmoeConfig(**values)


@pytest.mark.parametrize("overrides", [{}, {"norm_topk_prob": True, "tie_word_embeddings": True,
                                            "num_key_value_heads": 4}], ids=["olmoe-1b-7b-like", "renormalized-tied"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_olmoe(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert config.pattern == "*E*E" and config.qk_norm and config.qk_norm_scope == "all"
    assert config.moe_normalize_topk == hf_config.norm_topk_prob and config.moe_ffn_hidden_size == 16
    assert model.blocks[0].mixer.k_norm.weight.shape == (8 * hf_config.num_key_value_heads,)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "num_experts",
                                    "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
                                    "rope_parameters"))


def test_an_olmoe_shaped_meshlm_model_exports_as_olmoe_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E*E", num_attention_heads=4, num_kv_heads=2,
                         qk_norm=True, qk_norm_scope="all", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == olmoe.NAME
    assert_meshlm_round_trip(model, tmp_path, olmoe.NAME)


def test_what_olmoe_cannot_hold_is_refused_by_name():
    with pytest.raises(ConfigError, match="clip_qkv=8.0 is not supported"):
        olmoe.config_from_hf({"architectures": [olmoe.NAME], "hidden_size": 32, "num_attention_heads": 4,
                              "num_hidden_layers": 1, "clip_qkv": 8.0})
    per_head = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E", num_attention_heads=4, qk_norm=True,
                           moe_num_experts=4, moe_top_k=2)
    with pytest.raises(ConfigError, match="OLMoE normalizes the whole query and key projections"):
        choose_architecture(per_head, requested=olmoe.NAME)
