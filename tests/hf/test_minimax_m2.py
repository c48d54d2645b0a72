"""MiniMax-M2 (``MiniMaxM2ForCausalLM``, meshlm/hf/minimax_m2.py): a random transformers model's
logits (QK-norm over all heads, partial RoPE, sigmoid routing with the score-correction bias)
reproduced after import, and the round trip; the multi-token-prediction layers the released
folders carry past the last layer left out; the hub's ``rotary_dim`` read; a meshlm model exported
and read back; the refusals."""

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import MiniMaxM2Config  # noqa: E402

from meshlm.checkpoint.model_files import load_model  # noqa: E402
from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, hf_to_meshlm, minimax_m2  # noqa: E402
from meshlm.hf.files import write_hf_folder  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      exported_logits_match, random_ids, with_trained_norms_and_biases)


def tiny_minimax_m2(**overrides) -> MiniMaxM2Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, rotary_dim=4,
                  bos_token_id=None, eos_token_id=None)
    values.update(overrides)
    return MiniMaxM2Config(**values)


def test_logits_match_transformers_and_round_trip(tmp_path):
    model = convert_and_compare(tiny_minimax_m2(), tmp_path)
    config = model.config
    assert config.pattern == "*E*E" and (config.qk_norm, config.qk_norm_scope, config.rope_fraction) == (True, "all",
                                                                                                          0.5)
    assert (config.moe_score_function, config.moe_normalize_topk) == ("sigmoid", True)
    assert model.blocks[1].mixer.router.expert_bias.abs().sum() > 0  # the score-correction bias, read
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "intermediate_size", "num_local_experts", "rotary_dim",
                                    "num_experts_per_tok", "rope_parameters", "head_dim"))


def test_the_hubs_rotary_dim_and_the_mtp_layers_past_the_last_layer(tmp_path):
    """The released config.json gives ``rotary_dim`` and a v4 ``rope_theta``, no rope_parameters; its
    folders hold the MTP modules as layers past ``num_hidden_layers``, which import leaves out."""
    model = convert_and_compare(tiny_minimax_m2(), tmp_path)  # (also writes tmp_path / "hf")
    hub_config = {key: value for key, value in tiny_minimax_m2().to_dict().items() if key != "rope_parameters"}
    hub_config.update(rope_theta=5e6, architectures=["MiniMaxM2ForCausalLM"], use_mtp=True, num_mtp_modules=1)
    assert minimax_m2.config_from_hf(hub_config).rope_fraction == 0.5
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors.update({"model.layers.2.self_attn.q_proj.weight": torch.zeros(32, 32),
                    "model.layers.2.block_sparse_moe.gate.weight": torch.zeros(4, 32)})
    write_hf_folder(tmp_path / "hub", hub_config, tensors)
    out, _, _ = hf_to_meshlm(tmp_path / "hub", tmp_path / "from_hub")
    imported = load_model(out)
    assert imported.config.num_blocks == 4
    with torch.no_grad():
        assert torch.equal(imported(random_ids()).logits, model(random_ids()).logits)


def meshlm_minimax_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, pattern="*E*E", num_attention_heads=4, num_kv_heads=2,
                  qk_norm=True, qk_norm_scope="all", rope_fraction=0.5, rope_theta=5e6, moe_num_experts=4,
                  moe_top_k=2, moe_ffn_hidden_size=16, moe_score_function="sigmoid", moe_normalize_topk=True,
                  moe_aux_loss_coeff=0.01, init_std=0.2)
    values.update(overrides)
    return ModelConfig(**values)


def test_meshlm_model_exports_as_minimax_m2(tmp_path):
    torch.manual_seed(0)
    model = with_trained_norms_and_biases(LanguageModel(meshlm_minimax_config()))
    with torch.no_grad():
        for block in (1, 3):
            model.blocks[block].mixer.router.expert_bias.normal_(0.0, 0.5)
    assert_meshlm_round_trip(model, tmp_path, "MiniMaxM2ForCausalLM")
    exported_logits_match(model, tmp_path)


def test_what_minimax_m2_cannot_hold_is_refused():
    with pytest.raises(ConfigError, match=r"model.moe_score_function='softmax' \(MiniMax-M2 has"):
        minimax_m2.config_to_hf(meshlm_minimax_config(moe_score_function="softmax"))
    with pytest.raises(ConfigError, match=r"model.qk_norm_scope='head' \(MiniMax-M2 has qk_norm_scope='all'\)"):
        minimax_m2.config_to_hf(meshlm_minimax_config(qk_norm_scope="head"))
    with pytest.raises(ConfigError, match=r"model.moe_shared_expert_ffn_hidden_size=16 \(MiniMax-M2 has"):
        minimax_m2.config_to_hf(meshlm_minimax_config(moe_shared_expert_ffn_hidden_size=16))
    with pytest.raises(ConfigError, match="hidden_act='gelu'"):
        minimax_m2.config_from_hf({**tiny_minimax_m2().to_dict(), "hidden_act": "gelu"})
    assert choose_architecture(meshlm_minimax_config()).name == "MiniMaxM2ForCausalLM"  # chosen unnamed

