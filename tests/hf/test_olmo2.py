"""``Olmo2ForCausalLM`` and ``Olmo3ForCausalLM`` <-> meshlm: norms after the sublayers (none before),
QK-norm over all heads at once; OLMo 3's sliding windows and per-layer-type RoPE."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Olmo2Config, Olmo3Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, olmo2  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             rms_norm_eps=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 2, "tie_word_embeddings": True}],
                         ids=["mha", "gqa-tied"])
def test_olmo2_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(Olmo2Config(**{**SIZES, **overrides}), tmp_path)
    config = model.config
    assert not config.block_input_norm and config.block_output_norm and config.qk_norm_scope == "all"
    assert all(block.norm is None for block in model.blocks)
    assert model.blocks[0].mixer.q_norm.weight.shape == (32,)  # all 4 heads of 8 channels
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
                                    "rope_parameters", "tie_word_embeddings"))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 500.0}


@pytest.mark.parametrize("overrides", [
    {},
    {"rope_parameters": {"full_attention": YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
     "max_position_embeddings": 32},
], ids=["three-sliding-to-one-full", "yarn-full-layers"])
def test_olmo3_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = Olmo3Config(**{**SIZES, "num_key_value_heads": 2, "sliding_window": 5, **overrides})
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.sliding_window, config.sliding_window_pattern) == (5, "SSSF")
    windows = [block.mixer.window for block in model.blocks if block.kind == "*"]
    assert windows == [5, 5, 5, None]
    scalings = [block.mixer.rotary.scaling.kind for block in model.blocks if block.kind == "*"]
    assert scalings == (["none"] * 3 + ["yarn"] if overrides else ["none"] * 4)
    same = ("sliding_window", "layer_types", "num_key_value_heads")  # (export spells out YaRN's default betas)
    assert_hf_round_trip(tmp_path, same if overrides else (*same, "rope_parameters"))


def test_a_meshlm_model_with_reordered_norms_exports_as_olmo_and_others_refuse_it(tmp_path):
    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                  ffn_hidden_size=40, qk_norm=True, qk_norm_scope="all", block_input_norm=False,
                  block_output_norm=True)
    model = LanguageModel(ModelConfig(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
    assert choose_architecture(model.config).name == olmo2.OLMO2
    assert_meshlm_round_trip(model, tmp_path / "olmo2", olmo2.OLMO2)
    sliding = ModelConfig(**{**fields, "pattern": "*-" * 4}, sliding_window=6, sliding_window_pattern="SSSF")
    assert choose_architecture(sliding).name == olmo2.OLMO3
    assert_meshlm_round_trip(LanguageModel(sliding), tmp_path / "olmo3", olmo2.OLMO3)
    per_head = ModelConfig(**{**fields, "qk_norm_scope": "head"})
    with pytest.raises(ConfigError, match="model.qk_norm_scope='head' .OLMo 2 has qk_norm_scope='all'"):
        olmo2.olmo2_config_to_hf(per_head)
    with pytest.raises(ConfigError, match="model.block_input_norm=False .only Olmo2ForCausalLM"):
        choose_architecture(ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4,
                                        block_input_norm=False))
