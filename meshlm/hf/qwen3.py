"""``Qwen3ForCausalLM`` <-> meshlm (Qwen3 technical report, 2025).

A dense Qwen3 decoder layer is Llama's with QK-norm: RMSNorm over each head's channels of the
queries and keys, before RoPE (meshlm ``model.qk_norm``). So HF layer i is blocks 2i ('*') and
2i+1 ('-'), and the tensor map is Llama's (``llama.tensor_maps``), whose attention part adds the
two norms of each layer when ``qk_norm`` is on:

    model.layers.{i}.self_attn.{q,k}_norm.weight  blocks.{2i}.mixer.{q,k}_norm.weight

``head_dim`` is explicit (128 when config.json does not say, whatever the hidden size; an absent
``num_key_value_heads`` is likewise 32, not the number of query heads) and the small models tie
the output head to the embedding. The MLP has no biases; the attention projections have them iff
``attention_bias``. Qwen3 can run some layers with sliding-window attention
(``use_sliding_window``, ``sliding_window``, ``layer_types`` or ``max_window_layers``), read as
Qwen2's (``qwen_windows_from_hf``); ``sliding_window`` is ignored while sliding is off.

On export this is the first class that fits a dense QK-norm model (``convert.py``'s order: Llama
has no QK-norm); ``--architecture Qwen3MoeForCausalLM`` writes the same model as a Qwen3-MoE
without MoE layers.
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, with_defaults
from meshlm.hf.llama import (dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, qwen_windows_from_hf,
                             qwen_windows_to_hf, tensor_maps)
from meshlm.models.config import ModelConfig

NAME = "Qwen3ForCausalLM"
DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": 4096, "max_window_layers": 28, "initializer_range": 0.02,
            "max_position_embeddings": 32768}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    return dense_decoder_config(hf, hf_config, NAME, qk_norm=True, **qwen_windows_from_hf(hf, NAME))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Qwen3", qk_norm=True)
    if config.mlp_bias:
        reasons.append("model.mlp_bias=True (Qwen3's MLP has no biases)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return dense_decoder_to_hf(config, NAME, "qwen3", DEFAULTS["max_position_embeddings"],
                               attention_bias=config.attention_bias,
                               **qwen_windows_to_hf(config, config.num_blocks // 2))


ARCHITECTURE = Architecture(NAME, "qwen3", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
