"""``Cohere2ForCausalLM`` (Command R7B, Command A) <-> meshlm: Command R's parallel layer, three
sliding layers with RoPE to one full layer without (``model.sliding_window_pattern`` with
``model.rope_pattern``, letter for letter)."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Cohere2Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, cohere2  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      random_ids)


def tiny_cohere2(**overrides) -> Cohere2Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, logit_scale=0.25, sliding_window=5, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    values.update(overrides)
    return Cohere2Config(**values)


@pytest.mark.parametrize("overrides, windows, rope_pattern", [
    ({}, "SSSF", "RRRN"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 2, "attention_bias": True, "tie_word_embeddings": False,
      "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}, "SF", "RN"),
], ids=["command-a-like", "alternating-biased-untied"])
def test_logits_match_transformers_and_round_trip(overrides, windows, rope_pattern, tmp_path):
    hf_config = tiny_cohere2(**overrides)
    model = convert_and_compare(hf_config, tmp_path, seq=24)  # past the window of 5
    config = model.config
    assert config.parallel_residual and config.parallel_residual_shared_norm and not config.norm_bias
    assert (config.sliding_window, config.sliding_window_pattern, config.rope_pattern) == (5, windows, rope_pattern)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "logit_scale",
                                    "layer_norm_eps", "attention_bias", "rope_parameters", "layer_types",
                                    "sliding_window"))


def test_the_full_layers_without_rope_matter(tmp_path):
    """The comparison above is not vacuous: the same weights rotating in every layer differ."""
    model = convert_and_compare(tiny_cohere2(), tmp_path, seq=24)
    rotating = LanguageModel(dataclasses.replace(model.config, rope_pattern="R"))
    rotating.load_state_dict(model.state_dict())
    ids = random_ids(seq=24)
    with torch.no_grad():
        assert not torch.allclose(rotating(ids).logits, model(ids).logits, atol=1e-3)


def test_older_files_with_sliding_window_pattern_import():
    config = cohere2.config_from_hf({"architectures": [cohere2.NAME], "hidden_size": 32, "num_attention_heads": 4,
                                     "num_hidden_layers": 6, "sliding_window_pattern": 3, "sliding_window": 8})
    assert (config.sliding_window_pattern, config.rope_pattern) == ("SSF", "RRN")


def test_a_command_a_shaped_meshlm_model_exports_as_cohere2_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-" * 4, num_attention_heads=4, num_kv_heads=2,
                         norm="layernorm", norm_bias=False, parallel_residual=True, parallel_residual_shared_norm=True,
                         logit_divisor=4.0, tie_embeddings=True, ffn_hidden_size=48, sliding_window=6,
                         sliding_window_pattern="SSSF", rope_pattern="RRRN")
    model = LanguageModel(config)
    with torch.no_grad():  # trained norms: a mapping mistake cannot hide behind ones
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    assert choose_architecture(config).name == cohere2.NAME
    assert_meshlm_round_trip(model, tmp_path, cohere2.NAME)


def test_rope_that_does_not_follow_the_windows_is_refused_by_name():
    mismatched = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-" * 2, num_attention_heads=4,
                             norm="layernorm", norm_bias=False, parallel_residual=True,
                             parallel_residual_shared_norm=True, sliding_window=6, sliding_window_pattern="SF",
                             rope_pattern="NR")
    with pytest.raises(ConfigError, match="Cohere2 rotates exactly its sliding layers"):
        choose_architecture(mismatched, requested=cohere2.NAME)
    with pytest.raises(ConfigError, match="layer_types=.*must name 2 layers"):
        cohere2.config_from_hf({"architectures": [cohere2.NAME], "hidden_size": 32, "num_attention_heads": 4,
                                "num_hidden_layers": 2, "layer_types": ["sliding_attention"]})
