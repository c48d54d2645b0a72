"""``GraniteForCausalLM`` <-> meshlm (IBM Granite 3.x dense models; Mishra et al. 2024, "Granite Code
Models", and the Granite 3.0 report).

A Granite layer is Llama's (``llama.py``: RoPE attention with grouped KV heads, a SwiGLU MLP,
RMSNorm; the same tensor names) with four constants from muP-style training (Yang et al. 2021,
"Tensor Programs V"), each a meshlm field any model may use:

- ``embedding_multiplier``: the token embeddings times it (``model.embedding_multiplier``);
- ``attention_multiplier``: the factor on q k^T in place of 1/sqrt(head_dim)
  (``model.attention_scale``; a value equal to 1/sqrt(head_dim) reads as the default);
- ``residual_multiplier``: each block's output times it before the residual add
  (``model.residual_multiplier``);
- ``logits_scaling``: the logits divided by it (``model.logit_divisor``).
"""

from __future__ import annotations

from meshlm.hf.common import Architecture, window_unsupported, with_defaults
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, tensor_maps
from meshlm.models.config import ModelConfig

NAME = "GraniteForCausalLM"
MODEL_TYPE = "granite"
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "max_position_embeddings": 2048,
            "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
            "attention_multiplier": 1.0}
SUPPORTED_FEATURES = frozenset({"embedding_multiplier", "attention_scale", "residual_multiplier", "logit_divisor"})


def mup_fields(hf: dict) -> dict:
    """meshlm's fields of Granite's four muP constants (``hf``: config.json with the defaults); an
    attention_multiplier of 1/sqrt(head_dim) reads as the default scale."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    scale = float(hf["attention_multiplier"])
    return {"attention_scale": None if scale == head_dim ** -0.5 else scale,
            "embedding_multiplier": float(hf["embedding_multiplier"]),
            "residual_multiplier": float(hf["residual_multiplier"]), "logit_divisor": float(hf["logits_scaling"])}


def mup_to_hf(config: ModelConfig) -> dict:
    """``mup_fields`` read back."""
    scale = config.resolved_head_dim ** -0.5 if config.attention_scale is None else config.attention_scale
    return {"embedding_multiplier": config.embedding_multiplier, "attention_multiplier": scale,
            "residual_multiplier": config.residual_multiplier, "logits_scaling": config.logit_divisor}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    return dense_decoder_config(hf, hf_config, NAME, **mup_fields(hf))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Granite", qk_norm=False, supported=SUPPORTED_FEATURES)
    reasons += window_unsupported(config, "Granite", uniform_only=False)
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                               attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, **mup_to_hf(config))


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
