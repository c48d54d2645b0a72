"""``BambaForCausalLM`` <-> meshlm (IBM 2025, Bamba-9B: a Mamba-2 / attention hybrid trained in the open).

Each layer is a Mamba-2 mixer, or an attention mixer in the layers ``attn_layer_indices`` lists,
then a SwiGLU MLP; HF layer i is meshlm blocks 2i ('M' or '*') and 2i+1 ('-'). The attention
rotates the first half of each head's channels (transformers fixes ``partial_rotary_factor`` at
0.5: ``model.rope_fraction``), with biases on q/k/v/o or none (``attention_bias``); the MLP has
biases iff ``mlp_bias``. The Mamba fields are Granite 4.0-H's (``granite_moe.py``). Names:

    model.layers.{i}.input_layernorm, mamba.* | self_attn.*        blocks.{2i}.norm, mixer.*
    model.layers.{i}.pre_ff_layernorm, feed_forward.{gate,up,down}_proj   blocks.{2i+1}.norm, mixer.*
    model.final_layernorm                                          final_norm
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, common_unsupported, embedding_maps, hf_common_fields,
                              linear_maps, rename, require, rope_from_hf, window_unsupported, with_defaults)
from meshlm.hf.granite_moe import HYBRID_DEFAULTS, hybrid_mamba_fields, hybrid_mamba_to_hf, hybrid_mamba_unsupported
from meshlm.hf.llama import attention_fields, attention_maps, attention_to_hf
from meshlm.hf.mamba2 import mamba_mixer_maps
from meshlm.models.config import ModelConfig

NAME = "BambaForCausalLM"
MODEL_TYPE = "bamba"
DEFAULTS = {**{key: value for key, value in HYBRID_DEFAULTS.items() if key.startswith("mamba_")},
            "time_step_limit": HYBRID_DEFAULTS["time_step_limit"], "vocab_size": 128000, "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "max_position_embeddings": 262144, "attention_dropout": 0.0, "attn_layer_indices": None,
            "attention_bias": False, "mlp_bias": False}
ROPE_FRACTION = 0.5
"""transformers' Bamba rotates half of each head, whatever config.json says."""
SUPPORTED_FEATURES = frozenset({"rope_fraction"})


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", "silu", "meshlm's MLPs and Mamba convolution use silu")
    attention_layers = set(hf["attn_layer_indices"] or ())
    pattern = "".join(("*" if layer in attention_layers else "M") + "-" for layer in range(hf["num_hidden_layers"]))
    bias = bool(hf["attention_bias"])
    rope = rope_from_hf({**hf_config, "partial_rotary_factor": ROPE_FRACTION,
                         "rope_parameters": {**(hf_config.get("rope_parameters") or {}),
                                             "partial_rotary_factor": ROPE_FRACTION}}, 10000.0, NAME,
                        partial_rotary=True)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern,
        **{**attention_fields(hf), "attention_bias": bias}, position_embedding="rope", **rope,
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=bool(hf["mlp_bias"]),
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"], **hybrid_mamba_fields(hf, NAME))


def unsupported(config: ModelConfig) -> list[str]:
    kinds = config.block_kinds
    reasons = common_unsupported(config, supported=SUPPORTED_FEATURES) + window_unsupported(config, "Bamba", False)
    if len(kinds) % 2 or set(kinds[::2]) - {"M", "*"} or set(kinds[1::2]) != {"-"}:
        reasons.append(f"model.pattern={config.pattern!r} (Bamba layers are 'M' or '*' then an MLP '-')")
    if "*" in kinds:
        if config.position_embedding != "rope" or config.rope_fraction != ROPE_FRACTION:
            reasons.append(f"model.position_embedding={config.position_embedding!r}, model.rope_fraction="
                           f"{config.rope_fraction} (Bamba rotates half of each head: 'rope', {ROPE_FRACTION})")
        if config.qk_norm:
            reasons.append("model.qk_norm=True (Bamba attention has no QK-norm)")
        if config.resolved_attention_output_bias != config.attention_bias:
            reasons.append(f"model.attention_output_bias={config.attention_output_bias} with model.attention_bias="
                           f"{config.attention_bias} (Bamba's q/k/v/o projections all have biases or none do)")
    if config.mlp_activation != "swiglu":
        reasons.append(f"model.mlp_activation={config.mlp_activation!r} (Bamba's MLP is SwiGLU)")
    return reasons + hybrid_mamba_unsupported(config, "Bamba")


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    kinds = config.block_kinds
    values = {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config), **hybrid_mamba_to_hf(config),
              "num_hidden_layers": len(kinds) // 2, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
              "intermediate_size": config.resolved_ffn_hidden_size, "attention_bias": config.attention_bias,
              "mlp_bias": config.mlp_bias,
              "attn_layer_indices": [layer for layer in range(len(kinds) // 2) if kinds[2 * layer] == "*"],
              "max_position_embeddings": DEFAULTS["max_position_embeddings"]}
    values["rope_parameters"] = {**values["rope_parameters"], "partial_rotary_factor": ROPE_FRACTION}
    return values


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for layer in range(config.num_blocks // 2):
        mixer, mlp, theirs = 2 * layer, 2 * layer + 1, f"model.layers.{layer}"
        if config.block_kinds[mixer] == "M":
            maps += mamba_mixer_maps(config, mixer, theirs, mixer="mamba", norm="input_layernorm")
        else:
            maps += attention_maps(config, mixer, layer)
        maps.append(rename(f"blocks.{mlp}.norm.weight", f"{theirs}.pre_ff_layernorm.weight"))
        for projection in ("gate_proj", "up_proj", "down_proj"):
            maps += linear_maps(f"blocks.{mlp}.mixer.{projection}", f"{theirs}.feed_forward.{projection}",
                                config.mlp_bias)
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
