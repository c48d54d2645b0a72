"""``Qwen2ForCausalLM`` (Qwen2, Qwen2.5) <-> meshlm: Llama's layer with biases on q/k/v and none
on o (``model.attention_output_bias=false``)."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen2Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, qwen2  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 500.0}


def tiny_qwen2(**overrides) -> Qwen2Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    values.update(overrides)
    return Qwen2Config(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True, "num_key_value_heads": 1},
    {"rope_parameters": YARN, "max_position_embeddings": 32},  # 24 tokens run past the original 8
], ids=["plain", "tied-mqa", "yarn"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(tiny_qwen2(**overrides), tmp_path, seq=24)
    config = model.config
    assert config.attention_bias and config.attention_output_bias is False and not config.qk_norm
    assert model.blocks[0].mixer.q_proj.bias is not None and model.blocks[0].mixer.o_proj.bias is None
    assert config.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                    "intermediate_size", "rms_norm_eps", "use_sliding_window",
                                    "max_position_embeddings", "bos_token_id", "eos_token_id"))


def test_meshlm_model_with_biases_on_qkv_only_exports_as_qwen2(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=40, attention_bias=True, attention_output_bias=False, rope_theta=1234.0)
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, qwen2.NAME)
    both = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, attention_bias=True)
    assert choose_architecture(both).name == "LlamaForCausalLM"  # biases on all four: Llama's layout


HF_BASE = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2}


def test_sliding_window_layers_and_the_window_ignored_while_off():
    config = qwen2.config_from_hf({**HF_BASE, "use_sliding_window": False, "sliding_window": 4096,
                                   "max_window_layers": 1, "layer_types": ["full_attention", "sliding_attention"]})
    assert config.pattern == "*-*-" and config.sliding_window is None  # transformers: sliding off, full everywhere
    upper = qwen2.config_from_hf({**HF_BASE, "num_hidden_layers": 4, "use_sliding_window": True,
                                  "sliding_window": 64, "max_window_layers": 1})
    assert (upper.sliding_window, upper.sliding_window_pattern) == (64, "FSSS")  # layers from max_window_layers on
    alternating = qwen2.config_from_hf({**HF_BASE, "num_hidden_layers": 4, "use_sliding_window": True,
                                        "sliding_window": 64,
                                        "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert alternating.sliding_window_pattern == "SF"  # the shortest repeating pattern
    none_slide = qwen2.config_from_hf({**HF_BASE, "use_sliding_window": True, "sliding_window": 64})
    assert none_slide.sliding_window is None  # max_window_layers defaults to 28: no layer of 2 slides
    with pytest.raises(ConfigError, match="layer_types=.* must name 2 layers, each 'sliding_attention' or"):
        qwen2.config_from_hf({**HF_BASE, "use_sliding_window": True, "layer_types": ["chunked_attention"] * 2})


@pytest.mark.parametrize("window_fields", [
    {"max_window_layers": 1},  # layers 1 and 2 slide
    {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
], ids=["max-window-layers", "layer-types"])
def test_sliding_window_layers_match_transformers_and_round_trip(window_fields, tmp_path):
    hf_config = tiny_qwen2(use_sliding_window=True, sliding_window=5, **window_fields)
    model = convert_and_compare(hf_config, tmp_path, seq=24)
    windows = [block.mixer.window for block in model.blocks if block.kind == "*"]
    assert windows == [5 if kind == "sliding_attention" else None for kind in hf_config.layer_types]
    assert_hf_round_trip(tmp_path, ("use_sliding_window", "sliding_window", "layer_types"))


def test_unexpressible_config_names_the_blocking_fields():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, mlp_bias=True)
    with pytest.raises(ConfigError) as error:
        qwen2.config_to_hf(config)
    assert "model.attention_bias=False" in str(error.value) and "model.mlp_bias=True" in str(error.value)
