"""``GPTJForCausalLM`` (GPT-J-6B) <-> meshlm: attention and MLP side by side through one LayerNorm,
RoPE on the first rotary_dim channels of each head in interleaved pairs (reordered into meshlm's
rotate-half pairs), biases on the MLP and the output head, none on the attention."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPTJConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gptj, phi  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      save_random_hf_model, with_trained_norms_and_biases)


def tiny_gptj(**overrides) -> GPTJConfig:
    values = dict(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, rotary_dim=8, n_inner=96, n_positions=64,
                  bos_token_id=0, eos_token_id=2)
    values.update(overrides)
    return GPTJConfig(**values)


@pytest.mark.parametrize("overrides", [{}, {"rotary_dim": 16, "activation_function": "gelu", "n_inner": None}],
                         ids=["gpt-j-like-quarter-rotary", "whole-head-rotary-exact-gelu"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_gptj(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert config.parallel_residual and config.parallel_residual_shared_norm and config.output_bias
    assert config.rotary_dim == hf_config.rotary_dim and not config.attention_bias and config.mlp_bias
    assert_hf_round_trip(tmp_path, ("n_layer", "n_head", "n_embd", "rotary_dim", "n_inner", "activation_function",
                                    "layer_norm_epsilon"))


def test_the_rotary_rows_are_reordered_not_renamed(tmp_path):
    """Row 1 of each head's q in meshlm (the second channel of the first rotate-half pair, j = 1)
    is GPT-J's row 2 (the first channel of its second interleaved pair); rows past rotary_dim stay."""
    hf_model = save_random_hf_model(tiny_gptj(), tmp_path / "hf")
    config = gptj.config_from_hf(tiny_gptj().to_dict())
    theirs = {name: tensor for name, tensor in hf_model.state_dict().items()}
    ours = gptj.state_from_hf(theirs, config)
    hf_q, q = theirs["transformer.h.0.attn.q_proj.weight"], ours["blocks.0.mixer.q_proj.weight"]
    assert torch.equal(q[1], hf_q[2]) and torch.equal(q[4], hf_q[1]) and torch.equal(q[16 + 5], hf_q[16 + 3])
    assert torch.equal(q[8:16], hf_q[8:16]) and not torch.equal(q[:8], hf_q[:8])
    assert torch.equal(ours["blocks.0.mixer.v_proj.weight"], theirs["transformer.h.0.attn.v_proj.weight"])


def test_a_gptj_shaped_meshlm_model_exports_as_gptj_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, norm="layernorm",
                         mlp_bias=True, mlp_activation="gelu_tanh", ffn_hidden_size=48, rope_fraction=0.5,
                         parallel_residual=True, parallel_residual_shared_norm=True, output_bias=True)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == gptj.NAME  # Phi's layer has attention biases; this has none
    assert "model.attention_bias=False (Phi has attention_bias=True)" in phi.ARCHITECTURE.unsupported(config)
    assert_meshlm_round_trip(model, tmp_path, gptj.NAME)


def test_what_gptj_cannot_hold_is_refused_by_name():
    base = {"architectures": [gptj.NAME], "n_embd": 32, "n_head": 4, "n_layer": 1}
    with pytest.raises(ConfigError, match="rotary_dim=None is not supported"):
        gptj.config_from_hf({**base, "rotary_dim": None})
    with pytest.raises(ConfigError, match="rotary_dim=12 is not supported.* the 8 channels"):
        gptj.config_from_hf({**base, "rotary_dim": 12})
    other_base = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, norm="layernorm",
                             mlp_bias=True, mlp_activation="gelu_tanh", parallel_residual=True,
                             parallel_residual_shared_norm=True, output_bias=True, rope_theta=500.0)
    with pytest.raises(ConfigError, match="model.rope_theta=500.0 .GPT-J has rope_theta=10000.0"):
        choose_architecture(other_base, requested=gptj.NAME)
