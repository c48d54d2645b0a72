"""``ArceeForCausalLM`` <-> meshlm (Arcee AI 2025, AFM-4.5B).

An Arcee layer is Llama's attention (``llama.py``: RoPE, grouped KV heads, biases on q/k/v/o iff
``attention_bias``, the same tensor names) followed by a *non-gated* MLP, ``down(act(up(x)))``
with ReLU squared by default (``hidden_act: relu2``; Nemotron's MLP: meshlm
``model.mlp_activation=squared_relu``), biases iff ``mlp_bias``. YaRN-scaled RoPE is read as the
other classes read it.
"""

from __future__ import annotations

from meshlm.hf.common import (ACTIVATION_FROM_HF, ACTIVATION_TO_HF, Architecture, TensorMap, blocks_of,
                              hf_common_fields, linear_maps, non_gated_activation_unsupported, rename, require,
                              rope_from_hf, window_unsupported, with_defaults)
from meshlm.hf.llama import attention_fields, attention_maps, attention_to_hf, decoder_embedding_maps, \
    decoder_unsupported
from meshlm.models.config import ModelConfig

NAME = "ArceeForCausalLM"
MODEL_TYPE = "arcee"
DEFAULTS = {"vocab_size": 32000, "hidden_size": 2560, "intermediate_size": 18432, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "relu2", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "max_position_embeddings": 4096}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", tuple(ACTIVATION_FROM_HF), "meshlm has no such MLP activation")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope", **rope_from_hf(hf_config, 10000.0, NAME),
        mlp_activation=ACTIVATION_FROM_HF[hf["hidden_act"]], ffn_hidden_size=hf["intermediate_size"],
        mlp_bias=bool(hf["mlp_bias"]), norm="rmsnorm", norm_eps=hf["rms_norm_eps"],
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=False)
    reasons += blocks_of(config, r"(\*-)+", "Arcee layers are attention then MLP: '*-' repeated")
    reasons += window_unsupported(config, "Arcee", uniform_only=False)
    return reasons + non_gated_activation_unsupported(config, "Arcee", ACTIVATION_TO_HF)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": ACTIVATION_TO_HF[config.mlp_activation], "rms_norm_eps": config.norm_eps,
            "attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        mlp, theirs = 2 * layer + 1, f"model.layers.{layer}"
        maps += attention_maps(config, 2 * layer, layer)
        maps.append(rename(f"blocks.{mlp}.norm.weight", f"{theirs}.post_attention_layernorm.weight"))
        for projection in ("up_proj", "down_proj"):
            maps += linear_maps(f"blocks.{mlp}.mixer.{projection}", f"{theirs}.mlp.{projection}", config.mlp_bias)
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
