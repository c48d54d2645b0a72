"""``Glm4MoeForCausalLM`` <-> meshlm (GLM-4.5, GLM-4.5-Air, GLM-4.6: Zhipu AI & Tsinghua 2025, "GLM-4.5:
Agentic, Reasoning, and Coding (ARC) Foundation Models").

A GLM-4.5 layer is grouped-query attention -- biases on q/k/v (``attention_bias``) and none on o, an
optional QK-norm per head (``use_qk_norm``: meshlm ``model.qk_norm``), RoPE on the first
``partial_rotary_factor`` (default 0.5) of each head's channels in rotate-half pairs (meshlm
``model.rope_fraction``; unlike GLM-4's interleaved pairs, no reordering) -- followed by a SwiGLU MLP
in the first ``first_k_dense_replace`` layers and by DeepSeek-V3's MoE block after (``deepseek_v3.py``):
sigmoid scores, the top k of score + ``e_score_correction_bias`` among each token's ``topk_group`` best
of ``n_group`` groups, renormalized iff ``norm_topk_prob``, times ``routed_scaling_factor``, beside a
shared expert ``n_shared_experts`` experts wide. HF layer i is blocks 2i ('*') and 2i+1 ('-', then
'E'); the attention tensors have Llama's names (``llama.py``), the MoE ones DeepSeek-V3's:

    model.layers.{i}.mlp.gate.weight, .e_score_correction_bias  blocks.{2i+1}.mixer.router.weight, .expert_bias
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj        blocks.{2i+1}.mixer.experts.*_weight[e]
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj     blocks.{2i+1}.mixer.shared_expert.*

The multi-token-prediction layers the files carry after the last layer (``num_nextn_predict_layers``),
which transformers skips, are meshlm's MTP depths, mapped as DeepSeek-V3's are
(``deepseek_v3.py``). The balance loss's weight travels as
DeepSeek's ``aux_loss_alpha`` and ``seq_aux`` (transformers keeps fields it does not use).
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, hf_common_fields, require, rope_from_hf, rope_with_defaults,
                              window_unsupported)
from meshlm.hf.deepseek_v3 import (decoder_maps, dense_then_moe_pattern, dense_then_moe_unsupported, fit_mtp_depth,
                                   moe_config_with_defaults, moe_fields, moe_fields_to_hf, moe_maps, moe_unsupported,
                                   mtp_copies, mtp_fields, mtp_maps, mtp_projection_halves, mtp_unsupported,
                                   normalize_hf_tensors, skipped_mtp_layers)
from meshlm.hf.llama import attention_fields, attention_maps, attention_to_hf, decoder_unsupported
from meshlm.models.config import ModelConfig

NAME = "Glm4MoeForCausalLM"
MODEL_TYPE = "glm4_moe"
DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
            "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu",
            "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
            "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
            "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "norm_topk_prob": True, "use_qk_norm": False}
PARTIAL_ROTARY, ROPE_THETA = 0.5, 10000.0


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = moe_config_with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", "silu", "meshlm's MLPs and experts are SwiGLU")
    pattern = dense_then_moe_pattern(hf)
    bias, mtp = bool(hf["attention_bias"]), mtp_fields(hf_config)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern, **attention_fields(hf),
        attention_output_bias=False if bias else None, qk_norm=bool(hf["use_qk_norm"]), position_embedding="rope",
        **rope_from_hf(rope_with_defaults(hf_config, PARTIAL_ROTARY, ROPE_THETA), ROPE_THETA, NAME,
                       partial_rotary=True),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False, norm="rmsnorm",
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"],
        **(moe_fields(hf, hf_config) if "E" in pattern or mtp else {}), **mtp)


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=config.qk_norm, output_bias_apart=True,
                                  supported=frozenset({"rope_fraction", "mtp_depth"}))
    reasons += mtp_unsupported(config, NAME)
    reasons += dense_then_moe_unsupported(config, "GLM-4.5")
    reasons += window_unsupported(config, "GLM-4.5", uniform_only=False)
    if config.resolved_attention_output_bias:
        reasons.append(f"model.attention_output_bias={config.attention_output_bias} (GLM-4.5's o_proj has no bias)")
    return reasons + moe_unsupported(config, NAME)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config), **moe_fields_to_hf(config),
              "num_hidden_layers": config.num_blocks // 2, "hidden_act": "silu",
              "intermediate_size": config.resolved_ffn_hidden_size, "rms_norm_eps": config.norm_eps,
              "attention_bias": config.attention_bias, "use_qk_norm": config.qk_norm,
              "partial_rotary_factor": float(config.rope_fraction), "num_nextn_predict_layers": config.mtp_depth,
              "max_position_embeddings": DEFAULTS["max_position_embeddings"]}
    values["rope_parameters"] = {**values["rope_parameters"], "partial_rotary_factor": float(config.rope_fraction)}
    return values


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_maps(config, lambda layer: attention_maps(config, 2 * layer, layer))
    return maps + mtp_maps(config, lambda layer: attention_maps(config, 2 * layer, layer)
                           + moe_maps(config, layer))


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors, mtp_projection_halves, skipped_mtp_layers, fit_mtp_depth,
                            mtp_copies)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
