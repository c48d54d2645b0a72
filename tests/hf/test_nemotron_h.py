import pytest
import torch

pytest.importorskip("transformers")
from transformers import NemotronHConfig  # noqa: E402

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.hf import nemotron_h  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      exported_logits_match)

LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def tiny_nemotron_h(pattern: str, **overrides) -> NemotronHConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, layers_block_type=[LAYER_TYPES[kind] for kind in pattern],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                  mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8,
                  time_step_min=0.02, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                  moe_shared_expert_intermediate_size=24, routed_scaling_factor=2.5, initializer_range=0.1)
    values.update(overrides)
    return NemotronHConfig(**values)


@pytest.mark.parametrize("pattern, overrides", [
    ("M*-ME", {}),
    ("ME*E", {"moe_latent_size": 16, "norm_topk_prob": False, "mlp_bias": True, "use_bias": True,
              "mlp_hidden_act": "relu", "n_groups": 1}),
], ids=["hybrid", "latent-moe-biases"])
def test_logits_match_transformers_and_round_trip(pattern, overrides, tmp_path):
    model = convert_and_compare(tiny_nemotron_h(pattern, **overrides), tmp_path, seq=21)
    config = model.config
    assert config.pattern == pattern and config.position_embedding == "none"
    assert config.moe_score_function == "sigmoid" and config.moe_routed_scaling_factor == 2.5
    assert config.moe_latent_size == overrides.get("moe_latent_size")
    assert config.mamba_dt_clamp_min == 0.02 and config.moe_shared_expert_ffn_hidden_size == 24
    expert_bias = model.blocks[pattern.index("E")].mixer.router.expert_bias
    assert expert_bias.abs().max() > 0  # the random correction bias made it across
    assert_hf_round_trip(tmp_path, ("layers_block_type", "head_dim", "mamba_num_heads", "n_groups", "ssm_state_size",
                                    "time_step_min", "n_routed_experts", "moe_latent_size", "norm_topk_prob",
                                    "routed_scaling_factor", "mlp_hidden_act", "use_bias", "mlp_bias"))


def test_model_prefixed_keys_and_legacy_config_names_are_accepted():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="ME", mamba_head_dim=8,
                         mlp_activation="squared_relu", moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8, moe_score_function="sigmoid",
                         moe_shared_expert_ffn_hidden_size=16, position_embedding="none")
    state = LanguageModel(config).state_dict()
    hub = nemotron_h.state_to_hf(state, config)
    in_memory = {name.replace("backbone.", "model.", 1): tensor for name, tensor in hub.items()}
    for name in ("up_proj", "down_proj"):  # fused [E, out, in] experts, as transformers holds them
        in_memory[f"model.layers.1.mixer.experts.{name}"] = torch.stack(
            [in_memory.pop(f"model.layers.1.mixer.experts.{e}.{name}.weight") for e in range(4)])
    back = nemotron_h.state_from_hf(in_memory, config)
    assert all(torch.equal(back[name], tensor) for name, tensor in state.items())
    legacy = nemotron_h.config_from_hf({"hybrid_override_pattern": "M-M*", "hidden_size": 32, "mamba_n_groups": 2,
                                        "mamba_d_conv": 3, "mamba_num_heads": 8, "mamba_head_dim": 8})
    assert legacy.pattern == "M-M*" and legacy.mamba_num_groups == 2 and legacy.mamba_conv_kernel == 3


def test_tied_meshlm_model_exports_an_explicit_head(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="M*E", mamba_head_dim=8, mamba_chunk_size=8,
                         position_embedding="none", mlp_activation="squared_relu", moe_num_experts=4, moe_top_k=2,
                         moe_ffn_hidden_size=16, moe_score_function="sigmoid", moe_shared_expert_ffn_hidden_size=16,
                         tie_embeddings=True, init_std=0.1)
    exported_logits_match(LanguageModel(config), tmp_path)


def test_meshlm_hybrid_round_trips_through_nemotron_h(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="M*-E", mamba_head_dim=8, mamba_state_size=8,
                         mamba_dt_clamp_min=0.001, position_embedding="none", mlp_activation="squared_relu",
                         ffn_hidden_size=40, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                         moe_score_function="sigmoid", moe_shared_expert_ffn_hidden_size=16, moe_latent_size=16,
                         moe_routed_scaling_factor=1.5, num_kv_heads=2)
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "NemotronHForCausalLM")


@pytest.mark.parametrize("field, value, message", [
    ("n_group", 2, "n_group=2 is not supported yet"),
    ("num_nextn_predict_layers", 1, "MTP layers are not supported yet"),
])
def test_unsupported_features_are_refused(field, value, message):
    with pytest.raises(ConfigError, match=message):
        nemotron_h.config_from_hf({"hybrid_override_pattern": "M*", field: value})


def test_rope_attention_cannot_be_written_as_nemotron_h():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="M*", mamba_head_dim=8)
    with pytest.raises(ConfigError, match="model.position_embedding='rope'"):
        nemotron_h.config_to_hf(config)
