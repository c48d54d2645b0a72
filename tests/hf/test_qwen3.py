import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen3Config  # noqa: E402

from meshlm.checkpoint.model_files import load_model  # noqa: E402
from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import hf_to_meshlm, qwen3  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      random_ids)

ROUND_TRIP_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "rms_norm_eps", "attention_bias", "use_sliding_window",
                     "max_position_embeddings", "bos_token_id", "eos_token_id")
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 500.0}


def tiny_qwen3(**overrides) -> Qwen3Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    values.update(overrides)
    return Qwen3Config(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True, "attention_bias": True, "num_key_value_heads": 1},
    {"rope_parameters": YARN, "max_position_embeddings": 32},  # 24 tokens run past the original 8
], ids=["plain", "tied-bias-mqa", "yarn"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(tiny_qwen3(**overrides), tmp_path, seq=24)
    config = model.config
    assert config.pattern == "*-*-*-" and config.qk_norm and config.resolved_head_dim == 16
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert config.attention_bias == overrides.get("attention_bias", False)
    assert (config.rope_scaling, config.rope_scaling_factor) == (("yarn", 4.0) if "max_position_embeddings" in overrides
                                                                 else ("none", 1.0))
    assert_hf_round_trip(tmp_path, ROUND_TRIP_FIELDS)
    rope, rope_again = (json.loads((tmp_path / folder / "config.json").read_text())["rope_parameters"]
                        for folder in ("hf", "hf_again"))
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0} if config.rope_scaling == "yarn" else {}
    assert rope_again == {**rope, **defaults}  # export spells out YaRN's default betas
    assert load_model(hf_to_meshlm(tmp_path / "hf_again", tmp_path / "meshlm again")[0]).config == config


def test_yarn_changes_the_logits(tmp_path):
    """The YaRN comparison above is not vacuous: the same weights without the scaling differ."""
    model = convert_and_compare(tiny_qwen3(rope_parameters=YARN, max_position_embeddings=32), tmp_path, seq=24)
    plain = LanguageModel(dataclasses.replace(model.config, rope_scaling="none"))
    plain.load_state_dict(model.state_dict())
    ids = random_ids(seq=24)
    with torch.no_grad():
        assert (plain.eval()(ids).logits - model.eval()(ids).logits).abs().max() > 1e-3


def test_meshlm_model_round_trips_through_qwen3(tmp_path):
    """meshlm -> Qwen3 -> meshlm: a dense QK-norm model is written as Qwen3 by default (Llama has
    no QK-norm)."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         head_dim=16, qk_norm=True, ffn_hidden_size=40, rope_theta=1234.0, norm_eps=1e-6,
                         tie_embeddings=True)
    model = LanguageModel(config)
    assert_meshlm_round_trip(model, tmp_path, qwen3.NAME)


HF_BASE = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 8}


def test_sliding_window_is_ignored_only_while_it_is_off():
    config = qwen3.config_from_hf({**HF_BASE, "use_sliding_window": False, "sliding_window": 4096,
                                   "max_window_layers": 1, "layer_types": ["full_attention"] * 2})
    assert config.pattern == "*-*-" and config.qk_norm and config.sliding_window is None
    config = qwen3.config_from_hf({**HF_BASE, "use_sliding_window": True, "sliding_window": 4096,
                                   "max_window_layers": 1})
    assert (config.sliding_window, config.sliding_window_pattern) == (4096, "FS")


def test_alternating_windows_match_transformers(tmp_path):
    from transformers import Qwen3Config

    hf_config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                            sliding_window=4, layer_types=["full_attention", "sliding_attention"] * 2)
    model = convert_and_compare(hf_config, tmp_path, seq=24)
    assert (model.config.sliding_window, model.config.sliding_window_pattern) == (4, "FS")
    assert_hf_round_trip(tmp_path, ("use_sliding_window", "sliding_window", "layer_types"))


def test_absent_fields_take_transformers_defaults_and_other_activations_are_refused():
    config = qwen3.config_from_hf({**{key: value for key, value in HF_BASE.items()
                                      if key not in ("head_dim", "num_key_value_heads")}, "num_attention_heads": 64})
    assert (config.resolved_head_dim, config.resolved_num_kv_heads) == (128, 32)
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        qwen3.config_from_hf({**HF_BASE, "hidden_act": "gelu"})


def test_unexpressible_config_names_the_blocking_field():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, mlp_bias=True)
    with pytest.raises(ConfigError) as error:
        qwen3.config_to_hf(config)
    assert "model.qk_norm=False" in str(error.value) and "model.mlp_bias=True" in str(error.value)
