"""``Gemma2ForCausalLM`` <-> meshlm (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a
Practical Size").

A Gemma 2 layer is Gemma 3's (``gemma3.py``) without QK-norm and with one RoPE for every layer:

- **sandwich norms** (``model.block_output_norm``): ``input_layernorm`` and
  ``post_attention_layernorm`` around attention, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` around the MLP; all RMSNorms are **zero-centered**
  (``model.norm_zero_centered``: 1 + weight, the files store the weight);
- **scaled embeddings** (``model.embedding_multiplier`` = sqrt(hidden_size)), **GeGLU**
  (``model.mlp_activation=geglu``: gelu_pytorch_tanh(gate) * up) and a tied output head;
- **alternating attention**: even layers attend within a sliding window (4096), odd layers to every
  earlier token (``layer_types``, else that rule: ``model.sliding_window_pattern=SF``);
- **soft-capping** (``meshlm/models/softcap.py``): attention scores become 50 tanh(s / 50)
  (``attn_logit_softcapping``: ``model.attention_softcap``) and the output logits 30 tanh(z / 30)
  (``final_logit_softcapping``: ``model.final_logit_softcap``). A config.json that sets either to
  null has none; one that leaves it out has the class default.

The attention scale is ``query_pre_attn_scalar ** -0.5``: 1/sqrt(head_dim) in 2B and 9B, and in
27B (head_dim 128, scalar 144 = hidden / heads) ``model.attention_scale``.
"""

from __future__ import annotations

from meshlm.hf.common import (SLIDING_ATTENTION, Architecture, hf_common_fields, layer_types_from_hf, layer_types_to_hf,
                              require, rope_from_hf, rope_to_hf, window_fields, with_defaults)
from meshlm.hf.gemma3 import GELU_TANH, gemma_layer_fields, gemma_unsupported, query_pre_attn_scalar, tensor_maps
from meshlm.hf.llama import attention_fields
from meshlm.models.config import ModelConfig

NAME = "Gemma2ForCausalLM"
MODEL_TYPE = "gemma2"
SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
"""The class defaults of the two caps, taken when config.json leaves a cap out (null: no cap)."""
DEFAULTS = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "use_bidirectional_attention": False, "initializer_range": 0.02, "max_position_embeddings": 8192}
FULL_EVERY = 2
"""Without ``layer_types``, every second layer is full (layer 0 slides)."""
FIXED_FIELDS = {"mlp_activation": "geglu", "qk_norm": False, "norm_zero_centered": True, "block_output_norm": True,
                "position_embedding": "rope", "attention_bias": False, "mlp_bias": False}
"""What every Gemma 2 layer has."""
SUPPORTED_FEATURES = frozenset({"block_output_norm", "norm_zero_centered", "embedding_multiplier", "attention_scale",
                                "attention_softcap", "final_logit_softcap"})


def softcap_fields(hf_config: dict, defaults: dict) -> dict:
    """``model.attention_softcap`` and ``model.final_logit_softcap`` from config.json's
    ``attn_logit_softcapping`` and ``final_logit_softcapping``: a cap it gives, None where it gives
    null, the class default (``defaults``) where it gives nothing."""
    caps = {name: hf_config.get(name, default) for name, default in defaults.items()}
    return {"attention_softcap": caps["attn_logit_softcapping"], "final_logit_softcap": caps["final_logit_softcapping"]}


def softcaps_to_hf(config: ModelConfig) -> dict:
    """``softcap_fields`` read back."""
    return {"attn_logit_softcapping": config.attention_softcap, "final_logit_softcapping": config.final_logit_softcap}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_activation", GELU_TANH, "meshlm's GeGLU is gelu_pytorch_tanh(gate) * up")
    require(hf, NAME, "use_bidirectional_attention", False, "meshlm attention is causal")
    scalar = hf["query_pre_attn_scalar"]
    types = layer_types_from_hf(hf, NAME, FULL_EVERY)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **attention_fields(hf), attention_scale=None if scalar == hf["head_dim"] else scalar ** -0.5,
        **softcap_fields(hf_config, SOFTCAPS), position_embedding="rope", **rope_from_hf(hf_config, 10000.0, NAME),
        **window_fields(hf["sliding_window"], [kind == SLIDING_ATTENTION for kind in types]), **gemma_layer_fields(hf))


def unsupported(config: ModelConfig) -> list[str]:
    return gemma_unsupported(config, "Gemma 2", SUPPORTED_FEATURES, FIXED_FIELDS)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, MODEL_TYPE),
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.resolved_num_kv_heads,
            "head_dim": config.resolved_head_dim, "query_pre_attn_scalar": query_pre_attn_scalar(config),
            "attention_dropout": config.attention_dropout, "attention_bias": False,
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "rms_norm_eps": config.norm_eps, "sliding_window": config.sliding_window or DEFAULTS["sliding_window"],
            "layer_types": layer_types_to_hf(config), **rope_to_hf(config), **softcaps_to_hf(config),
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
