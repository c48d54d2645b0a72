"""``OlmoeForCausalLM`` <-> meshlm (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts
Language Models"): OLMoE-1B-7B, a fully open MoE whose data, code and intermediate checkpoints are
public.

An OLMoE layer is Llama's pre-norm attention -- RoPE, with QK-norm over the *whole* query and key
projections (one RMSNorm weight per channel, as OLMo 2: ``model.qk_norm_scope=all``) -- followed by
a sparse MoE block in every layer: softmax over all experts, the top ``num_experts_per_tok`` kept,
renormalized only with ``norm_topk_prob`` (false in OLMoE-1B-7B), SwiGLU experts of
``intermediate_size`` without biases and no shared expert. The experts' tensors are Qwen3-MoE's
(one ``nn.Linear`` per expert in the hub files, fused in transformers' memory layout; both are read,
``qwen3_moe.py``). ``clip_qkv`` (clamping q, k and v) is refused by name.
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, blocks_of, hf_common_fields, ours_only, rename, require,
                              rope_from_hf, window_unsupported, with_defaults)
from meshlm.hf.llama import (attention_fields, attention_maps, attention_to_hf, decoder_embedding_maps,
                             decoder_unsupported)
from meshlm.hf.qwen3_moe import normalize_hf_tensors, routed_expert_maps, softmax_moe_unsupported
from meshlm.models.config import ModelConfig

NAME = "OlmoeForCausalLM"
MODEL_TYPE = "olmoe"
DEFAULTS = {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
            "num_attention_heads": 16, "hidden_act": "silu", "max_position_embeddings": 4096,
            "initializer_range": 0.02, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False,
            "clip_qkv": None, "num_experts_per_tok": 8, "num_experts": 64, "router_aux_loss_coef": 0.01,
            "norm_topk_prob": False}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    if "num_local_experts" in hf_config:  # transformers v5 saves the attribute-mapped name
        hf["num_experts"] = hf_config["num_local_experts"]
    require(hf, NAME, "hidden_act", "silu", "meshlm's experts are SwiGLU")
    require(hf, NAME, "clip_qkv", None, "meshlm does not clamp the queries, keys and values")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*E" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope", qk_norm=True, qk_norm_scope="all",
        **rope_from_hf(hf_config, 10000.0, NAME), mlp_activation="swiglu", mlp_bias=False,
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"],
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"],
        moe_num_experts=hf["num_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"], moe_score_function="softmax", moe_softmax_before_topk=True,
        moe_normalize_topk=bool(hf["norm_topk_prob"]), moe_aux_loss_coeff=hf["router_aux_loss_coef"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=True, supported=frozenset({"qk_norm_scope"}))
    reasons += blocks_of(config, r"(\*E)+", "OLMoE layers are attention then MoE: '*E' repeated")
    reasons += window_unsupported(config, "OLMoE", uniform_only=False)
    if config.qk_norm and config.qk_norm_scope != "all":
        reasons.append(f"model.qk_norm_scope={config.qk_norm_scope!r} (OLMoE normalizes the whole query and key "
                       "projections: 'all')")
    if config.mlp_activation != "swiglu" or config.mlp_bias:
        reasons.append(f"model.mlp_activation={config.mlp_activation!r}, model.mlp_bias={config.mlp_bias} (OLMoE's "
                       "experts are SwiGLU without biases)")
    return reasons + softmax_moe_unsupported(config, NAME, normalize_topk=None)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_moe_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "attention_bias": config.attention_bias,
            "clip_qkv": None, "num_experts": config.moe_num_experts, "num_experts_per_tok": config.moe_top_k,
            "norm_topk_prob": config.moe_normalize_topk, "router_aux_loss_coef": config.moe_aux_loss_coeff,
            "output_router_logits": False, "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        block, theirs = 2 * layer + 1, f"model.layers.{layer}"
        maps += attention_maps(config, 2 * layer, layer)  # input_layernorm, q/k/v/o, q_norm/k_norm
        maps.append(rename(f"blocks.{block}.norm.weight", f"{theirs}.post_attention_layernorm.weight"))
        maps += routed_expert_maps(block, f"{theirs}.mlp.gate.weight", lambda e, mlp=f"{theirs}.mlp": tuple(
            f"{mlp}.experts.{e}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")),
            config.moe_num_experts)
        maps.append(ours_only(f"blocks.{block}.mixer.router.expert_bias"))  # unused by softmax routing
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
