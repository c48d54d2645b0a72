"""``Qwen2ForCausalLM`` <-> meshlm (Qwen2 and Qwen2.5: Yang et al. 2024, "Qwen2 technical report").

A Qwen2 decoder layer is Llama's with biases on the query, key and value projections and none on
the output projection -- fixed by the class, not by config.json (meshlm ``model.attention_bias=true``
with ``model.attention_output_bias=false``). So HF layer i is blocks 2i ('*') and 2i+1 ('-') and
every tensor has Llama's name (``llama.py``), q/k/v with their ``.bias``. The small models tie the
output head to the embedding; Qwen2.5's long-context configs scale RoPE with YaRN
(``rope_from_hf``). Qwen2 can run its upper layers with sliding-window attention
(``use_sliding_window``, ``sliding_window``, and ``layer_types`` or else ``max_window_layers``):
meshlm's ``model.sliding_window`` with a ``sliding_window_pattern`` listing the layers
(``qwen_windows_from_hf``); ``sliding_window`` is ignored while sliding is off.

On export this is the class that fits a dense model with q/k/v biases and none on o (Llama's
biases come on all four projections or none).
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, with_defaults
from meshlm.hf.llama import (dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, qwen_windows_from_hf,
                             qwen_windows_to_hf, tensor_maps)
from meshlm.models.config import ModelConfig

NAME = "Qwen2ForCausalLM"
DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
            "max_window_layers": 28, "initializer_range": 0.02,
            "max_position_embeddings": 32768}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    return dense_decoder_config(hf, hf_config, NAME, attention_bias=True, attention_output_bias=False,
                                **qwen_windows_from_hf(hf, NAME))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Qwen2", qk_norm=False, output_bias_apart=True)
    if not config.attention_bias or config.resolved_attention_output_bias:
        reasons.append(f"model.attention_bias={config.attention_bias}, model.attention_output_bias="
                       f"{config.attention_output_bias} (Qwen2 has biases on q/k/v and none on o: true and false)")
    if config.mlp_bias:
        reasons.append("model.mlp_bias=True (Qwen2's MLP has no biases)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return dense_decoder_to_hf(config, NAME, "qwen2", DEFAULTS["max_position_embeddings"],
                               **qwen_windows_to_hf(config, config.num_blocks // 2))


ARCHITECTURE = Architecture(NAME, "qwen2", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
