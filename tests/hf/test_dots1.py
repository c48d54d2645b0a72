"""``Dots1ForCausalLM`` <-> meshlm: Qwen3's attention (a QK-norm per head), dense first layers, then
DeepSeek-V3's MoE block; sliding layers from max_window_layers on."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Dots1Config  # noqa: E402

from meshlm.hf import choose_architecture  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


def tiny_dots1(**overrides) -> Dots1Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, sliding_window=None, rms_norm_eps=1e-6)
    values.update(overrides)
    return Dots1Config(**values)


def test_logits_match_transformers_and_round_trip(tmp_path):
    model = convert_and_compare(tiny_dots1(), tmp_path)
    config = model.config
    assert config.pattern == "*-*E*E" and config.qk_norm and config.sliding_window is None
    assert (config.moe_score_function, config.moe_router_num_groups, config.moe_shared_expert_ffn_hidden_size) == (
        "sigmoid", 2, 16)
    assert model.blocks[3].mixer.router.expert_bias.abs().sum() > 0
    assert_hf_round_trip(tmp_path, ("first_k_dense_replace", "n_routed_experts", "n_shared_experts", "n_group",
                                    "topk_group", "routed_scaling_factor", "norm_topk_prob", "head_dim"))


def test_sliding_layers_from_max_window_layers_match_transformers(tmp_path):
    model = convert_and_compare(tiny_dots1(sliding_window=5, max_window_layers=1), tmp_path)
    assert [model.config.for_block(block).sliding_window for block in (0, 2, 4)] == [None, 5, 5]
    assert_hf_round_trip(tmp_path, ("sliding_window", "layer_types"))


def test_meshlm_sigmoid_moe_with_qk_norm_exports_as_dots1(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*E", num_attention_heads=4, num_kv_heads=2,
                         qk_norm=True, ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8,
                         moe_shared_expert_ffn_hidden_size=8, moe_score_function="sigmoid", init_std=0.2)
    assert choose_architecture(config).name == "Dots1ForCausalLM"
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "Dots1ForCausalLM")
