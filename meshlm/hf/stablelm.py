"""``StableLmForCausalLM`` <-> meshlm (Bellagente et al. 2024, "Stable LM 2 1.6B Technical Report";
Stability AI's StableLM-3B-4E1T): StableLM 2 1.6B, StableLM-3B-4E1T, StableLM Zephyr 3B, Stable
Code 3B.

A StableLM layer is Llama's -- RoPE attention with grouped KV heads, then a SwiGLU MLP without
biases -- with:

- **LayerNorm** with a bias (``model.norm=layernorm``, eps ``layer_norm_eps``) before each block
  and at the end, where Llama has RMSNorm;
- **partial rotary**: RoPE on the first quarter of each head's channels (``partial_rotary_factor``
  0.25: ``model.rope_fraction``), rotate-half pairs as meshlm's;
- biases on q, k and v only with ``use_qkv_bias`` (StableLM 2: ``model.attention_bias=true``,
  ``model.attention_output_bias=false``), none on o and the MLP.

``attention_dropout`` is ``model.attention_dropout`` and ``hidden_dropout`` (StableLM's, after the
MLP alone) ``model.hidden_dropout`` (after the embedding and every block). Training only.

With ``use_parallel_residual`` (StableLM 2 12B) attention and MLP read the same input through one
norm, ``h + attn(ln(h)) + mlp(ln(h))``: ``model.parallel_residual`` with
``model.parallel_residual_shared_norm``, the layer having no ``post_attention_layernorm``.

With ``qk_layernorm`` (StableLM 2 12B) each head of q and k has a LayerNorm of its own, without a
bias, before RoPE: ``model.qk_norm`` with ``qk_norm_type=layernorm`` and ``qk_norm_per_head``, its
weight [heads, head_dim] the checkpoint's ``q_layernorm.norms.{h}.weight`` stacked.
"""

from __future__ import annotations

from meshlm.hf.common import (QK_LAYERNORM_FEATURES, Architecture, TensorMap, embedding_maps, layer_norm_maps,
                              linear_maps, qk_layernorm_unsupported, rename, rope_with_defaults,
                              split_heads_unsupported, stack, window_unsupported, with_defaults)
from meshlm.hf.llama import attention_to_hf, dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported
from meshlm.models.config import ModelConfig

NAME = "StableLmForCausalLM"
MODEL_TYPE = "stablelm"
DEFAULTS = {"vocab_size": 50304, "intermediate_size": 6912, "hidden_size": 2560, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu",
            "max_position_embeddings": 4096, "initializer_range": 0.02, "layer_norm_eps": 1e-5,
            "tie_word_embeddings": False, "use_qkv_bias": False, "qk_layernorm": False,
            "use_parallel_residual": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "partial_rotary_factor": 0.25}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    bias, parallel, qk_norm = bool(hf["use_qkv_bias"]), bool(hf["use_parallel_residual"]), bool(hf["qk_layernorm"])
    rope = rope_with_defaults(hf_config, DEFAULTS["partial_rotary_factor"], 10000.0)
    return dense_decoder_config({**hf, "rms_norm_eps": hf["layer_norm_eps"]}, rope, NAME,
                                partial_rotary=True, norm="layernorm", attention_bias=bias,
                                attention_output_bias=False if bias else None,
                                hidden_dropout=float(hf["hidden_dropout"]), parallel_residual=parallel,
                                parallel_residual_shared_norm=parallel, qk_norm=qk_norm,
                                qk_norm_type="layernorm" if qk_norm else "rmsnorm", qk_norm_per_head=qk_norm)


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "StableLM", qk_norm=config.qk_norm, output_bias_apart=True,
                                        supported=frozenset({"norm", "rope_fraction", "parallel_residual",
                                                             "parallel_residual_shared_norm"}) | QK_LAYERNORM_FEATURES)
    reasons += qk_layernorm_unsupported(config, "StableLM", per_head=True, bias=False)
    if config.parallel_residual != config.parallel_residual_shared_norm:
        reasons.append("model.parallel_residual=true with model.parallel_residual_shared_norm=false (StableLM's "
                       "parallel layer has one norm for attention and MLP; GPTNeoXForCausalLM gives each its own)")
    reasons += window_unsupported(config, "StableLM", uniform_only=False)
    reasons += split_heads_unsupported(config, "StableLM")
    if config.norm != "layernorm":
        reasons.append(f"model.norm={config.norm!r} (StableLM's norms are LayerNorms)")
    if config.resolved_attention_output_bias or config.mlp_bias:
        reasons.append(f"model.attention_output_bias={config.attention_output_bias}, model.mlp_bias="
                       f"{config.mlp_bias} (StableLM's o_proj and MLP have no biases)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    rope = attention_to_hf(config)["rope_parameters"]
    values = dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                                 rope_parameters={**rope, "partial_rotary_factor": float(config.rope_fraction)},
                                 partial_rotary_factor=float(config.rope_fraction), layer_norm_eps=config.norm_eps,
                                 use_qkv_bias=config.attention_bias, qk_layernorm=config.qk_norm,
                                 use_parallel_residual=config.parallel_residual,
                                 hidden_dropout=config.hidden_dropout)
    del values["rms_norm_eps"], values["head_dim"]  # StableLM's heads always split the hidden size
    return values


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight")
    maps.append(rename("final_norm.bias", "model.norm.bias"))
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"model.layers.{layer}"
        maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.input_layernorm")
        for projection in ("q_proj", "k_proj", "v_proj"):
            maps += linear_maps(f"{attention}.mixer.{projection}", f"{theirs}.self_attn.{projection}",
                                config.attention_bias)
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.self_attn.o_proj", False)
        if config.qk_norm:  # one LayerNorm per head, their weights stacked
            for norm, heads in (("q", config.num_attention_heads), ("k", config.resolved_num_kv_heads)):
                per_head = [f"{theirs}.self_attn.{norm}_layernorm.norms.{head}.weight" for head in range(heads)]
                maps.append(stack(f"{attention}.mixer.{norm}_norm.weight", per_head))
        if not config.parallel_residual_shared_norm:  # else the MLP applies the attention block's norm
            maps += layer_norm_maps(f"{mlp}.norm", f"{theirs}.post_attention_layernorm")
        for projection in ("gate_proj", "up_proj", "down_proj"):
            maps += linear_maps(f"{mlp}.mixer.{projection}", f"{theirs}.mlp.{projection}", False)
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
