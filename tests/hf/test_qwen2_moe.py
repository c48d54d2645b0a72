import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen2MoeConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, qwen2_moe  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      exported_logits_match, with_trained_norms_and_biases)


def tiny_qwen2_moe(**overrides) -> Qwen2MoeConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  shared_expert_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], rms_norm_eps=1e-6)
    values.update(overrides)
    return Qwen2MoeConfig(**values)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_match_transformers_and_round_trip(norm_topk_prob, tmp_path):
    model = convert_and_compare(tiny_qwen2_moe(norm_topk_prob=norm_topk_prob), tmp_path)
    config = model.config
    assert config.pattern == "*E*-*E" and not config.qk_norm and config.moe_normalize_topk == norm_topk_prob
    assert (config.attention_bias, config.resolved_attention_output_bias) == (True, False)
    assert (config.moe_shared_expert_ffn_hidden_size, config.moe_shared_expert_gate) == (24, True)
    gate = model.blocks[1].mixer.shared_expert_gate.weight
    assert gate.shape == (1, 32) and gate.abs().sum() > 0
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "intermediate_size", "moe_intermediate_size",
                                    "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
                                    "norm_topk_prob", "mlp_only_layers", "qkv_bias", "rope_parameters"))


def test_without_qkv_biases_matches_transformers(tmp_path):
    model = convert_and_compare(tiny_qwen2_moe(qkv_bias=False, num_hidden_layers=2, mlp_only_layers=[]), tmp_path)
    assert model.config.pattern == "*E*E" and not model.config.attention_bias
    assert_hf_round_trip(tmp_path, ("qkv_bias",))


def test_sliding_layers_follow_qwen2_moes_own_rule(tmp_path):
    """Without layer_types, the even layers below max_window_layers slide (transformers' Qwen2-MoE)."""
    hf_config = tiny_qwen2_moe(num_hidden_layers=4, mlp_only_layers=[], use_sliding_window=True, sliding_window=5,
                               max_window_layers=3, layer_types=None)
    model = convert_and_compare(hf_config, tmp_path)
    windowed = [model.config.for_block(block).sliding_window for block in range(0, 8, 2)]
    assert windowed == [5, None, 5, None]
    assert_hf_round_trip(tmp_path, ("use_sliding_window", "sliding_window", "layer_types"))
    derived = qwen2_moe.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                                        "num_hidden_layers": 4,
                                        "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 3})
    assert derived.sliding_window_pattern == model.config.sliding_window_pattern


def test_meshlm_model_with_a_gated_shared_expert_exports_as_qwen2_moe(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E*-", num_attention_heads=4, num_kv_heads=2,
                         attention_bias=True, attention_output_bias=False, ffn_hidden_size=48, moe_num_experts=4,
                         moe_top_k=2, moe_ffn_hidden_size=16, moe_shared_expert_ffn_hidden_size=24,
                         moe_shared_expert_gate=True, moe_aux_loss_coeff=0.01, init_std=0.2)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert_meshlm_round_trip(model, tmp_path, "Qwen2MoeForCausalLM")
    exported_logits_match(model, tmp_path)


def test_gates_and_shared_experts_are_refused_where_the_class_lacks_them():
    base = dict(vocab_size=VOCAB, hidden_size=32, pattern="*E", num_attention_heads=4, moe_num_experts=4,
                moe_top_k=2, moe_ffn_hidden_size=16)
    ungated = ModelConfig(**base, moe_shared_expert_ffn_hidden_size=24)
    with pytest.raises(ConfigError, match="moe_shared_expert_gate=False"):
        qwen2_moe.config_to_hf(ungated)
    gated = ModelConfig(**base, moe_shared_expert_ffn_hidden_size=24, moe_shared_expert_gate=True, qk_norm=True)
    with pytest.raises(ConfigError, match="model.moe_shared_expert_gate=True \\(only Qwen2MoeForCausalLM"):
        choose_architecture(gated, requested="Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="only Qwen2MoeForCausalLM gates its shared expert"):
        choose_architecture(ModelConfig(**{**gated.to_dict(), "moe_score_function": "sigmoid"}),
                            requested="DeepseekV3ForCausalLM")


def test_no_shared_expert_in_config_json_is_refused():
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size=0"):
        qwen2_moe.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
                                  "num_hidden_layers": 2,
                                  "shared_expert_intermediate_size": 0})
