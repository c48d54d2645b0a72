"""``SmolLM3ForCausalLM`` <-> meshlm (Hugging Face's SmolLM3, 2025: a 3B model trained in the open).

A SmolLM3 layer is Llama's -- RoPE attention with grouped KV heads, a SwiGLU MLP, RMSNorm -- but
every fourth layer has no position encoding at all (NoPE, Kazemnejad et al. 2023; the causal mask
alone tells positions apart): ``no_rope_layers`` holds a 1 for each layer that rotates and a 0 for
each that does not, by default ``no_rope_layer_interval`` 4 (layers 3, 7, 11, ... plain). That is
``model.rope_pattern`` ("RRRN" by default), the shortest repeating pattern of the layers' letters.
Layers that ``layer_types`` marks sliding attend within ``sliding_window`` when
``use_sliding_window`` is on. The tensors are Llama's (``llama.tensor_maps``); the RoPE base
defaults to 2e6 and the head is tied.
"""

from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.hf.common import (SLIDING_ATTENTION, Architecture, layer_rotates, layer_types_from_hf, layer_types_to_hf,
                              rope_pattern_fields, rope_with_defaults, window_fields, with_defaults)
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, tensor_maps
from meshlm.models.config import ModelConfig

NAME = "SmolLM3ForCausalLM"
MODEL_TYPE = "smollm3"
DEFAULTS = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
            "num_attention_heads": 16, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
            "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
            "mlp_bias": False, "use_sliding_window": False, "sliding_window": None, "no_rope_layer_interval": 4}
ROPE_THETA = 2000000.0


def no_rope_layers(hf: dict) -> list[int]:
    """1 for each layer that applies RoPE, 0 for each that does not: ``no_rope_layers``, else every
    ``no_rope_layer_interval``-th layer without (transformers' rule)."""
    layers = hf["num_hidden_layers"]
    found = hf.get("no_rope_layers")
    if found is None:
        return [int((index + 1) % hf["no_rope_layer_interval"] != 0) for index in range(layers)]
    if len(found) < layers or set(found[:layers]) - {0, 1}:
        raise ConfigError(f"{NAME} config.json: no_rope_layers={found!r} must hold a 1 (RoPE) or 0 (none) for each of "
                          f"the {layers} layers.")
    return list(found[:layers])


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    rotates = no_rope_layers(hf)
    if hf.get("layer_types") is None:  # transformers' rule: the NoPE layers slide when sliding is on
        hf["layer_types"] = ["sliding_attention" if hf["use_sliding_window"] and hf["sliding_window"] is not None
                             and not rotate else "full_attention" for rotate in rotates]
    types = layer_types_from_hf(hf, NAME)
    if SLIDING_ATTENTION in types and not hf["use_sliding_window"]:
        raise ConfigError(f"{NAME} config.json: layer_types marks sliding layers but use_sliding_window is false "
                          "(transformers' masks would slide and its attention would not); set use_sliding_window or "
                          "mark every layer full_attention.")
    sliding = [kind == SLIDING_ATTENTION for kind in types] if hf["use_sliding_window"] else []
    return dense_decoder_config(hf, rope_with_defaults(hf_config, 1.0, ROPE_THETA), NAME,
                                **window_fields(hf["sliding_window"], sliding),
                                **rope_pattern_fields([bool(rotate) for rotate in rotates]))


def unsupported(config: ModelConfig) -> list[str]:
    return dense_decoder_unsupported(config, "SmolLM3", qk_norm=False, supported=frozenset({"rope_pattern"}))


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    types = layer_types_to_hf(config)
    sliding = SLIDING_ATTENTION in types
    # explicit null token ids: SmolLM3's defaults (128000 and up) lie outside a smaller vocabulary; the
    # model's own ids (from its "hf" record or its tokenizer) replace them
    return dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                               bos_token_id=None, eos_token_id=None, pad_token_id=None,
                               attention_bias=config.attention_bias, mlp_bias=config.mlp_bias,
                               no_rope_layers=[int(rotate) for rotate in layer_rotates(config)],
                               no_rope_layer_interval=DEFAULTS["no_rope_layer_interval"], layer_types=types,
                               use_sliding_window=sliding, sliding_window=config.sliding_window if sliding else None)


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
