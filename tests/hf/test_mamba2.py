import math

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Mamba2Config  # noqa: E402

from meshlm.errors import ConfigError
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.hf import mamba2  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare  # noqa: E402


def tiny_mamba2(**overrides) -> Mamba2Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=16, n_groups=1,
                  num_hidden_layers=2, chunk_size=8, initializer_range=0.1)
    values.update(overrides)
    return Mamba2Config(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"n_groups": 2, "state_size": 8, "use_bias": True, "use_conv_bias": False, "tie_word_embeddings": True,
     "time_step_limit": (0.05, math.inf)},
], ids=["one-group", "two-groups-biases-tied-dt-clamp"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(tiny_mamba2(**overrides), tmp_path, seq=27)  # 27 = 3 chunks of 8 + 3
    config = model.config
    assert config.pattern == "MM" and config.mamba_chunk_size == 8 < 27
    assert config.mamba_num_groups == overrides.get("n_groups", 1)
    assert config.mamba_dt_clamp_min == overrides.get("time_step_limit", (0.0,))[0]
    assert_hf_round_trip(tmp_path, ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size",
                                    "use_bias", "use_conv_bias", "layer_norm_epsilon", "time_step_limit", "expand"))


def test_meshlm_model_round_trips_through_mamba2(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="MMM", mamba_head_dim=8, mamba_state_size=8,
                         mamba_num_groups=2, mamba_chunk_size=8, mamba_dt_clamp_min=0.01)
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "Mamba2ForCausalLM")


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match=r"time_step_limit=\[0.0, 0.5\]"):
        mamba2.config_from_hf({"hidden_size": 32, "num_heads": 8, "head_dim": 8, "time_step_limit": [0.0, 0.5]})
    odd_width = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="MM", mamba_num_heads=5, mamba_head_dim=8)
    with pytest.raises(ConfigError, match="mamba_head_dim = 40"):
        mamba2.config_to_hf(odd_width)
