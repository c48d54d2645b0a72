"""``Gemma2ForCausalLM`` <-> meshlm: Gemma 3's layer without QK-norm, alternating sliding and full
attention with one RoPE, and soft-capped attention scores and output logits."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Gemma2Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gemma2, gemma3  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare, random_ids  # noqa: E402

ATTENTION_CAP, LOGIT_CAP = 0.5, 1.5
"""Caps small enough to bend a tiny random model's scores and logits (Gemma 2's are 50 and 30, for
scores and logits of that size)."""


def tiny_gemma2(**overrides) -> Gemma2Config:
    """Four layers, sliding and full in turn; a window of 5 under the 24 tokens compared."""
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=5, rms_norm_eps=1e-6,
                  attn_logit_softcapping=ATTENTION_CAP, final_logit_softcapping=LOGIT_CAP,
                  attn_implementation="eager")
    values.update(overrides)
    return Gemma2Config(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": False, "rope_theta": 5e5},
    {"attn_logit_softcapping": None, "final_logit_softcapping": None, "query_pre_attn_scalar": 24},
], ids=["gemma2-like", "untied-other-base", "uncapped-27b-scale"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_gemma2(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.pattern, config.mlp_activation, config.qk_norm) == ("*-" * 4, "geglu", False)
    assert config.block_output_norm and config.norm_zero_centered and config.embedding_multiplier == 32 ** 0.5
    assert (config.sliding_window, config.sliding_window_pattern) == (5, "SF")
    assert (config.attention_softcap, config.final_logit_softcap) == (
        hf_config.attn_logit_softcapping, hf_config.final_logit_softcapping)
    assert config.attention_scale == (None if hf_config.query_pre_attn_scalar == 16 else 24 ** -0.5)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "head_dim", "sliding_window", "layer_types",
                                    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                                    "tie_word_embeddings"))
    if config.final_logit_softcap is not None:  # the caps bend this model: without them its logits differ
        uncapped = LanguageModel(dataclasses.replace(config, attention_softcap=None, final_logit_softcap=None))
        uncapped.load_state_dict(model.state_dict())
        ids = random_ids()
        with torch.no_grad():
            capped_logits, plain_logits = model(ids).logits, uncapped.eval()(ids).logits
        assert capped_logits.abs().max() < LOGIT_CAP
        assert (capped_logits - plain_logits).abs().max() > 0.1


def test_caps_left_out_are_the_class_defaults_and_null_caps_are_none():
    base = {"architectures": [gemma2.NAME], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "query_pre_attn_scalar": 8, "num_hidden_layers": 3}
    config = gemma2.config_from_hf(base)
    assert (config.attention_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert (config.sliding_window, config.sliding_window_pattern) == (4096, "SF")  # layers 0 and 2 slide
    assert [config.attention_window(index) for index in config.attention_blocks] == [4096, None, 4096]
    config = gemma2.config_from_hf({**base, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (config.attention_softcap, config.final_logit_softcap) == (None, None)
    with pytest.raises(ConfigError, match="hidden_activation='gelu' is not supported"):
        gemma2.config_from_hf({**base, "hidden_activation": "gelu"})


def test_gemma3_reads_and_writes_the_logit_cap_and_ignores_the_attention_cap_as_transformers_does(tmp_path):
    """transformers' Gemma 3 applies final_logit_softcapping and never reads attn_logit_softcapping."""
    from transformers import Gemma3TextConfig

    hf_config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                 sliding_window=5, attn_logit_softcapping=ATTENTION_CAP,
                                 final_logit_softcapping=LOGIT_CAP, attn_implementation="eager")
    model = convert_and_compare(hf_config, tmp_path)
    assert (model.config.attention_softcap, model.config.final_logit_softcap) == (None, LOGIT_CAP)
    assert_hf_round_trip(tmp_path, ("final_logit_softcapping",))
    capped_attention = dataclasses.replace(model.config, attention_softcap=ATTENTION_CAP)
    with pytest.raises(ConfigError, match=r"model.attention_softcap=0.5 \(only Gemma2ForCausalLM"):
        choose_architecture(capped_attention, requested=gemma3.NAME)


def test_a_meshlm_gemma2_style_model_exports_as_gemma2_and_others_refuse_its_caps(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         head_dim=16, ffn_hidden_size=40, mlp_activation="geglu", block_output_norm=True,
                         norm_zero_centered=True, embedding_multiplier=32 ** 0.5, tie_embeddings=True,
                         sliding_window=6, sliding_window_pattern="SF", attention_softcap=2.0,
                         final_logit_softcap=3.0)
    model = LanguageModel(config)
    with torch.no_grad():  # trained norms: a mapping mistake cannot hide behind zeros
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    assert choose_architecture(config).name == gemma2.NAME
    assert_meshlm_round_trip(model, tmp_path, gemma2.NAME)
    assert choose_architecture(dataclasses.replace(config, qk_norm=True, attention_softcap=None)).name == gemma3.NAME
    llama_like = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4,
                             final_logit_softcap=30.0)
    with pytest.raises(ConfigError, match=r"model.final_logit_softcap=30.0 \(only Gemma2ForCausalLM"):
        choose_architecture(llama_like, requested="LlamaForCausalLM")
