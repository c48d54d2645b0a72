"""``Olmo2ForCausalLM`` and ``Olmo3ForCausalLM`` <-> meshlm (OLMo et al. 2024, "2 OLMo 2 Furious";
OLMo 3, 2025): the fully open models, whose data and training code are public too.

An OLMo 2 decoder layer is Llama's (attention, then a SwiGLU MLP) with the norms moved from the
sublayers' inputs to their outputs -- ``h + norm(attention(h))``, then ``h + norm(mlp(h))``, the
"reordered norm" -- and a QK-norm over the whole query and key projections (all heads' channels
together, a weight per channel), before RoPE. In meshlm: ``model.block_input_norm=false``,
``model.block_output_norm=true`` and ``model.qk_norm_scope=all``, so HF layer i is blocks 2i ('*')
and 2i+1 ('-'):

    model.layers.{i}.self_attn.{q,k,v,o}_proj          blocks.{2i}.mixer.{q,k,v,o}_proj
    model.layers.{i}.self_attn.{q,k}_norm               blocks.{2i}.mixer.{q,k}_norm
    model.layers.{i}.post_attention_layernorm            blocks.{2i}.output_norm
    model.layers.{i}.mlp.{gate,up,down}_proj            blocks.{2i+1}.mixer.{gate,up,down}_proj
    model.layers.{i}.post_feedforward_layernorm          blocks.{2i+1}.output_norm

OLMo 3 adds sliding-window attention in three layers of four (``sliding_window``, ``layer_types``)
and RoPE per layer type: the full layers may scale theirs (YaRN for the long-context models) while
the sliding ones rotate unscaled (``model.rope_local_theta``).
"""

from __future__ import annotations

from meshlm.hf.common import (SLIDING_ATTENTION, Architecture, TensorMap, decoder_layers_unsupported,
                              hf_common_fields, layer_types_from_hf, layer_types_to_hf, layered_rope_fields,
                              layered_rope_to_hf, linear_maps, rename, require, rope_from_hf, rope_to_hf,
                              window_fields, with_defaults)
from meshlm.hf.llama import attention_fields, decoder_embedding_maps
from meshlm.models.config import ModelConfig

OLMO2, OLMO3 = "Olmo2ForCausalLM", "Olmo3ForCausalLM"
DEFAULTS = {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "attention_bias": False, "initializer_range": 0.02, "max_position_embeddings": 2048}
OLMO3_DEFAULTS = {**DEFAULTS, "sliding_window": 4096}
OLMO2_THETA, OLMO3_THETA = 10_000.0, 500_000.0
"""transformers' RoPE bases when config.json gives none."""
SUPPORTED_FEATURES = frozenset({"block_output_norm", "block_input_norm", "qk_norm_scope"})
FIXED_FIELDS = {"block_input_norm": False, "block_output_norm": True, "qk_norm": True, "qk_norm_scope": "all",
          "mlp_activation": "swiglu", "position_embedding": "rope", "mlp_bias": False}


def olmo_config(hf: dict, name: str, **fields) -> ModelConfig:
    require(hf, name, "hidden_act", "silu", "meshlm's gated MLP is SwiGLU, silu(gate) * up")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope", qk_norm=True, qk_norm_scope="all",
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False,
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], block_input_norm=False, block_output_norm=True,
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"], **fields)


def olmo2_config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    return olmo_config(hf, OLMO2, **rope_from_hf(hf_config, OLMO2_THETA, OLMO2))


def olmo3_config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, OLMO3_DEFAULTS)
    types = layer_types_from_hf(hf, OLMO3, full_every=4)
    windows = window_fields(hf["sliding_window"], [kind == SLIDING_ATTENTION for kind in types])
    rope = layered_rope_fields(hf_config, OLMO3, OLMO3_THETA, OLMO3_THETA, "rope_theta", bool(windows))
    return olmo_config(hf, OLMO3, **windows, **rope)


def unsupported(config: ModelConfig, label: str, windows: bool) -> list[str]:
    supported = SUPPORTED_FEATURES | ({"rope_local_theta"} if windows else set())
    reasons = decoder_layers_unsupported(config, label, supported, FIXED_FIELDS)
    if config.resolved_attention_output_bias != config.attention_bias:
        reasons.append(f"model.attention_output_bias={config.attention_output_bias} ({label}'s q/k/v/o projections "
                       "all have biases or none do)")
    if not windows and config.sliding_window is not None:
        reasons.append(f"model.sliding_window={config.sliding_window} ({label} attends to every earlier token; "
                       f"{OLMO3} slides)")
    if windows and config.sliding_window is not None and config.rope_scaling != "none" and \
            config.rope_local_theta is None:
        reasons.append(f"model.rope_local_theta=None with model.rope_scaling={config.rope_scaling!r} ({label}'s "
                       "sliding layers rotate unscaled; set model.rope_local_theta to model.rope_theta)")
    return reasons


def olmo2_unsupported(config: ModelConfig) -> list[str]:
    return unsupported(config, "OLMo 2", windows=False)


def olmo3_unsupported(config: ModelConfig) -> list[str]:
    return unsupported(config, "OLMo 3", windows=True)


def common_fields(config: ModelConfig, name: str, model_type: str) -> dict:
    return {**hf_common_fields(config, name, model_type),
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.resolved_num_kv_heads,
            "attention_dropout": config.attention_dropout, "attention_bias": config.attention_bias,
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def olmo2_config_to_hf(config: ModelConfig) -> dict:
    OLMO2_ARCHITECTURE.check_expressible(config)
    return {**common_fields(config, OLMO2, "olmo2"), **rope_to_hf(config)}


def olmo3_config_to_hf(config: ModelConfig) -> dict:
    OLMO3_ARCHITECTURE.check_expressible(config)
    return {**common_fields(config, OLMO3, "olmo3"), **layered_rope_to_hf(config),
            "sliding_window": config.sliding_window if config.sliding_window is not None else 4096,
            "layer_types": layer_types_to_hf(config)}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        attention, mlp = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}"
        theirs = f"model.layers.{layer}"
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            maps += linear_maps(f"{attention}.mixer.{projection}", f"{theirs}.self_attn.{projection}",
                                config.attention_bias)
        maps += [rename(f"{attention}.mixer.q_norm.weight", f"{theirs}.self_attn.q_norm.weight"),
                 rename(f"{attention}.mixer.k_norm.weight", f"{theirs}.self_attn.k_norm.weight"),
                 rename(f"{attention}.output_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
                 rename(f"{mlp}.output_norm.weight", f"{theirs}.post_feedforward_layernorm.weight")]
        for projection in ("gate_proj", "up_proj", "down_proj"):
            maps += linear_maps(f"{mlp}.mixer.{projection}", f"{theirs}.mlp.{projection}", False)
    return maps


OLMO2_ARCHITECTURE = Architecture(OLMO2, "olmo2", olmo2_config_from_hf, olmo2_config_to_hf, tensor_maps,
                                  olmo2_unsupported)
OLMO3_ARCHITECTURE = Architecture(OLMO3, "olmo3", olmo3_config_from_hf, olmo3_config_to_hf, tensor_maps,
                                  olmo3_unsupported)
