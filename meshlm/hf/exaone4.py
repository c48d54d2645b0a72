"""``Exaone4ForCausalLM`` <-> meshlm (LG AI Research 2025, "EXAONE 4.0: Unified Large Language
Models Integrating Non-reasoning and Reasoning Modes"): EXAONE 4.0 1.2B and 32B.

An EXAONE 4.0 layer is OLMo 2's (``olmo2.py``) -- Llama's attention and SwiGLU MLP with the norms
after the sublayers, ``h + norm(attention(h))`` then ``h + norm(mlp(h))`` (``model.block_input_norm
=false``, ``model.block_output_norm=true``) -- with a QK-norm of each head (one RMSNorm weight of
head_dim shared by the heads, ``model.qk_norm_scope=head``), and, with a ``sliding_window``, the
hybrid attention of the 32B: three layers in four attend within the window and rotate their queries
and keys, every fourth attends to everything with no position encoding (``model.sliding_window_pattern``
"SSSF" with ``model.rope_pattern`` "RRRN", letter for letter). Without a window every layer attends
in full and rotates. The tensors are OLMo 2's.
"""

from __future__ import annotations

from meshlm.hf.common import (SLIDING_ATTENTION, Architecture, decoder_layers_unsupported,
                              hf_common_fields, layer_rotates, layer_types_from_hf, layer_types_to_hf, layer_windows,
                              require, rope_from_hf, rope_pattern_fields, window_fields, with_defaults)
from meshlm.hf.llama import attention_fields, attention_to_hf
from meshlm.hf.olmo2 import tensor_maps
from meshlm.models.config import ModelConfig

NAME = "Exaone4ForCausalLM"
MODEL_TYPE = "exaone4"
DEFAULTS = {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
            "initializer_range": 0.02, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_dropout": 0.0,
            "sliding_window": 4096, "sliding_window_pattern": 4}
SUPPORTED_FEATURES = frozenset({"block_output_norm", "block_input_norm", "rope_pattern"})
FIXED_FIELDS = {"block_input_norm": False, "block_output_norm": True, "qk_norm": True, "qk_norm_scope": "head",
                "mlp_activation": "swiglu", "position_embedding": "rope", "mlp_bias": False, "attention_bias": False}
"""What every EXAONE 4.0 layer has."""


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    if "sliding_window" in hf_config and hf_config["sliding_window"] is None:
        hf["sliding_window"] = None  # no window: every layer full, and rotating
    require(hf, NAME, "hidden_act", "silu", "meshlm's gated MLP is SwiGLU, silu(gate) * up")
    window = hf["sliding_window"]
    # without layer_types, transformers' rule: every sliding_window_pattern-th layer full (no window: all)
    every = hf["sliding_window_pattern"] if window is not None else None
    sliding = [kind == SLIDING_ATTENTION for kind in layer_types_from_hf(hf, NAME, full_every=every)]
    rotates = [window is None or slides for slides in sliding]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **attention_fields({**hf, "attention_bias": False}), position_embedding="rope", qk_norm=True,
        **rope_from_hf(hf_config, 10000.0, NAME), **window_fields(window, sliding), **rope_pattern_fields(rotates),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False, norm="rmsnorm",
        norm_eps=hf["rms_norm_eps"], block_input_norm=False, block_output_norm=True,
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "EXAONE 4.0", SUPPORTED_FEATURES, FIXED_FIELDS)
    if config.resolved_attention_output_bias:
        reasons.append("model.attention_output_bias=True (EXAONE 4.0's projections have no biases)")
    windows = layer_windows(config)
    sliding = [window is not None for window in windows]
    if layer_rotates(config) != (sliding if config.sliding_window is not None else [True] * len(windows)):
        reasons.append(f"model.rope_pattern={config.rope_pattern!r} with model.sliding_window="
                       f"{config.sliding_window} (EXAONE 4.0 rotates exactly its sliding layers when it has a window, "
                       "and every layer without one)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "sliding_window": config.sliding_window,
            "layer_types": layer_types_to_hf(config), "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
