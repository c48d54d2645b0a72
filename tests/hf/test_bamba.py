"""``BambaForCausalLM`` <-> meshlm: Mamba-2 layers and attention layers (half of each head rotated),
each followed by a SwiGLU MLP."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import BambaConfig  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import bamba, choose_architecture  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      with_trained_norms_and_biases)


def tiny_bamba(**overrides) -> BambaConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=8, mamba_d_head=8,
                  mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8, rms_norm_eps=1e-6)
    values.update(overrides)
    return BambaConfig(**values)


@pytest.mark.parametrize("biases", [False, True])
def test_logits_match_transformers_and_round_trip(biases, tmp_path):
    model = convert_and_compare(tiny_bamba(attention_bias=biases, mlp_bias=biases), tmp_path, seq=20)
    config = model.config
    assert config.pattern == "M-*-M-*-" and config.rope_fraction == 0.5
    assert (config.attention_bias, config.mlp_bias) == (biases, biases)
    assert (config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_size) == (8, 2, 8)
    assert_hf_round_trip(tmp_path, ("attn_layer_indices", "mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                                    "mamba_d_state", "attention_bias", "mlp_bias", "intermediate_size"))


def test_meshlm_hybrid_with_mlps_exports_as_bamba(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="M-*-", num_attention_heads=4, num_kv_heads=2,
                         rope_fraction=0.5, mamba_head_dim=8, mamba_num_groups=2, mamba_state_size=8,
                         mamba_chunk_size=8, ffn_hidden_size=48)
    assert choose_architecture(config).name == "BambaForCausalLM"
    assert_meshlm_round_trip(with_trained_norms_and_biases(LanguageModel(config)), tmp_path, "BambaForCausalLM")


def test_what_bamba_cannot_hold_is_named():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="M-*-", num_attention_heads=4, mamba_head_dim=8,
                         mamba_num_groups=2, mamba_state_size=8)
    with pytest.raises(ConfigError, match="rope_fraction=1.0"):
        bamba.config_to_hf(config)
