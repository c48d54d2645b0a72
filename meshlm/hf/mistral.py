"""``MistralForCausalLM`` <-> meshlm (Jiang et al. 2023, "Mistral 7B").

A Mistral decoder layer is Llama's (RoPE attention with grouped KV heads, then a SwiGLU MLP; no
QK-norm, no biases), so HF layer i is blocks 2i ('*') and 2i+1 ('-') and every tensor has
Llama's name (``llama.py``). ``head_dim`` may be set apart from the hidden size (Mistral-Nemo:
128 with hidden 5120 and 32 heads).

Mistral 7B v0.1 attends within a sliding window of 4096 tokens; later releases set
``sliding_window`` to null. meshlm attention is full causal attention, so only a null window is
accepted. An *absent* ``sliding_window`` is transformers' default, a window of 4096 (transformers
v4 left fields equal to their defaults out of config.json), so it is refused too.

Every model this class can hold, ``LlamaForCausalLM`` holds too and comes first in the export
order (``convert.py``), so export writes Mistral only for a model imported from it or when
``--architecture MistralForCausalLM`` asks.
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, hf_common_fields, require, with_defaults
from meshlm.hf.llama import attention_to_hf, dense_decoder_config, dense_decoder_unsupported, tensor_maps
from meshlm.models.config import ModelConfig

NAME = "MistralForCausalLM"
DEFAULT_SLIDING_WINDOW = 4096
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "initializer_range": 0.02, "max_position_embeddings": 4096 * 32}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    hf["sliding_window"] = hf_config.get("sliding_window", DEFAULT_SLIDING_WINDOW)  # null is meaningful here
    require(hf, NAME, "sliding_window", None, "meshlm attention is full causal attention, with no sliding window; "
            "an absent sliding_window means transformers' default of 4096")
    return dense_decoder_config(hf, hf_config, NAME)


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Mistral", qk_norm=False)
    if config.attention_bias:
        reasons.append("model.attention_bias=True (Mistral's attention has no biases)")
    if config.mlp_bias:
        reasons.append("model.mlp_bias=True (Mistral's MLP has no biases)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, "mistral"), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "sliding_window": None,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


ARCHITECTURE = Architecture(NAME, "mistral", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
