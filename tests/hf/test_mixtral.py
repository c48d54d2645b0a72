import pytest
import torch

pytest.importorskip("transformers")
from transformers import MixtralConfig  # noqa: E402

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.hf import mixtral  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


def test_logits_match_transformers_and_round_trip(tmp_path):
    hf_config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = convert_and_compare(hf_config, tmp_path)
    assert model.config.pattern == "*E*E" and model.config.moe_normalize_topk
    assert model.config.rope_theta == 1e6  # Mixtral's default base
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "intermediate_size", "num_local_experts",
                                    "num_experts_per_tok", "rope_parameters", "rms_norm_eps"))


def test_meshlm_model_without_qk_norm_exports_as_mixtral(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E*E", num_attention_heads=4, moe_num_experts=4,
                         moe_top_k=2, ffn_hidden_size=16, moe_ffn_hidden_size=16, moe_normalize_topk=True)
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "MixtralForCausalLM")


def test_refuses_what_mixtral_cannot_express():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E*-", num_attention_heads=4, moe_top_k=2,
                         moe_normalize_topk=False)
    with pytest.raises(ConfigError) as error:
        mixtral.config_to_hf(config)
    assert "model.pattern='*E*-'" in str(error.value) and "model.moe_normalize_topk=False" in str(error.value)
    alternating = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E*E", num_attention_heads=4, moe_top_k=2,
                              moe_normalize_topk=True, sliding_window=8, sliding_window_pattern="FS")
    with pytest.raises(ConfigError, match="Mixtral slides in every layer or none"):
        mixtral.config_to_hf(alternating)


def test_a_sliding_window_matches_transformers_and_round_trips(tmp_path):
    hf_config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              sliding_window=5)
    model = convert_and_compare(hf_config, tmp_path)
    assert model.config.sliding_window == 5
    assert_hf_round_trip(tmp_path, ("sliding_window",))
