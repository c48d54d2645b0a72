"""``GlmForCausalLM`` and ``Glm4ForCausalLM`` <-> meshlm (Team GLM 2024, "ChatGLM: A Family of Large
Language Models from GLM-130B to GLM-4 All Tools"): GLM-4-9B (the ``-hf`` folders), and GLM-4-0414
(9B, 32B) with GLM-Z1.

A GLM layer is Llama's -- RoPE attention with grouped KV heads, a SwiGLU MLP, RMSNorm -- with:

- **partial rotary over interleaved pairs**: RoPE turns the first half of each head
  (``partial_rotary_factor`` 0.5: ``model.rope_fraction``) in pairs (2j, 2j + 1), where meshlm
  rotates (j, j + d/2): import takes those rows of ``q_proj`` and ``k_proj`` (and their biases) in
  the order ``half_from_interleaved`` gives, the same on both, so no score changes, and export puts
  them back;
- biases on q, k and v alone (``attention_bias``: ``model.attention_bias`` with
  ``model.attention_output_bias=false``);
- one ``gate_up_proj`` whose first half is the gate and second the up projection, cut into
  meshlm's two on import and joined on export.

GLM-4-0414 (``Glm4ForCausalLM``) adds a norm after each sublayer, ``post_self_attn_layernorm`` and
``post_mlp_layernorm``: ``h + norm(mixer(norm(h)))``, ``model.block_output_norm``.
"""

from __future__ import annotations

from functools import partial

from meshlm.errors import ConfigError
from meshlm.hf.common import (Architecture, RegroupedRows, TensorMap, deinterleaved_rotary_rows, embedding_maps,
                              fused_rows, linear_maps, query_key_tensors, rename, rope_with_defaults, rows_of,
                              window_unsupported, with_defaults)
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported
from meshlm.models.config import ModelConfig

GLM_NAME, GLM4_NAME = "GlmForCausalLM", "Glm4ForCausalLM"
DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1.5625e-07,
            "tie_word_embeddings": False, "attention_bias": True, "attention_dropout": 0.0}
PARTIAL_ROTARY = 0.5
ROPE_THETA = 10000.0


def config_from_hf(hf_config: dict, name: str, post_norms: bool) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    bias = bool(hf["attention_bias"])
    return dense_decoder_config(hf, rope_with_defaults(hf_config, PARTIAL_ROTARY, ROPE_THETA), name, partial_rotary=True,
                                attention_output_bias=False if bias else None, block_output_norm=post_norms)


def unsupported(config: ModelConfig, label: str, post_norms: bool) -> list[str]:
    supported = frozenset({"rope_fraction", "block_output_norm"} if post_norms else {"rope_fraction"})
    reasons = dense_decoder_unsupported(config, label, qk_norm=False, output_bias_apart=True, supported=supported)
    reasons += window_unsupported(config, label, uniform_only=False)
    if config.block_output_norm != post_norms:
        reasons.append(f"model.block_output_norm={config.block_output_norm} ({label}'s layers "
                       f"{'normalize' if post_norms else 'do not normalize'} each sublayer's output)")
    if config.resolved_attention_output_bias or config.mlp_bias:
        reasons.append(f"model.attention_output_bias={config.attention_output_bias}, model.mlp_bias={config.mlp_bias} "
                       f"({label}'s o_proj and MLP have no biases)")
    return reasons


def config_to_hf(config: ModelConfig, name: str, model_type: str, label: str, post_norms: bool) -> dict:
    reasons = unsupported(config, label, post_norms)
    if reasons:
        raise ConfigError(f"this model cannot be written as {name}: " + "; ".join(reasons) + ".")
    # explicit null token ids: GLM's defaults (151329 and up) lie outside a smaller vocabulary; the
    # model's own ids (from its "hf" record or its tokenizer) replace them
    values = dense_decoder_to_hf(config, name, model_type, DEFAULTS["max_position_embeddings"],
                                 attention_bias=config.attention_bias, partial_rotary_factor=float(config.rope_fraction),
                                 pad_token_id=None, eos_token_id=None, bos_token_id=None)
    values["rope_parameters"] = {**values["rope_parameters"], "partial_rotary_factor": float(config.rope_fraction)}
    return values


def tensor_maps(config: ModelConfig, post_norms: bool) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight")
    head_dim, width = config.resolved_head_dim, config.resolved_ffn_hidden_size
    # rows of their HF tensors, then reordered (regrouped_rows)
    maps += [rows_of(ours, theirs, 0, heads * head_dim) for ours, theirs, heads in query_key_tensors(config)]
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"model.layers.{layer}"
        maps.append(rename(f"{attention}.norm.weight", f"{theirs}.input_layernorm.weight"))
        maps += linear_maps(f"{attention}.mixer.v_proj", f"{theirs}.self_attn.v_proj", config.attention_bias)
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.self_attn.o_proj", False)
        maps.append(rename(f"{mlp}.norm.weight", f"{theirs}.post_attention_layernorm.weight"))
        maps += fused_rows([(f"{mlp}.mixer.gate_proj.weight", width), (f"{mlp}.mixer.up_proj.weight", width)],
                           f"{theirs}.mlp.gate_up_proj.weight")
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.down_proj", False)
        if post_norms:
            maps += [rename(f"{attention}.output_norm.weight", f"{theirs}.post_self_attn_layernorm.weight"),
                     rename(f"{mlp}.output_norm.weight", f"{theirs}.post_mlp_layernorm.weight")]
    return maps


def regrouped_rows(config: ModelConfig) -> list[RegroupedRows]:
    """q_proj and k_proj (weights and biases) of every layer, the rotary rows of each head de-interleaved."""
    head_dim = config.resolved_head_dim
    return [RegroupedRows(((ours, heads * head_dim),), theirs,
                          deinterleaved_rotary_rows(heads, head_dim, config.rotary_dim))
            for ours, theirs, heads in query_key_tensors(config)]


def architecture(name: str, model_type: str, label: str, post_norms: bool) -> Architecture:
    """One of the two classes: GLM's layer, with the sublayer output norms (``post_norms``) or without."""
    return Architecture(name, model_type, partial(config_from_hf, name=name, post_norms=post_norms),
                        partial(config_to_hf, name=name, model_type=model_type, label=label, post_norms=post_norms),
                        partial(tensor_maps, post_norms=post_norms),
                        partial(unsupported, label=label, post_norms=post_norms), regrouped_rows=regrouped_rows)


GLM_ARCHITECTURE = architecture(GLM_NAME, "glm", "GLM", post_norms=False)
GLM4_ARCHITECTURE = architecture(GLM4_NAME, "glm4", "GLM-4-0414", post_norms=True)
