import pytest
import torch

pytest.importorskip("transformers")
from transformers import Glm4MoeConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, glm4_moe  # noqa: E402
from meshlm.hf.peft_export import peft_adapter_plan  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      exported_logits_match)


def tiny_glm45(**overrides) -> Glm4MoeConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-6, num_nextn_predict_layers=0)
    values.update(overrides)
    return Glm4MoeConfig(**values)


def test_logits_match_transformers_and_round_trip(tmp_path):
    model = convert_and_compare(tiny_glm45(), tmp_path)
    config = model.config
    assert config.pattern == "*-*E*E" and config.rope_fraction == 0.5 and config.qk_norm
    assert (config.attention_bias, config.resolved_attention_output_bias) == (True, False)
    assert (config.moe_score_function, config.moe_router_num_groups, config.moe_router_group_top_k) == ("sigmoid", 2, 1)
    assert config.moe_shared_expert_ffn_hidden_size == 16 and config.moe_routed_scaling_factor == 2.5
    assert model.blocks[3].mixer.router.expert_bias.abs().sum() > 0  # e_score_correction_bias, perturbed
    assert_hf_round_trip(tmp_path, ("first_k_dense_replace", "n_routed_experts", "n_shared_experts", "n_group",
                                    "topk_group", "routed_scaling_factor", "norm_topk_prob", "use_qk_norm",
                                    "attention_bias", "moe_intermediate_size", "head_dim"))


def test_without_qk_norm_or_biases_and_with_full_rotation_matches_transformers(tmp_path):
    hf_config = tiny_glm45(use_qk_norm=False, attention_bias=False, n_group=1,
                           rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 1.0})
    model = convert_and_compare(hf_config, tmp_path)
    assert model.config.rope_fraction == 1.0 and model.config.rope_theta == 5000.0 and not model.config.qk_norm
    assert_hf_round_trip(tmp_path, ("use_qk_norm", "attention_bias"))


def test_the_files_mtp_layer_is_skipped(tmp_path):
    """GLM-4.5's hub files carry its MTP layer as layer num_hidden_layers (eh_proj, enorm, ...)."""
    config = glm4_moe.config_from_hf(tiny_glm45().to_dict())
    state = LanguageModel(config, seed=0).state_dict()
    hub = glm4_moe.state_to_hf(state, config)
    mtp = "model.layers.3."
    hub.update({f"{mtp}eh_proj.weight": torch.zeros(32, 64), f"{mtp}enorm.weight": torch.ones(32),
                f"{mtp}hnorm.weight": torch.ones(32), f"{mtp}self_attn.q_proj.weight": torch.zeros(64, 32)})
    back = glm4_moe.state_from_hf(hub, config)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())


def test_meshlm_moe_with_gqa_and_sigmoid_routing_exports_as_glm45(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*E", num_attention_heads=4, num_kv_heads=2,
                         rope_fraction=0.5, ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8,
                         moe_shared_expert_ffn_hidden_size=8, moe_score_function="sigmoid", moe_normalize_topk=True,
                         moe_aux_loss_coeff=0.01, init_std=0.2)
    model = LanguageModel(config)
    with torch.no_grad():
        model.blocks[3].mixer.router.expert_bias.normal_(0, 0.1)
    assert choose_architecture(config).name == "Glm4MoeForCausalLM"
    exported_logits_match(model, tmp_path)
    assert_meshlm_round_trip(model, tmp_path, "Glm4MoeForCausalLM")


def test_what_glm45_cannot_hold_is_named():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E", num_attention_heads=4, moe_num_experts=4,
                         moe_top_k=2, moe_ffn_hidden_size=8, moe_shared_expert_ffn_hidden_size=12,
                         moe_score_function="sigmoid", attention_bias=True)
    with pytest.raises(ConfigError) as refused:
        glm4_moe.config_to_hf(config)
    message = str(refused.value)
    assert "o_proj has no bias" in message and "Glm4MoeForCausalLM's shared expert is n_shared_experts" in message


def test_mtp_depths_round_trip_as_the_files_mtp_layers(tmp_path):
    """GLM-4.5's MTP layer (num_nextn_predict_layers) is meshlm's MTP depth, named as DeepSeek-V3's."""
    torch.manual_seed(0)
    config = glm4_moe.config_from_hf(tiny_glm45().to_dict())
    config = ModelConfig(**{**config.to_dict(), "mtp_depth": 1, "mtp_pattern": "*E"})
    state = LanguageModel(config, seed=0).state_dict()
    hub = glm4_moe.state_to_hf(state, config)
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
            "model.layers.3.shared_head.head.weight", "model.layers.3.self_attn.q_norm.weight"} <= set(hub)
    assert glm4_moe.config_to_hf(config)["num_nextn_predict_layers"] == 1
    fitted = glm4_moe.ARCHITECTURE.fit_config(glm4_moe.config_from_hf({**tiny_glm45().to_dict(),
                                                                        "num_nextn_predict_layers": 1}), set(hub))
    assert fitted == config
    back = glm4_moe.state_from_hf(hub, fitted)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())
    with pytest.raises(ConfigError, match="MTP layers are attention then MoE"):
        glm4_moe.config_to_hf(ModelConfig(**{**config.to_dict(), "mtp_pattern": "*-"}))


def test_a_lora_models_peft_export_leaves_the_mtp_depths_adapters_out():
    config = glm4_moe.config_from_hf(tiny_glm45().to_dict())
    config = ModelConfig(**{**config.to_dict(), "mtp_depth": 1, "mtp_pattern": "*E", "lora_rank": 2})
    state = LanguageModel(config, seed=0).state_dict()
    stored = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
    assert any(name.startswith("mtp.") and ".lora." in name for name in state)
    _, plan = peft_adapter_plan(config, stored, state.__getitem__, glm4_moe.ARCHITECTURE)
    assert "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight" in plan
    assert not any(".layers.3." in key for key in plan)  # the MTP layer's
