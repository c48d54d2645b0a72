"""``HunYuanDenseV1ForCausalLM`` <-> meshlm (Tencent 2025, Hunyuan 0.5B, 1.8B, 4B and 7B dense models).

A Hunyuan layer is Llama's (``llama.py``: RoPE attention with grouped KV heads, a SwiGLU MLP, the
same tensor names; biases on q/k/v/o iff ``attention_bias``) with a QK-norm of each head applied
to the *rotated* queries and keys (``query_layernorm``, ``key_layernorm``: meshlm ``model.qk_norm``
with ``qk_norm_after_rope``). The released configs ask for ``dynamic`` RoPE scaling with a fixed
``alpha``, which transformers computes as a static NTK stretch of the base,
theta * alpha ** (head_dim / (head_dim - 2)); meshlm reads that as its ``model.rope_theta`` and
writes it back as plain RoPE of that base (the same frequencies). Dynamic scaling without an
``alpha`` changes with the sequence length, and is refused.
"""

from __future__ import annotations

import dataclasses

from meshlm.hf.common import Architecture, TensorMap, window_unsupported, with_defaults
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported
from meshlm.hf.llama import tensor_maps as llama_tensor_maps
from meshlm.models.config import ModelConfig

NAME = "HunYuanDenseV1ForCausalLM"
MODEL_TYPE = "hunyuan_v1_dense"
DEFAULTS = {"vocab_size": 290943, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "attention_bias": False, "initializer_range": 0.02, "max_position_embeddings": 2048}
QK_NORM_NAMES = {".self_attn.q_norm.": ".self_attn.query_layernorm.", ".self_attn.k_norm.": ".self_attn.key_layernorm."}


def with_static_rope(hf_config: dict, head_dim: int) -> dict:
    """``hf_config`` with a fixed-alpha 'dynamic' RoPE as the plain RoPE of its stretched base."""
    parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind not in ("dynamic", "ntk_alpha") or not parameters.get("alpha"):
        return hf_config
    theta = float(parameters.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    stretched = theta * float(parameters["alpha"]) ** (head_dim / (head_dim - 2))
    return {**hf_config, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": stretched}}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return dense_decoder_config(hf, with_static_rope(hf_config, head_dim), NAME, qk_norm=True,
                                qk_norm_after_rope=True)


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Hunyuan", qk_norm=True, supported=frozenset({"qk_norm_after_rope"}))
    reasons += window_unsupported(config, "Hunyuan", uniform_only=False)
    if config.qk_norm and not config.qk_norm_after_rope:
        reasons.append("model.qk_norm_after_rope=False (Hunyuan normalizes the rotated queries and keys)")
    if config.mlp_bias:
        reasons.append("model.mlp_bias=True (Hunyuan's MLP has no biases)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                               attention_bias=config.attention_bias, use_qk_norm=True)


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Llama's, with the QK-norms under Hunyuan's names."""
    maps = []
    for entry in llama_tensor_maps(config):
        theirs = entry.theirs
        for llama_name, hunyuan_name in QK_NORM_NAMES.items():
            theirs = tuple(name.replace(llama_name, hunyuan_name) for name in theirs)
        maps.append(dataclasses.replace(entry, theirs=theirs))
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
