"""``Phi3ForCausalLM`` (Phi-3, Phi-4) <-> meshlm: Llama's layer with fused qkv_proj and gate_up_proj,
cut into meshlm's projections on import and concatenated back on export."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Phi3Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, llama, phi3  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, assert_same_logits,  # noqa: E402
                      convert_and_compare, load_hf, random_ids)


def tiny_phi3(**overrides) -> Phi3Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    values.update(overrides)
    return Phi3Config(**values)


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 5},
                                       {"num_key_value_heads": 4, "tie_word_embeddings": True},
                                       {"partial_rotary_factor": 0.75}],
                         ids=["phi4-like", "phi3-mini-sliding-window", "mha-tied", "phi4-mini-partial-rotary"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    model = convert_and_compare(tiny_phi3(**overrides), tmp_path)
    config = model.config
    assert config.pattern == "*-*-*-" and config.rope_theta == 250000.0
    assert config.sliding_window == overrides.get("sliding_window")
    assert config.rope_fraction == overrides.get("partial_rotary_factor", 1.0)
    assert config.rotary_dim == {1.0: 8, 0.75: 6}[config.rope_fraction]
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "num_key_value_heads", "intermediate_size", "sliding_window",
                                    "rope_parameters", "tie_word_embeddings"))


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["phi3.5-like", "phi4-mini-like"])
def test_longrope_logits_match_transformers_within_and_past_the_original_context(partial, tmp_path):
    """Phi-3.5 and Phi-4-mini stretch RoPE with LongRoPE: a sequence of 24 tokens rotates with the long
    factors (past the original 16), one of 12 with the short ones; both match transformers."""
    pairs = int(8 * partial) // 2
    rope = {"rope_type": "longrope", "rope_theta": 250000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * pair for pair in range(pairs)],
            "long_factor": [1.0 + 2.5 * pair for pair in range(pairs)]}
    hf_config = tiny_phi3(rope_parameters=rope, max_position_embeddings=64, original_max_position_embeddings=16)
    model = convert_and_compare(hf_config, tmp_path, seq=24)
    config = model.config
    assert config.rope_scaling == "longrope" and config.rope_scaling_factor == 4.0
    assert config.rope_original_max_positions == 16
    assert config.rope_long_factors == rope["long_factor"] and config.rotary_dim == 2 * pairs
    assert_same_logits(load_hf(tmp_path / "hf"), model, random_ids(seq=12))
    assert_hf_round_trip(tmp_path, ("original_max_position_embeddings", "max_position_embeddings"))


def test_older_phi3_files_name_longrope_su():
    config = phi3.config_from_hf({"architectures": [phi3.NAME], "hidden_size": 32, "num_attention_heads": 4,
                                  "num_hidden_layers": 1, "max_position_embeddings": 128,
                                  "original_max_position_embeddings": 32,
                                  "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}})
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_short_factors) == ("longrope", 4.0, [1.0] * 4)


def test_a_meshlm_model_round_trips_through_the_fused_tensors(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=40, rope_theta=1234.0)
    assert choose_architecture(config).name == "LlamaForCausalLM"  # Phi-3 only when asked for or imported from
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, phi3.NAME, imported_from=phi3.NAME)


def test_what_phi3_cannot_hold_is_refused_by_name():
    with pytest.raises(ConfigError, match="model.rope_short_factors must list 4 positive numbers"):
        phi3.config_from_hf({"architectures": [phi3.NAME], "hidden_size": 32, "num_attention_heads": 4,
                             "num_hidden_layers": 1, "rope_scaling": {"type": "longrope", "short_factor": [1.0],
                                                                      "long_factor": [1.0]}})
    with pytest.raises(ConfigError, match="needs its short_factor and long_factor"):
        phi3.config_from_hf({"architectures": [phi3.NAME], "hidden_size": 32, "num_attention_heads": 4,
                             "num_hidden_layers": 1, "rope_scaling": {"type": "longrope", "short_factor": [1.0]}})
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.75 is not supported; LlamaForCausalLM's"):
        llama.config_from_hf({"architectures": [llama.NAME], "hidden_size": 32, "num_attention_heads": 4,
                              "num_hidden_layers": 1, "partial_rotary_factor": 0.75})
    partial = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, rope_fraction=0.5)
    assert "rope_fraction" in " ".join(llama.ARCHITECTURE.unsupported(partial))
    assert choose_architecture(partial).name == phi3.NAME  # the one class here that rotates part of a head
    biased = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, attention_bias=True)
    with pytest.raises(ConfigError, match="Phi-3's projections have no biases"):
        phi3.config_to_hf(biased)


def test_adapters_on_fused_layers_export_merged_not_as_a_peft_folder(tmp_path):
    """PEFT targets whole modules, and Phi-3's q/k/v (and gate/up) are one module: an adapter on a
    part of it is refused with the way out; the merged export works."""
    from meshlm.checkpoint.model_files import save_model
    from meshlm.errors import CheckpointError
    from meshlm.hf import meshlm_to_hf

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, num_kv_heads=2,
                         lora_rank=4, lora_targets=["q_proj", "v_proj"])
    save_model(LanguageModel(config), tmp_path / "lora")
    with pytest.raises(CheckpointError, match="Phi3ForCausalLM has no layer for the adapter of .*export the merged"):
        meshlm_to_hf(tmp_path / "lora", tmp_path / "adapter", architecture=phi3.NAME, part="adapter",
                     base_model="base")
    meshlm_to_hf(tmp_path / "lora", tmp_path / "merged", architecture=phi3.NAME)
    assert (tmp_path / "merged" / "model.safetensors").is_file()
