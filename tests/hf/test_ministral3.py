"""``Ministral3ForCausalLM`` <-> meshlm: Mistral's layer with YaRN and Llama 4's query scale by
position, 1 + beta ln(1 + floor(p / L)), here with L = 4 so the 24 positions compared reach 5 steps."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Ministral3Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, ministral3  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      random_ids)

ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.8}


def tiny_ministral3(**overrides) -> Ministral3Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_parameters=dict(ROPE),
                  max_position_embeddings=64)
    values.update(overrides)
    return Ministral3Config(**values)


def test_logits_match_transformers_and_round_trip(tmp_path):
    model = convert_and_compare(tiny_ministral3(), tmp_path)
    config = model.config
    assert (config.query_scale_beta, config.query_scale_length) == (0.8, 4)
    assert (config.rope_scaling, config.rope_original_max_positions) == ("yarn", 4)
    unscaled = LanguageModel(ModelConfig(**{**config.to_dict(), "query_scale_beta": 0.0})).eval()
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():  # the scale is not vacuous
        assert (unscaled(random_ids()).logits - model(random_ids()).logits).abs().max() > 1e-3
    assert_hf_round_trip(tmp_path, ("num_key_value_heads", "head_dim", "intermediate_size"))
    written = json.loads((tmp_path / "hf_again" / "config.json").read_text())["rope_parameters"]
    # (mscale / mscale_all_dim come back as the YaRN attention factor they make, 1.0)
    assert {key: written[key] for key in ("rope_type", "factor", "original_max_position_embeddings",
                                          "llama_4_scaling_beta", "rope_theta")} == {
        key: ROPE[key] for key in ("rope_type", "factor", "original_max_position_embeddings", "llama_4_scaling_beta",
                                   "rope_theta")}


def test_a_sliding_window_matches_transformers(tmp_path):
    model = convert_and_compare(tiny_ministral3(sliding_window=6), tmp_path)
    assert model.config.sliding_window == 6
    assert_hf_round_trip(tmp_path, ("sliding_window",))


def test_meshlm_query_scale_exports_as_ministral3_and_only_there(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=48, query_scale_beta=0.3, query_scale_length=6)
    assert choose_architecture(config).name == "Ministral3ForCausalLM"
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "Ministral3ForCausalLM")
    with pytest.raises(ConfigError, match="query_scale_beta=0.3 \\(only Ministral3ForCausalLM"):
        choose_architecture(config, requested="LlamaForCausalLM")
    yarn = ModelConfig(**{**config.to_dict(), "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                          "rope_original_max_positions": 8})
    with pytest.raises(ConfigError, match="make them equal"):
        ministral3.config_to_hf(yarn)
