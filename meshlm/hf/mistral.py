"""``MistralForCausalLM`` <-> meshlm (Jiang et al. 2023, "Mistral 7B").

A Mistral decoder layer is Llama's (RoPE attention with grouped KV heads, then a SwiGLU MLP; no
QK-norm, no biases), so HF layer i is blocks 2i ('*') and 2i+1 ('-') and every tensor has
Llama's name (``llama.py``). ``head_dim`` may be set apart from the hidden size (Mistral-Nemo:
128 with hidden 5120 and 32 heads).

Mistral 7B v0.1 attends within a sliding window of 4096 tokens in every layer (meshlm
``model.sliding_window=4096``); later releases set ``sliding_window`` to null (full causal
attention). An *absent* ``sliding_window`` is transformers' default, a window of 4096
(transformers v4 left fields equal to their defaults out of config.json). A model whose layers
slide differently (``model.sliding_window_pattern`` other than all S) is not a Mistral: Qwen2 or
Qwen3 hold it.

Every model this class can hold without a window, ``LlamaForCausalLM`` holds too and comes first
in the export order (``convert.py``), so export writes Mistral for such a model only when it was
imported from it or ``--architecture MistralForCausalLM`` asks; a model that slides in every
layer (and has no biases) is exported as Mistral, Llama having no window.
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, uniform_window, window_fields, window_unsupported, with_defaults
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, tensor_maps
from meshlm.models.config import ModelConfig

NAME = "MistralForCausalLM"
DEFAULT_SLIDING_WINDOW = 4096
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "initializer_range": 0.02, "max_position_embeddings": 4096 * 32}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    window = hf_config.get("sliding_window", DEFAULT_SLIDING_WINDOW)  # null is meaningful here
    return dense_decoder_config(hf, hf_config, NAME, **window_fields(window, [True] * hf["num_hidden_layers"]))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Mistral", qk_norm=False)
    reasons += window_unsupported(config, "Mistral", uniform_only=True)
    if config.attention_bias:
        reasons.append("model.attention_bias=True (Mistral's attention has no biases)")
    if config.mlp_bias:
        reasons.append("model.mlp_bias=True (Mistral's MLP has no biases)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return dense_decoder_to_hf(config, NAME, "mistral", DEFAULTS["max_position_embeddings"],
                               sliding_window=uniform_window(config))


ARCHITECTURE = Architecture(NAME, "mistral", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
