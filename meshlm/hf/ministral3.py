"""``Ministral3ForCausalLM`` <-> meshlm (Mistral AI 2025, Ministral 3: 3B, 8B and 14B).

A Ministral 3 layer is Mistral's (``mistral.py``: Llama's names and layout, grouped KV heads, an
optional window in every layer) with YaRN-scaled RoPE and one addition from Llama 4: after RoPE,
the query at position p is scaled by 1 + beta ln(1 + floor(p / L)) (``rope_parameters``'
``llama_4_scaling_beta`` and ``original_max_position_embeddings``: meshlm ``model.query_scale_beta``
and ``model.query_scale_length``). A config.json without ``rope_parameters`` takes the class's
default, YaRN of factor 16 over 16384 positions with beta 0.1.
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, uniform_window, window_fields, window_unsupported, with_defaults
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, tensor_maps
from meshlm.models.config import ModelConfig

NAME = "Ministral3ForCausalLM"
MODEL_TYPE = "ministral3"
DEFAULTS = {"vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
            "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "initializer_range": 0.02, "max_position_embeddings": 262144}
DEFAULT_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 16384,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
"""transformers' rope_parameters when config.json has none."""
SUPPORTED_FEATURES = frozenset({"query_scale_beta"})


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or DEFAULT_ROPE
    length = parameters.get("original_max_position_embeddings") or DEFAULT_ROPE["original_max_position_embeddings"]
    return dense_decoder_config(hf, {**hf_config, "rope_parameters": parameters}, NAME,
                                query_scale_beta=float(parameters.get("llama_4_scaling_beta") or 0.0),
                                query_scale_length=int(length),
                                **window_fields(hf_config.get("sliding_window"), [True] * hf["num_hidden_layers"]))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Ministral 3", qk_norm=False, supported=SUPPORTED_FEATURES)
    reasons += window_unsupported(config, "Ministral 3", uniform_only=True)
    if config.attention_bias or config.mlp_bias:
        reasons.append(f"model.attention_bias={config.attention_bias}, model.mlp_bias={config.mlp_bias} (Ministral "
                       "3 has no biases)")
    original = config.rope_original_max_positions if config.rope_scaling in ("yarn", "llama3") else None
    if original is not None and original != config.query_scale_length:
        reasons.append(f"model.query_scale_length={config.query_scale_length} with "
                       f"model.rope_original_max_positions={original} (Ministral 3 reads both from "
                       "rope_parameters' original_max_position_embeddings: make them equal)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                                 sliding_window=uniform_window(config))
    values["rope_parameters"] = {"original_max_position_embeddings": config.query_scale_length,
                                 **values["rope_parameters"], "llama_4_scaling_beta": config.query_scale_beta}
    return values


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
