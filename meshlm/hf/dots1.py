"""``Dots1ForCausalLM`` <-> meshlm (rednote hi lab 2025, dots.llm1: a 142B-parameter MoE, 14B active).

A dots.llm1 layer is Qwen3's attention (``qwen3.py``: RoPE with a QK-norm of each head, grouped KV
heads, biases on q/k/v/o iff ``attention_bias``) followed by a SwiGLU MLP in the first
``first_k_dense_replace`` layers and by DeepSeek-V3's MoE block after (``deepseek_v3.py``: sigmoid
scores, ``e_score_correction_bias`` steering the choice, group-limited top-k, a shared expert
``n_shared_experts`` wide; the same tensor names, as ``glm4_moe.py`` reads them). Layers from
``max_window_layers`` on attend within ``sliding_window`` when ``layer_types`` does not say
otherwise (transformers' rule).
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, TensorMap, hf_common_fields, require, rope_from_hf
from meshlm.hf.deepseek_v3 import (decoder_maps, dense_then_moe_pattern, dense_then_moe_unsupported,
                                   moe_config_with_defaults, moe_fields, moe_fields_to_hf, moe_unsupported,
                                   normalize_hf_tensors)
from meshlm.hf.llama import (attention_fields, attention_maps, attention_to_hf, decoder_unsupported,
                             qwen_windows_from_hf, qwen_windows_to_hf)
from meshlm.models.config import ModelConfig

NAME = "Dots1ForCausalLM"
MODEL_TYPE = "dots1"
DEFAULTS = {"vocab_size": 152064, "hidden_size": 4608, "intermediate_size": 10944, "moe_intermediate_size": 1408,
            "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 32, "n_shared_experts": 1,
            "n_routed_experts": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
            "first_k_dense_replace": 0, "norm_topk_prob": False, "hidden_act": "silu", "initializer_range": 0.02,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
            "routed_scaling_factor": 1.0, "max_window_layers": 62, "max_position_embeddings": 2048}


def windows_from_hf(hf: dict, hf_config: dict) -> dict:
    """meshlm's window fields: Qwen2's rule (``qwen_windows_from_hf``), always on: ``layer_types``,
    else the layers from ``max_window_layers`` on slide, when config.json gives a ``sliding_window``
    (its class default is 4096; null: none)."""
    return qwen_windows_from_hf({**hf, "use_sliding_window": True,
                                 "sliding_window": hf_config.get("sliding_window", 4096)}, NAME)


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = moe_config_with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", "silu", "meshlm's MLPs and experts are SwiGLU")
    pattern = dense_then_moe_pattern(hf)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern, **attention_fields(hf),
        qk_norm=True, position_embedding="rope", **rope_from_hf(hf_config, 10000.0, NAME),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False, norm="rmsnorm",
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"],
        **(moe_fields(hf, hf_config) if "E" in pattern else {}), **windows_from_hf(hf, hf_config))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=True) + dense_then_moe_unsupported(config, "dots.llm1")
    return reasons + moe_unsupported(config, NAME)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    layers = config.num_blocks // 2
    values = {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config), **moe_fields_to_hf(config),
              "num_hidden_layers": layers, "hidden_act": "silu", "intermediate_size": config.resolved_ffn_hidden_size,
              "rms_norm_eps": config.norm_eps, "attention_bias": config.attention_bias,
              **qwen_windows_to_hf(config, layers), "max_position_embeddings": DEFAULTS["max_position_embeddings"]}
    values.pop("use_sliding_window")  # (dots.llm1 has no such field: its window is on when set)
    return values


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return decoder_maps(config, lambda layer: attention_maps(config, 2 * layer, layer))


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
