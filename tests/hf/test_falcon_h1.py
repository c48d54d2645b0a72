"""``FalconH1ForCausalLM`` <-> meshlm: attention and Mamba-2 side by side on one norm in every layer
(``"*M-"`` with a shared-norm parallel residual), Mamba mixers with or without their output norm
and an inner width of their own, and the muP multipliers folded into the weights on import."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import FalconH1Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, falcon_h1  # noqa: E402
from meshlm.inference.generate import generate  # noqa: E402
from meshlm.inference.sampling import SamplingConfig  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      exported_logits_match, with_trained_norms_and_biases)

MULTIPLIERS = dict(attention_in_multiplier=0.7, attention_out_multiplier=1.3, key_multiplier=0.6,
                   ssm_in_multiplier=1.4, ssm_out_multiplier=0.8, ssm_multipliers=[0.9, 1.2, 0.5, 1.7, 0.75],
                   mlp_multipliers=[1.25, 0.6], embedding_multiplier=2.5, lm_head_multiplier=0.4)


def tiny_falcon_h1(**overrides) -> FalconH1Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, mamba_d_ssm=48, mamba_n_heads=6, mamba_d_head="auto",
                  mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8, rms_norm_eps=1e-6,
                  max_position_embeddings=128)
    values.update(overrides)
    return FalconH1Config(**values)


@pytest.mark.parametrize("variant", ["multipliers", "gated_norm_biases_tied"])
def test_logits_match_transformers_and_the_export_computes_them_too(variant, tmp_path):
    overrides = dict(MULTIPLIERS) if variant == "multipliers" else dict(
        MULTIPLIERS, mamba_rms_norm=True, mamba_norm_before_gate=False, attention_bias=True, mlp_bias=True,
        mamba_proj_bias=True, projectors_bias=True, tie_word_embeddings=True)
    model = convert_and_compare(tiny_falcon_h1(**overrides), tmp_path, seq=20)
    config = model.config
    assert config.pattern == "*M-" * 3 and config.parallel_residual and config.parallel_residual_shared_norm
    assert config.mamba_inner_size == 48 and config.mamba_inner_size != config.mamba_expand * config.hidden_size
    assert config.mamba_gated_norm == (variant != "multipliers")
    assert (config.embedding_multiplier, config.logit_divisor) == (2.5, pytest.approx(1 / 0.4))
    exported_logits_match(model, tmp_path)  # folded, multipliers 1: the same function in transformers


def test_an_hf_folder_round_trips_tensor_for_tensor(tmp_path):
    convert_and_compare(tiny_falcon_h1(), tmp_path)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "mamba_d_ssm", "mamba_n_heads", "mamba_d_head",
                                    "mamba_n_groups", "mamba_d_state", "intermediate_size", "mamba_rms_norm"))


def falcon_h1_shaped(**overrides) -> ModelConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, pattern="*M-*M-", num_attention_heads=4, num_kv_heads=2,
                  mamba_head_dim=8, mamba_num_heads=6, mamba_num_groups=2, mamba_state_size=8, mamba_chunk_size=8,
                  ffn_hidden_size=48, parallel_residual=True, parallel_residual_shared_norm=True,
                  mamba_gated_norm=False, init_std=0.1)
    values.update(overrides)
    return ModelConfig(**values)


def test_a_meshlm_parallel_hybrid_exports_as_falcon_h1_and_decodes_with_its_cache(tmp_path):
    torch.manual_seed(0)
    model = with_trained_norms_and_biases(LanguageModel(falcon_h1_shaped()))
    assert choose_architecture(model.config).name == "FalconH1ForCausalLM"
    assert_meshlm_round_trip(model, tmp_path, "FalconH1ForCausalLM")
    prompt, tokens = [5, 17, 3, 42, 8, 1, 60], []
    with torch.no_grad():  # greedy by a full forward every step against the cached decoding
        for _ in range(10):
            tokens.append(int(model.eval()(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    assert generate(model, [prompt], 10, SamplingConfig(greedy=True)) == [tokens]


def test_what_falcon_h1_cannot_hold_is_named():
    with pytest.raises(ConfigError, match="parallel_residual_shared_norm must both be true"):
        falcon_h1.config_to_hf(falcon_h1_shaped(parallel_residual_shared_norm=False))
    with pytest.raises(ConfigError, match="'\\*M-' per layer"):
        falcon_h1.config_to_hf(falcon_h1_shaped(pattern="*M-M-"))
    with pytest.raises(ConfigError, match="mamba_norm_before_gate=true normalizes before the gate"):
        falcon_h1.config_from_hf(tiny_falcon_h1(mamba_rms_norm=True, mamba_norm_before_gate=True).to_dict())
    with pytest.raises(ConfigError, match="mamba_proj_bias=True .* and projectors_bias=False"):
        falcon_h1.config_from_hf(tiny_falcon_h1(mamba_proj_bias=True).to_dict())


def test_attention_falcon_h1_cannot_hold_is_named_too():
    with pytest.raises(ConfigError, match="qk_norm=True"):
        falcon_h1.config_to_hf(falcon_h1_shaped(qk_norm=True))
    with pytest.raises(ConfigError, match="rope_fraction"):
        falcon_h1.config_to_hf(falcon_h1_shaped(rope_fraction=0.5))
