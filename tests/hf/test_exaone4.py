"""``Exaone4ForCausalLM`` (EXAONE 4.0) <-> meshlm: OLMo 2's norms after the sublayers, a QK-norm of each
head, and with a window three sliding layers with RoPE to one full layer without."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Exaone4Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, exaone4  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


def tiny_exaone4(**overrides) -> Exaone4Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return Exaone4Config(**values)


@pytest.mark.parametrize("overrides, windows, rope_pattern", [
    ({}, (5, "SSSF"), "RRRN"),
    ({"sliding_window": None, "layer_types": ["full_attention"] * 4, "tie_word_embeddings": True,
      "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, (None, "S"), "R"),
], ids=["exaone4-32b-like-hybrid", "exaone4-1.2b-like-full-tied"])
def test_logits_match_transformers_and_round_trip(overrides, windows, rope_pattern, tmp_path):
    model = convert_and_compare(tiny_exaone4(**overrides), tmp_path, seq=24)  # past the window of 5
    config = model.config
    assert not config.block_input_norm and config.block_output_norm and config.qk_norm
    assert (config.sliding_window, config.sliding_window_pattern) == windows and config.rope_pattern == rope_pattern
    assert model.blocks[0].mixer.q_norm.weight.shape == (8,)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
                                    "layer_types", "sliding_window", "rope_parameters"))


def test_an_exaone4_shaped_meshlm_model_exports_as_exaone4_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-" * 4, num_attention_heads=4, num_kv_heads=2,
                         qk_norm=True, block_input_norm=False, block_output_norm=True, ffn_hidden_size=48,
                         sliding_window=6, sliding_window_pattern="SSSF", rope_pattern="RRRN")
    model = LanguageModel(config)
    with torch.no_grad():  # trained norms: a mapping mistake cannot hide behind ones
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    assert choose_architecture(config).name == exaone4.NAME
    assert_meshlm_round_trip(model, tmp_path, exaone4.NAME)


def test_rope_that_does_not_follow_the_windows_is_refused_by_name():
    mismatched = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-" * 2, num_attention_heads=4, qk_norm=True,
                             block_input_norm=False, block_output_norm=True, sliding_window=6,
                             sliding_window_pattern="SF")
    with pytest.raises(ConfigError, match="EXAONE 4.0 rotates exactly its sliding layers"):
        choose_architecture(mismatched, requested=exaone4.NAME)
