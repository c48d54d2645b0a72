"""``HunYuanDenseV1ForCausalLM`` <-> meshlm: Llama's layer with a QK-norm of each rotated head, and the
released configs' fixed-alpha 'dynamic' RoPE read as the plain RoPE of its stretched base."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import HunYuanDenseV1Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, hunyuan  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      random_ids, with_trained_norms_and_biases)


def tiny_hunyuan(**overrides) -> HunYuanDenseV1Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "dynamic", "rope_theta": 100.0, "alpha": 50.0, "factor": 1.0})
    values.update(overrides)
    return HunYuanDenseV1Config(**values)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_logits_match_transformers_and_round_trip(attention_bias, tmp_path):
    model = convert_and_compare(tiny_hunyuan(attention_bias=attention_bias), tmp_path)
    config = model.config
    assert config.qk_norm and config.qk_norm_after_rope and config.attention_bias == attention_bias
    assert config.rope_theta == pytest.approx(100.0 * 50.0 ** (16 / 14)) and config.rope_scaling == "none"
    before = LanguageModel(ModelConfig(**{**config.to_dict(), "qk_norm_after_rope": False})).eval()
    before.load_state_dict(model.state_dict())
    with torch.no_grad():  # the order matters
        assert (before(random_ids()).logits - model(random_ids()).logits).abs().max() > 1e-3
    assert_hf_round_trip(tmp_path, ("num_key_value_heads", "head_dim", "attention_bias"))
    written = json.loads((tmp_path / "hf_again" / "config.json").read_text())["rope_parameters"]
    assert written["rope_type"] == "default" and written["rope_theta"] == pytest.approx(config.rope_theta)


def test_meshlm_qk_norm_after_rope_exports_as_hunyuan(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=48, qk_norm=True, qk_norm_after_rope=True)
    assert choose_architecture(config).name == "HunYuanDenseV1ForCausalLM"
    assert_meshlm_round_trip(with_trained_norms_and_biases(LanguageModel(config)), tmp_path,
                             "HunYuanDenseV1ForCausalLM")
    with pytest.raises(ConfigError, match="qk_norm_after_rope=True \\(only HunYuanDenseV1ForCausalLM"):
        choose_architecture(config, requested="Qwen3ForCausalLM")
    with pytest.raises(ConfigError, match="rope type 'dynamic' is not supported"):
        hunyuan.config_from_hf({**tiny_hunyuan().to_dict(), "rope_parameters": {"rope_type": "dynamic",
                                                                                 "rope_theta": 100.0, "factor": 2.0}})
