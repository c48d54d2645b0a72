"""``Qwen2MoeForCausalLM`` <-> meshlm (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B: Yang et al. 2024,
"Qwen2 technical report").

A Qwen2-MoE decoder layer is Qwen2's attention (RoPE, biases on q/k/v when ``qkv_bias``, none on
o, no QK-norm) followed by either a sparse MoE block or, for layers in ``mlp_only_layers`` or off
the ``decoder_sparse_step`` grid, a dense SwiGLU MLP of ``intermediate_size`` -- Qwen3-MoE's
layout (``qwen3_moe.py``), so HF layer i is blocks 2i ('*') and 2i+1 ('E' or '-').

What sets the MoE block apart is its *gated shared expert*: every token also goes through one
SwiGLU MLP of ``shared_expert_intermediate_size``, whose output is scaled per token by
sigmoid(x w) before it joins the routed experts' (meshlm ``model.moe_shared_expert_gate``):

    out = sum_k p_k expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

Routing is Qwen3-MoE's: softmax over all experts, the top k kept, renormalized iff
``norm_topk_prob`` (false in the released models). Tensors beyond Qwen3-MoE's:

    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight  blocks.{2i+1}.mixer.shared_expert.*
    model.layers.{i}.mlp.shared_expert_gate.weight                 blocks.{2i+1}.mixer.shared_expert_gate.weight

With ``use_sliding_window`` and no ``layer_types``, transformers' Qwen2-MoE slides the even layers
below ``max_window_layers`` (a rule of its own, unlike Qwen2's); ``layer_types``, when given,
decides, and export always writes it.
"""

from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.hf.common import (FULL_ATTENTION, SLIDING_ATTENTION, Architecture, TensorMap, blocks_of,
                              hf_common_fields, linear_maps, rename, require, rope_from_hf, with_defaults)
from meshlm.hf.llama import (attention_fields, attention_to_hf, decoder_unsupported, qwen_windows_from_hf,
                             qwen_windows_to_hf)
from meshlm.hf.qwen3_moe import (is_sparse_layer, normalize_hf_tensors, softmax_moe_unsupported,
                                 sparse_layer_fields, sparse_layers_to_hf, tensor_maps as qwen_moe_tensor_maps)
from meshlm.models.config import ModelConfig

NAME = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"
DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
            "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": "silu",
            "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
            "max_window_layers": 28, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
            "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "qkv_bias": True}


def windows_from_hf(hf: dict) -> dict:
    """meshlm's window fields: ``layer_types`` if given, else Qwen2-MoE's even-layers rule."""
    if hf.get("use_sliding_window") and hf.get("layer_types") is None:
        hf = {**hf, "layer_types": [SLIDING_ATTENTION if layer % 2 == 0 and layer < hf["max_window_layers"]
                                    else FULL_ATTENTION for layer in range(hf["num_hidden_layers"])]}
    return qwen_windows_from_hf(hf, NAME)


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    hf["mlp_only_layers"] = hf["mlp_only_layers"] or []
    if "num_local_experts" in hf_config:  # transformers v5 saves the attribute-mapped name
        hf["num_experts"] = hf_config["num_local_experts"]
    require(hf, NAME, "hidden_act", "silu", "meshlm's gated MLP and experts are SwiGLU")
    if hf["num_experts"] > 0 and hf["shared_expert_intermediate_size"] <= 0:
        raise ConfigError(f"{NAME} config.json: shared_expert_intermediate_size="
                          f"{hf['shared_expert_intermediate_size']} is not supported; meshlm reads Qwen2-MoE blocks "
                          "with their gated shared expert (a positive width).")
    pattern = "".join("*E" if is_sparse_layer(hf, layer) else "*-" for layer in range(hf["num_hidden_layers"]))
    moe = "E" in pattern
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern,
        **{**attention_fields(hf), "attention_bias": bool(hf["qkv_bias"])}, attention_output_bias=False,
        position_embedding="rope", qk_norm=False, **rope_from_hf(hf_config, 10000.0, NAME),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False,
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"], **sparse_layer_fields(hf),
        moe_shared_expert_ffn_hidden_size=hf["shared_expert_intermediate_size"] if moe else 0,
        moe_shared_expert_gate=moe, **windows_from_hf(hf))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=False, output_bias_apart=True,
                                  supported=frozenset({"moe_shared_expert_gate"}))
    reasons += blocks_of(config, r"(\*[-E])+", "Qwen2-MoE layers are attention then MoE or MLP: '*E' / '*-'")
    if config.resolved_attention_output_bias:
        reasons.append(f"model.attention_output_bias={config.attention_output_bias} (Qwen2-MoE's o_proj has no "
                       "bias)")
    if config.mlp_activation != "swiglu":
        reasons.append(f"model.mlp_activation={config.mlp_activation!r} (Qwen2-MoE's MLPs are SwiGLU)")
    if config.mlp_bias:
        reasons.append("model.mlp_bias=True (Qwen2-MoE's MLPs have no biases)")
    return reasons + softmax_moe_unsupported(config, NAME, normalize_topk=None, gated_shared_expert=True)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    layers = config.num_blocks // 2
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config),
            "num_hidden_layers": layers, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "qkv_bias": config.attention_bias,
            **qwen_windows_to_hf(config, layers), **sparse_layers_to_hf(config),
            "shared_expert_intermediate_size": config.moe_shared_expert_ffn_hidden_size}


def gated_shared_expert_maps(ours: str, theirs: str) -> list[TensorMap]:
    """An MoE block's shared expert and its gate, meshlm's under mixer ``ours``, HF's under ``theirs``."""
    maps = []
    for projection in ("gate_proj", "up_proj", "down_proj"):
        maps += linear_maps(f"{ours}.shared_expert.{projection}", f"{theirs}.shared_expert.{projection}", False)
    return maps + [rename(f"{ours}.shared_expert_gate.weight", f"{theirs}.shared_expert_gate.weight")]


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    return qwen_moe_tensor_maps(config, gated_shared_expert_maps)


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
