"""``Ernie4_5_MoeForCausalLM`` (ERNIE-4.5-21B-A3B, -300B-A47B) <-> meshlm: ERNIE 4.5's attention, dense
layers then MoE layers by transformers' interval rule, softmax routing steered by a correction
bias and renormalized, ungated shared experts; logits against transformers, round trips both ways."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Ernie4_5_MoeConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, ernie4_5_moe  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_ernie_moe(**overrides) -> Ernie4_5_MoeConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, moe_intermediate_size=16, moe_k=2, moe_num_experts=4,
                  moe_num_shared_experts=2, moe_layer_start_index=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return Ernie4_5_MoeConfig(**values)


@pytest.mark.parametrize("overrides, pattern", [
    ({}, "*-*E*E*E"),
    ({"moe_layer_interval": 2, "moe_layer_start_index": 0, "moe_layer_end_index": 2, "tie_word_embeddings": False,
      "moe_num_shared_experts": 0}, "*-*E*-*-"),
], ids=["21b-like", "every-second-layer-to-the-third"])
def test_logits_match_transformers_and_round_trip(overrides, pattern, tmp_path):
    hf_config = tiny_ernie_moe(**overrides)
    model = convert_and_compare(hf_config, tmp_path)  # every tensor perturbed, the correction bias too
    config = model.config
    assert config.pattern == pattern and config.moe_score_function == "softmax" and config.moe_normalize_topk
    assert config.moe_shared_expert_ffn_hidden_size == 16 * hf_config.moe_num_shared_experts
    assert model.blocks[3].mixer.router.expert_bias.abs().sum() > 0
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "moe_layer_interval", "moe_num_experts", "moe_k",
                                    "moe_num_shared_experts", "moe_intermediate_size", "intermediate_size",
                                    "tie_word_embeddings", "use_bias"))
    # the indices may differ where they give the same layers (start 0 and start 1 at interval 2)
    configs = [ernie4_5_moe.hf_with_defaults(json.loads((tmp_path / folder / "config.json").read_text()))
               for folder in ("hf", "hf_again")]
    layers = [[ernie4_5_moe.is_moe_layer(hf, layer) for layer in range(4)] for hf in configs]
    assert layers[0] == layers[1] == [kind == "E" for kind in pattern[1::2]]


def test_an_ernie_moe_shaped_meshlm_model_exports_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*E*E", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                         moe_shared_expert_ffn_hidden_size=32, moe_normalize_topk=True)
    model = with_trained_norms_and_biases(LanguageModel(config))
    with torch.no_grad():
        model.blocks[3].mixer.router.expert_bias.normal_(0.0, 0.3)
    assert_meshlm_round_trip(model, tmp_path, ernie4_5_moe.NAME, imported_from=ernie4_5_moe.NAME)
    assert ernie4_5_moe.moe_layout(config) == (1, 2, 1)


def test_what_ernie_moe_cannot_hold_is_refused_by_name():
    base = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, moe_num_experts=4, moe_top_k=2,
                moe_ffn_hidden_size=16, moe_normalize_topk=True)
    with pytest.raises(ConfigError, match=r"model.pattern='\*E\*-\*E\*E' \(ERNIE 4.5's MoE layers are every"):
        choose_architecture(ModelConfig(pattern="*E*-*E*E", **base), requested=ernie4_5_moe.NAME)
    with pytest.raises(ConfigError, match=r"then renormalizes the top k"):
        choose_architecture(ModelConfig(pattern="*E", **{**base, "moe_normalize_topk": False}),
                            requested=ernie4_5_moe.NAME)
    with pytest.raises(ConfigError, match=r"use_bias=true and MoE layers is not read"):
        ernie4_5_moe.config_from_hf(tiny_ernie_moe(use_bias=True).to_dict())
