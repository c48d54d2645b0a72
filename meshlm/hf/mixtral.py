"""``MixtralForCausalLM`` <-> meshlm (Jiang et al. 2024, "Mixtral of Experts").

Every Mixtral layer is RoPE attention (no QK-norm, no biases) followed by a sparse MoE block of
SwiGLU experts, so HF layer i is blocks 2i ('*') and 2i+1 ('E'). The router takes the softmax
over all experts, keeps the top k and always renormalizes them to sum to one. The hub files keep
the original names ``w1`` (gate), ``w3`` (up) and ``w2`` (down):

    model.layers.{i}.block_sparse_moe.gate.weight           blocks.{2i+1}.mixer.router.weight
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  blocks.{2i+1}.mixer.experts.gate_weight[e]
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  blocks.{2i+1}.mixer.experts.up_weight[e]
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  blocks.{2i+1}.mixer.experts.down_weight[e]

Mixtral's RoPE base defaults to 1e6 when config.json does not say. A ``sliding_window`` (null in
the released models) applies to every layer: meshlm ``model.sliding_window``.
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, blocks_of, hf_common_fields, ours_only, rename, require,
                              rope_from_hf, uniform_window, window_fields, window_unsupported, with_defaults)
from meshlm.hf.llama import (attention_fields, attention_maps, attention_to_hf, decoder_embedding_maps,
                             decoder_unsupported)
from meshlm.hf.qwen3_moe import routed_expert_maps, softmax_moe_unsupported
from meshlm.models.config import ModelConfig

NAME = "MixtralForCausalLM"
DEFAULT_ROPE_THETA = 1e6
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "num_experts_per_tok": 2, "num_local_experts": 8,
            "router_aux_loss_coef": 0.001, "initializer_range": 0.02, "max_position_embeddings": 4096 * 32}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", "silu", "meshlm's experts are SwiGLU")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*E" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope",
        **rope_from_hf(hf_config, DEFAULT_ROPE_THETA, NAME),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False,
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"],
        moe_num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"], moe_score_function="softmax", moe_softmax_before_topk=True,
        moe_normalize_topk=True, moe_aux_loss_coeff=hf["router_aux_loss_coef"],
        **window_fields(hf.get("sliding_window"), [True] * hf["num_hidden_layers"]))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=False)
    reasons += blocks_of(config, r"(\*E)+", "Mixtral layers are attention then MoE: '*E' repeated")
    reasons += window_unsupported(config, "Mixtral", uniform_only=True)
    if config.mlp_activation != "swiglu":
        reasons.append(f"model.mlp_activation={config.mlp_activation!r} (Mixtral's experts are SwiGLU)")
    if config.attention_bias:
        reasons.append("model.attention_bias=True (Mixtral's attention has no biases)")
    return reasons + softmax_moe_unsupported(config, NAME, normalize_topk=True)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, "mixtral"), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_moe_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
            "sliding_window": uniform_window(config), "num_local_experts": config.moe_num_experts,
            "num_experts_per_tok": config.moe_top_k,
            "router_aux_loss_coef": config.moe_aux_loss_coeff, "router_jitter_noise": 0.0,
            "output_router_logits": False, "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def sparse_layer_maps(config: ModelConfig, layer: int) -> list[TensorMap]:
    """HF layer ``layer`` in Mixtral's hub names: attention, its norm, the router and the ``w1``/``w3``/
    ``w2`` experts under ``block_sparse_moe`` (the router's expert bias is the caller's: unused here,
    MiniMax-M2's score-correction bias)."""
    block, theirs = 2 * layer + 1, f"model.layers.{layer}.block_sparse_moe"
    maps = attention_maps(config, 2 * layer, layer)
    maps.append(rename(f"blocks.{block}.norm.weight", f"model.layers.{layer}.post_attention_layernorm.weight"))
    return maps + routed_expert_maps(block, f"{theirs}.gate.weight", lambda e: tuple(
        f"{theirs}.experts.{e}.{name}.weight" for name in ("w1", "w3", "w2")), config.moe_num_experts)


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        maps += sparse_layer_maps(config, layer)
        maps.append(ours_only(f"blocks.{2 * layer + 1}.mixer.router.expert_bias"))  # unused by softmax routing
    return maps


ARCHITECTURE = Architecture(NAME, "mixtral", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
