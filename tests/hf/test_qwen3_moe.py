import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig  # noqa: E402

from meshlm.errors import CheckpointError  # noqa: E402
from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.hf import qwen3_moe  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


def tiny_qwen3_moe(**overrides) -> Qwen3MoeConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                  mlp_only_layers=[1], rms_norm_eps=1e-6)
    values.update(overrides)
    return Qwen3MoeConfig(**values)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_match_transformers_and_round_trip(norm_topk_prob, tmp_path):
    model = convert_and_compare(tiny_qwen3_moe(norm_topk_prob=norm_topk_prob), tmp_path)
    config = model.config
    assert config.pattern == "*E*-*E" and config.qk_norm and config.moe_normalize_topk == norm_topk_prob
    assert config.resolved_head_dim == 16 and config.moe_num_experts == 6
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "head_dim", "intermediate_size", "moe_intermediate_size",
                                    "num_experts_per_tok", "norm_topk_prob", "mlp_only_layers", "rope_parameters"))


def test_a_sliding_window_in_every_layer_matches_transformers_and_round_trips(tmp_path):
    model = convert_and_compare(tiny_qwen3_moe(use_sliding_window=True, sliding_window=5), tmp_path)
    assert (model.config.sliding_window, model.config.sliding_window_pattern) == (5, "S")
    assert_hf_round_trip(tmp_path, ("use_sliding_window", "sliding_window"))


def test_decoder_sparse_step_picks_the_moe_layers():
    config = qwen3_moe.config_from_hf({"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4,
                                       "decoder_sparse_step": 2, "num_experts": 4, "num_experts_per_tok": 2})
    assert config.pattern == "*-*E*-*E"


def test_fused_expert_layout_is_accepted():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E", num_attention_heads=4, qk_norm=True,
                         moe_num_experts=3, moe_top_k=2, moe_ffn_hidden_size=8)
    state = LanguageModel(config).state_dict()
    hub = qwen3_moe.state_to_hf(state, config)
    gate = torch.stack([hub[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in range(3)])
    up = torch.stack([hub[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(3)])
    down = torch.stack([hub[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(3)])
    fused = {name: tensor for name, tensor in hub.items() if ".experts." not in name}
    fused["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat((gate, up), dim=1)
    fused["model.layers.0.mlp.experts.down_proj"] = down
    back = qwen3_moe.state_from_hf(fused, config)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_missing_expert_is_named():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E", num_attention_heads=4, qk_norm=True,
                         moe_num_experts=3, moe_top_k=2, moe_ffn_hidden_size=8)
    hub = qwen3_moe.state_to_hf(LanguageModel(config).state_dict(), config)
    del hub["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors model\.layers\.0\.mlp\.experts\.2\.up_proj\.weight"):
        qwen3_moe.state_from_hf(hub, config)


def test_meshlm_moe_round_trips_and_sigmoid_router_is_refused(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*E*-", num_attention_heads=4, qk_norm=True,
                         ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16,
                         moe_normalize_topk=True, moe_aux_loss_coeff=0.01)
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "Qwen3MoeForCausalLM")
    sigmoid = ModelConfig(**{**config.to_dict(), "moe_score_function": "sigmoid"})
    with pytest.raises(ConfigError, match="moe_score_function='sigmoid'"):
        qwen3_moe.config_to_hf(sigmoid)
