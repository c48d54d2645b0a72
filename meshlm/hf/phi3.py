"""``Phi3ForCausalLM`` <-> meshlm (Abdin et al. 2024, "Phi-3 Technical Report"; Phi-4, 2024).

A Phi-3 decoder layer is Llama's -- RoPE attention with grouped KV heads, then a SwiGLU MLP, RMSNorm
before each, no biases -- with its projections fused: one ``qkv_proj`` whose rows are the query,
key and value projections in that order, and one ``gate_up_proj`` whose first half is the gate and
second the up projection. meshlm keeps them apart, so each is a range of rows of the HF tensor
(``fused_rows``): cut out on import, concatenated back on export. Phi-3-mini (4k) attends within a
sliding window of 2047 tokens in every layer (``model.sliding_window``); Phi-4 attends to everything.

Phi-4-mini rotates the first three quarters of each head (``partial_rotary_factor`` 0.75:
``model.rope_fraction``). The 128k-context models (Phi-3-mini/medium-128k, Phi-3.5, Phi-4-mini)
stretch RoPE with ``longrope`` (``model.rope_scaling=longrope``: a short and a long factor per
rotated pair, the long ones past ``original_max_position_embeddings``); as transformers' Phi-3
config does, a ``su`` or ``yarn`` type there means ``longrope``.
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, fused_rows, linear_maps, rename, uniform_window, window_fields,
                              window_unsupported, with_defaults)
from meshlm.hf.llama import (attention_to_hf, decoder_embedding_maps, dense_decoder_config, dense_decoder_to_hf,
                             dense_decoder_unsupported)
from meshlm.models.config import ModelConfig

NAME = "Phi3ForCausalLM"
DEFAULTS = {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "initializer_range": 0.02, "max_position_embeddings": 4096}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    windows = window_fields(hf_config.get("sliding_window"), [True] * hf["num_hidden_layers"])
    contexts = {"max_position_embeddings": hf["max_position_embeddings"],  # LongRoPE's factor is their ratio
                "original_max_position_embeddings": hf_config.get("original_max_position_embeddings",
                                                                  DEFAULTS["max_position_embeddings"])}
    return dense_decoder_config(hf, with_longrope_named({**hf_config, **contexts}), NAME, partial_rotary=True,
                                **windows)


def with_longrope_named(hf_config: dict) -> dict:
    """``hf_config`` with a RoPE type of ``su`` or ``yarn`` named ``longrope``: transformers' Phi-3
    config reads both so (older Phi-3 files say ``su``)."""
    key = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    parameters = hf_config.get(key) or {}
    kind = parameters.get("rope_type", parameters.get("type"))
    if kind not in ("su", "yarn"):
        return hf_config
    return {**hf_config, key: {**{name: value for name, value in parameters.items() if name != "type"},
                               "rope_type": "longrope"}}


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Phi-3", qk_norm=False, supported=frozenset({"rope_fraction"}))
    reasons += window_unsupported(config, "Phi-3", uniform_only=True)
    if config.attention_bias or config.mlp_bias:
        reasons.append(f"model.attention_bias={config.attention_bias}, model.mlp_bias={config.mlp_bias} (Phi-3's "
                       "projections have no biases)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    rope = {**attention_to_hf(config)["rope_parameters"], "partial_rotary_factor": float(config.rope_fraction)}
    # explicit nulls: Phi-3's defaults (32000) lie outside a smaller vocabulary, and transformers' embedding
    # refuses such a padding id; the model's own ids (from its "hf" record or its tokenizer) replace them
    return dense_decoder_to_hf(config, NAME, "phi3", DEFAULTS["max_position_embeddings"], rope_parameters=rope,
                               bos_token_id=None, eos_token_id=None, pad_token_id=None,
                               sliding_window=uniform_window(config),
                               original_max_position_embeddings=(config.rope_original_max_positions
                                                                 if config.rope_scaling == "longrope"
                                                                 else DEFAULTS["max_position_embeddings"]))


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    query, key_value = (config.num_attention_heads * config.resolved_head_dim,
                        config.resolved_num_kv_heads * config.resolved_head_dim)
    width = config.resolved_ffn_hidden_size
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"model.layers.{layer}"
        maps.append(rename(f"{attention}.norm.weight", f"{theirs}.input_layernorm.weight"))
        maps += fused_rows([(f"{attention}.mixer.q_proj.weight", query),
                            (f"{attention}.mixer.k_proj.weight", key_value),
                            (f"{attention}.mixer.v_proj.weight", key_value)], f"{theirs}.self_attn.qkv_proj.weight")
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.self_attn.o_proj", False)
        maps.append(rename(f"{mlp}.norm.weight", f"{theirs}.post_attention_layernorm.weight"))
        maps += fused_rows([(f"{mlp}.mixer.gate_proj.weight", width), (f"{mlp}.mixer.up_proj.weight", width)],
                           f"{theirs}.mlp.gate_up_proj.weight")
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.down_proj", False)
    return maps


ARCHITECTURE = Architecture(NAME, "phi3", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
