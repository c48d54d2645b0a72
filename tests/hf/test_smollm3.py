"""``SmolLM3ForCausalLM`` <-> meshlm: Llama's layer with every fourth layer (``no_rope_layers``)
unrotated -- ``model.rope_pattern`` -- and sliding layers where ``layer_types`` says."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")
from transformers import SmolLM3Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, smollm3  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      random_ids)


def tiny_smollm3(**overrides) -> SmolLM3Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    values.update(overrides)
    return SmolLM3Config(**values)


@pytest.mark.parametrize("overrides, rope_pattern, window", [
    ({}, "RRRN", None),
    ({"no_rope_layers": [0, 1, 0, 1], "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True,
      "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, "NR", None),
    ({"use_sliding_window": True, "sliding_window": 5}, "RRRN", (5, "FFFS")),  # the NoPE layer slides
], ids=["smollm3-like", "alternating-biased-untied", "sliding-nope-layer"])
def test_logits_match_transformers_and_round_trip(overrides, rope_pattern, window, tmp_path):
    hf_config = tiny_smollm3(**overrides)
    model = convert_and_compare(hf_config, tmp_path, seq=24)
    config = model.config
    assert config.pattern == "*-" * 4 and config.rope_pattern == rope_pattern
    assert (config.sliding_window, config.sliding_window_pattern) == (window or (None, "S"))
    assert config.tie_embeddings == hf_config.tie_word_embeddings and config.mlp_bias == hf_config.mlp_bias
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "no_rope_layers",
                                    "layer_types", "use_sliding_window", "sliding_window", "attention_bias",
                                    "mlp_bias", "rope_parameters"))


def test_the_unrotated_layers_matter(tmp_path):
    """The comparison above is not vacuous: the same weights with RoPE in every layer differ."""
    model = convert_and_compare(tiny_smollm3(), tmp_path)
    rotating = LanguageModel(dataclasses.replace(model.config, rope_pattern="R"))
    rotating.load_state_dict(model.state_dict())
    ids = random_ids(seq=24)
    with torch.no_grad():
        assert not torch.allclose(rotating(ids).logits, model(ids).logits, atol=1e-3)


def test_a_meshlm_model_with_unrotated_blocks_exports_as_smollm3_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-" * 3, num_attention_heads=4, num_kv_heads=2,
                         rope_pattern="RNN", sliding_window=6, sliding_window_pattern="SFF", tie_embeddings=True,
                         ffn_hidden_size=48)
    model = LanguageModel(config)
    assert choose_architecture(config).name == smollm3.NAME
    assert_meshlm_round_trip(model, tmp_path, smollm3.NAME)


def test_what_smollm3_cannot_hold_is_refused_by_name():
    base = {"architectures": [smollm3.NAME], "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match="no_rope_layers=.1, 2. must hold a 1"):
        smollm3.config_from_hf({**base, "no_rope_layers": [1, 2]})
    with pytest.raises(ConfigError, match="layer_types marks sliding layers but use_sliding_window is false"):
        smollm3.config_from_hf({**base, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]})
    unrotated = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, rope_pattern="N")
    with pytest.raises(ConfigError, match="model.rope_pattern='N' .only SmolLM3ForCausalLM, Cohere2ForCausalLM and "
                                          "Exaone4ForCausalLM"):
        choose_architecture(unrotated, requested="LlamaForCausalLM")
