"""``Qwen3MoeForCausalLM`` <-> meshlm (Qwen3 technical report, 2025).

A Qwen3-MoE decoder layer is Llama's (RoPE attention, here always with QK-norm: RMSNorm over
each head's channels before RoPE) followed by either a sparse MoE block or, for layers listed in
``mlp_only_layers`` or off the ``decoder_sparse_step`` grid, a dense SwiGLU MLP. HF layer i is
therefore blocks 2i ('*') and 2i+1 ('E' or '-').

Routing: softmax over all experts, keep the top k, renormalize them to sum to one iff
``norm_topk_prob`` (meshlm: score 'softmax', softmax_before_topk, normalize_topk). The experts
are SwiGLU MLPs without biases; the hub files store them one ``nn.Linear`` per expert, which
meshlm stacks:

    model.layers.{i}.mlp.gate.weight                      blocks.{2i+1}.mixer.router.weight
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight     blocks.{2i+1}.mixer.experts.gate_weight[e]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight       blocks.{2i+1}.mixer.experts.up_weight[e]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight     blocks.{2i+1}.mixer.experts.down_weight[e]

transformers' in-memory layout (a fused ``experts.gate_up_proj`` [E, 2F, d] and a stacked
``experts.down_proj``) is accepted on import too.
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, blocks_of, hf_common_fields, ours_only, rename, require,
                              rope_from_hf, split_fused_experts, stack, uniform_window, window_fields,
                              window_unsupported, with_defaults)
from meshlm.hf.llama import (attention_fields, attention_maps, attention_to_hf, decoder_embedding_maps,
                             decoder_unsupported, dense_mlp_maps)
from meshlm.models.config import ModelConfig

NAME = "Qwen3MoeForCausalLM"
DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
            "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
            "num_experts": 128,
            "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": [],
            "initializer_range": 0.02, "max_position_embeddings": 32768}


def routed_expert_maps(block: int, router: str, expert_names, num_experts: int, gated: bool = True
                       ) -> list[TensorMap]:
    """Router and stacked experts of one MoE block; ``expert_names(e)`` gives expert e's
    (gate, up, down) HF weight names."""
    ours = f"blocks.{block}.mixer"
    names = [expert_names(expert) for expert in range(num_experts)]
    maps = [rename(f"{ours}.router.weight", router)]
    if gated:
        maps.append(stack(f"{ours}.experts.gate_weight", [gate for gate, _, _ in names]))
    maps += [stack(f"{ours}.experts.up_weight", [up for _, up, _ in names]),
             stack(f"{ours}.experts.down_weight", [down for _, _, down in names])]
    return maps


def softmax_moe_unsupported(config: ModelConfig, architecture: str, normalize_topk: bool | None,
                            gated_shared_expert: bool = False) -> list[str]:
    """Reasons a config's MoE blocks differ from a softmax-then-top-k router over biasless SwiGLU
    experts (``normalize_topk`` None: either is fine), without a shared expert or, with
    ``gated_shared_expert``, always with a gated one (Qwen2-MoE)."""
    if "E" not in config.block_kinds:
        return []
    reasons = []
    if config.moe_score_function != "softmax" or not config.moe_softmax_before_topk:
        reasons.append(f"model.moe_score_function={config.moe_score_function!r} / moe_softmax_before_topk="
                       f"{config.moe_softmax_before_topk} ({architecture} routes by softmax over all experts, "
                       "then top-k)")
    if normalize_topk is not None and config.moe_normalize_topk != normalize_topk:
        reasons.append(f"model.moe_normalize_topk={config.moe_normalize_topk} ({architecture} always "
                       f"{'renormalizes' if normalize_topk else 'keeps'} the top-k weights)")
    if config.moe_routed_scaling_factor != 1.0:
        reasons.append(f"model.moe_routed_scaling_factor={config.moe_routed_scaling_factor} ({architecture} "
                       "has no routed scaling)")
    shared = config.moe_shared_expert_ffn_hidden_size
    if gated_shared_expert and not (shared and config.moe_shared_expert_gate):
        reasons.append(f"model.moe_shared_expert_ffn_hidden_size={shared}, model.moe_shared_expert_gate="
                       f"{config.moe_shared_expert_gate} ({architecture}'s MoE blocks always have a gated shared "
                       "expert: a positive width and true)")
    elif shared and not gated_shared_expert:
        reasons.append(f"model.moe_shared_expert_ffn_hidden_size={shared} ({architecture} has no shared expert)")
    if config.moe_latent_size is not None:
        reasons.append(f"model.moe_latent_size={config.moe_latent_size} ({architecture} has no latent projection)")
    return reasons


def is_sparse_layer(hf: dict, layer: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers hold an MoE block."""
    return (layer not in hf["mlp_only_layers"] and hf["num_experts"] > 0
            and (layer + 1) % hf["decoder_sparse_step"] == 0)


def sparse_layer_fields(hf: dict) -> dict:
    """meshlm's MoE fields of a Qwen-MoE config.json (Qwen2-MoE's and Qwen3-MoE's): softmax over all
    experts, then the top ``num_experts_per_tok``, renormalized iff ``norm_topk_prob``."""
    return dict(moe_num_experts=hf["num_experts"], moe_top_k=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_score_function="softmax",
                moe_softmax_before_topk=True, moe_normalize_topk=bool(hf["norm_topk_prob"]),
                moe_aux_loss_coeff=hf["router_aux_loss_coef"])


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    if "num_local_experts" in hf_config:  # transformers v5 saves the attribute-mapped name
        hf["num_experts"] = hf_config["num_local_experts"]
    require(hf, NAME, "hidden_act", "silu", "meshlm's gated MLP and experts are SwiGLU")
    pattern = "".join("*E" if is_sparse_layer(hf, layer) else "*-" for layer in range(hf["num_hidden_layers"]))
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern,
        **attention_fields(hf), position_embedding="rope", qk_norm=True,
        **rope_from_hf(hf_config, 10000.0, NAME),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False,
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"],
        **sparse_layer_fields(hf),
        # with use_sliding_window every layer attends within sliding_window (transformers' Qwen3-MoE)
        **window_fields(hf["sliding_window"] if hf["use_sliding_window"] else None,
                        [True] * hf["num_hidden_layers"]))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=True)
    reasons += blocks_of(config, r"(\*[-E])+", "Qwen3-MoE layers are attention then MoE or MLP: '*E' / '*-'")
    reasons += window_unsupported(config, "Qwen3-MoE", uniform_only=True)
    if config.mlp_activation != "swiglu":
        reasons.append(f"model.mlp_activation={config.mlp_activation!r} (Qwen3-MoE's MLPs are SwiGLU)")
    if config.mlp_bias:
        reasons.append("model.mlp_bias=True (Qwen3-MoE's MLPs have no biases)")
    return reasons + softmax_moe_unsupported(config, NAME, normalize_topk=None)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    kinds = config.block_kinds
    return {**hf_common_fields(config, NAME, "qwen3_moe"), **attention_to_hf(config),
            "num_hidden_layers": len(kinds) // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "attention_bias": config.attention_bias,
            "use_sliding_window": uniform_window(config) is not None, "sliding_window": uniform_window(config),
            **sparse_layers_to_hf(config)}


def sparse_layers_to_hf(config: ModelConfig) -> dict:
    """The config.json fields of Qwen-MoE's sparse blocks (Qwen2-MoE's and Qwen3-MoE's): which layers
    hold one, and the router and experts."""
    kinds = config.block_kinds
    return {"decoder_sparse_step": 1,
            "mlp_only_layers": [layer for layer in range(len(kinds) // 2) if kinds[2 * layer + 1] == "-"],
            "num_experts": config.moe_num_experts, "num_experts_per_tok": config.moe_top_k,
            "moe_intermediate_size": config.resolved_moe_ffn_hidden_size,
            "norm_topk_prob": config.moe_normalize_topk, "router_aux_loss_coef": config.moe_aux_loss_coeff,
            "output_router_logits": False, "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def tensor_maps(config: ModelConfig, more_moe_maps=None) -> list[TensorMap]:
    """Qwen-MoE's tensors; ``more_moe_maps(ours, theirs)``: an MoE block's further tensors, meshlm's
    under mixer ``ours`` and HF's under ``theirs`` (Qwen2-MoE's gated shared expert)."""
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        block = 2 * layer + 1
        maps += attention_maps(config, 2 * layer, layer)
        if config.block_kinds[block] == "-":
            maps += dense_mlp_maps(config, block, layer)
            continue
        theirs = f"model.layers.{layer}.mlp"
        maps.append(rename(f"blocks.{block}.norm.weight", f"model.layers.{layer}.post_attention_layernorm.weight"))
        maps += routed_expert_maps(block, f"{theirs}.gate.weight", lambda e: tuple(
            f"{theirs}.experts.{e}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")),
            config.moe_num_experts)
        if more_moe_maps is not None:
            maps += more_moe_maps(f"blocks.{block}.mixer", theirs)
        maps.append(ours_only(f"blocks.{block}.mixer.router.expert_bias"))  # unused by softmax routing
    return maps


def normalize_hf_tensors(tensors: dict) -> dict:
    """Split transformers' fused in-memory expert tensors into the hub's per-expert names."""
    tensors = split_fused_experts(tensors, "experts.gate_up_proj", lambda prefix, e: [
        (f"{prefix}experts.{e}.gate_proj.weight", 0), (f"{prefix}experts.{e}.up_proj.weight", 0)])
    return split_fused_experts(tensors, "experts.down_proj", lambda prefix, e: [
        (f"{prefix}experts.{e}.down_proj.weight", 0)])


ARCHITECTURE = Architecture(NAME, "qwen3_moe", config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
