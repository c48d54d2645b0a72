"""``GemmaForCausalLM`` <-> meshlm (Gemma Team 2024, "Gemma: Open Models Based on Gemini Research
and Technology"): Gemma 2B and 7B, CodeGemma, and the fine-tunes built on them.

A Gemma layer is Llama's (``llama.py``: RoPE attention, the same tensor names; 2B has one KV
head, head_dim 256) with three of the choices Gemma 2 and 3 keep (``gemma3.py``):

- a **GeGLU** MLP (``model.mlp_activation=geglu``: gelu_pytorch_tanh(gate) * up). Older
  config.json files say ``hidden_act: gelu``, which transformers reads as the tanh approximation
  the models were trained with, and so does meshlm;
- **zero-centered** RMSNorms (``model.norm_zero_centered``: 1 + weight, the files store the weight);
- embeddings scaled by sqrt(hidden_size) (``model.embedding_multiplier``), and a tied output head.

No sliding windows, soft caps or norms after the sublayers (those are Gemma 2's).
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, hf_common_fields, require, rope_from_hf, rope_to_hf, window_unsupported,
                              with_defaults)
from meshlm.hf.gemma3 import gemma_layer_fields, gemma_unsupported
from meshlm.hf.llama import attention_fields, tensor_maps
from meshlm.models.config import ModelConfig

NAME = "GemmaForCausalLM"
MODEL_TYPE = "gemma"
DEFAULTS = {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
            "use_bidirectional_attention": False, "initializer_range": 0.02, "max_position_embeddings": 8192}
GELU = ("gelu", "gelu_pytorch_tanh", "gelu_tanh")
"""``hidden_act`` values meaning the tanh-approximated GELU (transformers rewrites a legacy 'gelu')."""
FIXED_FIELDS = {"mlp_activation": "geglu", "qk_norm": False, "norm_zero_centered": True, "block_output_norm": False,
                "position_embedding": "rope", "attention_bias": False, "mlp_bias": False}
"""What every Gemma layer has."""
SUPPORTED_FEATURES = frozenset({"norm_zero_centered", "embedding_multiplier"})


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    hf["hidden_act"] = hf_config.get("hidden_activation") or hf["hidden_act"]  # v4's override, when set
    require(hf, NAME, "hidden_act", GELU, "meshlm's GeGLU is gelu_pytorch_tanh(gate) * up")
    require(hf, NAME, "attention_bias", False, "meshlm reads Gemma's attention without biases")
    require(hf, NAME, "use_bidirectional_attention", (False, None), "meshlm attention is causal")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope", **rope_from_hf(hf_config, 10000.0, NAME),
        **{**gemma_layer_fields(hf), "block_output_norm": False})


def unsupported(config: ModelConfig) -> list[str]:
    return (gemma_unsupported(config, "Gemma", SUPPORTED_FEATURES, FIXED_FIELDS)
            + window_unsupported(config, "Gemma", uniform_only=False))


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, MODEL_TYPE),
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.resolved_num_kv_heads,
            "head_dim": config.resolved_head_dim, "attention_dropout": config.attention_dropout,
            "attention_bias": False, "num_hidden_layers": config.num_blocks // 2,
            "intermediate_size": config.resolved_ffn_hidden_size, "hidden_act": "gelu_pytorch_tanh",
            "rms_norm_eps": config.norm_eps, **rope_to_hf(config),
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
