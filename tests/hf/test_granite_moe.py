import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GraniteMoeConfig, GraniteMoeHybridConfig, GraniteMoeSharedConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, granite_moe  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      exported_logits_match, with_trained_norms_and_biases)

MUP = dict(embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=4.0)
MUP_FIELDS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def tiny(config_class, **overrides):
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6, **MUP)
    values.update(overrides)
    return config_class(**values)


def hybrid(**overrides):
    values = dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
                  shared_intermediate_size=24, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8,
                  mamba_chunk_size=8, position_embedding_type="nope")
    values.update(overrides)
    return tiny(GraniteMoeHybridConfig, **values)


def test_granite_moe_matches_transformers_and_round_trips(tmp_path):
    model = convert_and_compare(tiny(GraniteMoeConfig, attention_bias=True), tmp_path)
    config = model.config
    assert config.pattern == "*E*E" and (config.moe_score_function, config.moe_softmax_before_topk) == ("softmax", False)
    assert (config.embedding_multiplier, config.attention_scale, config.residual_multiplier,
            config.logit_divisor) == (6.0, 0.2, 0.5, 4.0)
    assert config.moe_shared_expert_ffn_hidden_size == 0 and config.attention_bias
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "intermediate_size", "num_local_experts",
                                    "num_experts_per_tok", "attention_bias", *MUP_FIELDS))


def test_granite_moe_shared_matches_transformers_and_round_trips(tmp_path):
    model = convert_and_compare(tiny(GraniteMoeSharedConfig, shared_intermediate_size=24), tmp_path)
    assert model.config.moe_shared_expert_ffn_hidden_size == 24
    assert_hf_round_trip(tmp_path, ("shared_intermediate_size", "intermediate_size", *MUP_FIELDS))


def test_granite_4_hybrid_mamba_attention_moe_matches_transformers_and_round_trips(tmp_path):
    """Granite 4.0-H's shape: Mamba-2 and attention layers without RoPE, each then MoE with a shared expert."""
    model = convert_and_compare(hybrid(), tmp_path, seq=20)
    config = model.config
    assert config.pattern == "ME*EME*E" and config.position_embedding == "none"
    assert (config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_size) == (8, 2, 8)
    assert config.moe_shared_expert_ffn_hidden_size == 24 and config.resolved_moe_ffn_hidden_size == 16
    assert_hf_round_trip(tmp_path, ("shared_intermediate_size", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                                    "mamba_d_state", "mamba_chunk_size", *MUP_FIELDS))
    written = json.loads((tmp_path / "hf_again" / "config.json").read_text())
    assert written["layer_types"] == ["linear_attention", "full_attention"] * 2


def test_a_dense_hybrid_with_rope_matches_transformers(tmp_path):
    """num_local_experts 0: the shared MLP alone is each layer's MLP; RoPE on the attention layers."""
    model = convert_and_compare(hybrid(num_local_experts=0, position_embedding_type="rope",
                                       layer_types=["linear_attention", "full_attention"] * 2), tmp_path, seq=20)
    assert model.config.pattern == "M-*-M-*-" and model.config.resolved_ffn_hidden_size == 24
    assert model.config.position_embedding == "rope"
    assert_hf_round_trip(tmp_path, ("num_local_experts", "position_embedding_type", "shared_intermediate_size"))


def test_transformers_in_memory_expert_names_are_read(tmp_path):
    config = granite_moe.MOE.config_from_hf(tiny(GraniteMoeConfig).to_dict())
    state = LanguageModel(config, seed=0).state_dict()
    hub = granite_moe.MOE.state_to_hf(state, config)
    v5 = {name.replace("block_sparse_moe.input_linear.weight", "block_sparse_moe.experts.gate_up_proj")
          .replace("block_sparse_moe.output_linear.weight", "block_sparse_moe.experts.down_proj")
          .replace("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"): tensor
          for name, tensor in hub.items()}
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in v5
    gate_up = hub["model.layers.0.block_sparse_moe.input_linear.weight"]
    assert torch.equal(gate_up[:, :16], state["blocks.1.mixer.experts.gate_weight"])  # the gate half first
    back = granite_moe.MOE.state_from_hf(v5, config)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())


def test_meshlm_hybrid_exports_as_granite_4_with_its_logits_and_round_trips(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="ME*E", num_attention_heads=4, num_kv_heads=2,
                         position_embedding="none", mamba_head_dim=8, mamba_num_groups=2, mamba_state_size=8,
                         mamba_chunk_size=8, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                         moe_softmax_before_topk=False, moe_shared_expert_ffn_hidden_size=24, residual_multiplier=0.5,
                         init_std=0.2)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == "GraniteMoeHybridForCausalLM"
    exported_logits_match(model, tmp_path)
    assert_meshlm_round_trip(model, tmp_path, "GraniteMoeHybridForCausalLM")


def test_what_the_granite_moe_classes_cannot_hold_is_named():
    base = dict(vocab_size=VOCAB, hidden_size=32, pattern="*E", num_attention_heads=4, moe_num_experts=4,
                moe_top_k=2, moe_ffn_hidden_size=16)
    with pytest.raises(ConfigError, match="moe_softmax_before_topk=True"):  # meshlm's default routing
        granite_moe.MOE.config_to_hf(ModelConfig(**base))
    after = dict(base, moe_softmax_before_topk=False)
    with pytest.raises(ConfigError, match="never have a shared expert"):
        granite_moe.MOE.config_to_hf(ModelConfig(**after, moe_shared_expert_ffn_hidden_size=8))
    with pytest.raises(ConfigError, match="always have a shared expert"):
        granite_moe.HYBRID.config_to_hf(ModelConfig(**after))
    with pytest.raises(ConfigError, match="layers are 'M' or '\\*' then"):
        granite_moe.HYBRID.config_to_hf(ModelConfig(**{**after, "pattern": "*E*-"}, moe_shared_expert_ffn_hidden_size=8))
    with pytest.raises(ConfigError, match="time_step_limit"):
        granite_moe.HYBRID.config_from_hf(hybrid(time_step_limit=[0.0, 10.0]).to_dict())
    with pytest.raises(ConfigError, match="layer_types must list"):
        granite_moe.HYBRID.config_from_hf({**hybrid().to_dict(), "layer_types": ["mamba", "conv"] * 2})
