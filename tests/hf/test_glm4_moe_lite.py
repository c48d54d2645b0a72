"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``, meshlm/hf/glm4_moe_lite.py): DeepSeek-V3's layer read
from a random transformers model with the logits transformers computes (latent attention, block
norms at 1e-5 beside latent norms at 1e-6, group-limited sigmoid routing, the shared expert), and
the round trip; ``mlp_layer_types`` read and refused where meshlm's layout cannot hold it; a meshlm
model exported as the class and read back."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Glm4MoeLiteConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import glm4_moe_lite  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      exported_logits_match)


def tiny_glm4_moe_lite(**overrides) -> Glm4MoeLiteConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                  kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_group=2,
                  topk_group=1, rms_norm_eps=1e-2,  # a block eps far from the latent norms' 1e-6: both must be right
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    values.update(overrides)
    return Glm4MoeLiteConfig(**values)


def test_logits_match_transformers_and_round_trip(tmp_path):
    model = convert_and_compare(tiny_glm4_moe_lite(), tmp_path)
    config = model.config
    assert config.pattern == "*-*E*E" and config.attention_type == "mla" and config.mla_q_lora_rank == 24
    assert (config.norm_eps, config.mla_latent_norm_eps) == (1e-2, 1e-6)
    assert (config.moe_score_function, config.moe_router_num_groups, config.moe_routed_scaling_factor) == (
        "sigmoid", 2, 1.8)
    assert config.moe_shared_expert_ffn_hidden_size == 16
    assert_hf_round_trip(tmp_path, ("mlp_layer_types", "num_hidden_layers", "q_lora_rank", "kv_lora_rank",
                                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
                                    "routed_scaling_factor", "rms_norm_eps", "rope_parameters", "rope_interleave"))


def test_mlp_layer_types_choose_the_dense_layers_and_a_sparse_first_layout_is_refused():
    hf = tiny_glm4_moe_lite(num_hidden_layers=4).to_dict()
    assert glm4_moe_lite.config_from_hf({**hf, "mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}).pattern \
        == "*-*-*E*E"
    without = {key: value for key, value in hf.items() if key != "mlp_layer_types"}
    assert glm4_moe_lite.config_from_hf(without).pattern == "*-*E*E*E"  # transformers' default: the first dense
    assert glm4_moe_lite.config_from_hf({**without, "first_k_dense_replace": 2}).pattern == "*-*-*E*E"
    with pytest.raises(ConfigError, match="puts a dense layer after a sparse one"):
        glm4_moe_lite.config_from_hf({**hf, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})
    with pytest.raises(ConfigError, match="must name 4 layers"):
        glm4_moe_lite.config_from_hf({**hf, "mlp_layer_types": ["dense", "sparse"]})


def test_meshlm_model_exports_as_glm4_moe_lite_when_asked(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*E*E", num_attention_heads=4,
                         attention_type="mla", mla_q_lora_rank=24, mla_kv_lora_rank=16, mla_qk_nope_head_dim=8,
                         mla_qk_rope_head_dim=4, mla_v_head_dim=8, ffn_hidden_size=48, norm_eps=1e-5,
                         mla_latent_norm_eps=1e-6, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                         moe_shared_expert_ffn_hidden_size=16, moe_score_function="sigmoid", moe_normalize_topk=True,
                         moe_routed_scaling_factor=1.8, init_std=0.2)
    model = LanguageModel(config)
    with torch.no_grad():
        for block in (3, 5):
            model.blocks[block].mixer.router.expert_bias.normal_(0.0, 0.5)
    assert_meshlm_round_trip(model, tmp_path, "Glm4MoeLiteForCausalLM", imported_from="Glm4MoeLiteForCausalLM")
    exported_logits_match(model, tmp_path)
    with pytest.raises(ConfigError, match=r"model.mla_latent_norm_eps=None with model.norm_eps=1e-05 "
                                          r"\(Glm4MoeLiteForCausalLM's latent norms always use 1e-06"):
        glm4_moe_lite.config_to_hf(ModelConfig(**{**config.to_dict(), "mla_latent_norm_eps": None}))
