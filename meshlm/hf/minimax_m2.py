"""``MiniMaxM2ForCausalLM`` <-> meshlm (MiniMax 2025: MiniMax-M2, M2.1 and M2.5).

Every MiniMax-M2 layer is grouped-query attention followed by a sparse MoE block, so HF layer i
is blocks 2i ('*') and 2i+1 ('E'):

- attention without biases, with a QK-norm over *all* heads of each projection at once, before
  RoPE (OLMo 2's: ``model.qk_norm_scope=all``), and RoPE on the first ``rotary_dim`` channels of
  each head in rotate-half pairs (``model.rope_fraction`` = rotary_dim / head_dim; GLM-4.5's);
- MoE: sigmoid scores, the experts chosen by score plus ``e_score_correction_bias`` (the router's
  ``expert_bias``, DeepSeek-V3's rule without groups), the chosen scores renormalized to sum to
  one, SwiGLU experts in Mixtral's hub names:

    model.layers.{i}.block_sparse_moe.gate.weight              blocks.{2i+1}.mixer.router.weight
    model.layers.{i}.block_sparse_moe.e_score_correction_bias  blocks.{2i+1}.mixer.router.expert_bias
    model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2     experts.gate_weight / up_weight / down_weight [e]

The released folders are FP8 (block-wise, read by ``fp8_import.py``) and carry multi-token-prediction
modules as layers past ``num_hidden_layers``, which transformers does not read: import leaves them
out. transformers computes MiniMax-M2's routing with sigmoid scores and the bias whatever
``scoring_func`` and ``use_routing_bias`` say; so does meshlm.
"""

from __future__ import annotations

import re
from typing import Callable

from meshlm.hf.common import (Architecture, TensorMap, blocks_of, fixed_fields_unsupported, hf_common_fields, rename,
                              require, rope_from_hf, window_unsupported, with_defaults)
from meshlm.hf.llama import attention_fields, attention_to_hf, decoder_embedding_maps, decoder_unsupported
from meshlm.hf.mixtral import sparse_layer_maps
from meshlm.models.config import ModelConfig

NAME = "MiniMaxM2ForCausalLM"
DEFAULTS = {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
            "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_experts_per_tok": 8, "num_local_experts": 256,
            "router_aux_loss_coef": 0.001, "initializer_range": 0.02, "max_position_embeddings": 196608}
ROPE_THETA = 5e6
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def with_rotary_fraction(hf_config: dict, head_dim: int) -> dict:
    """``hf_config`` with the hub files' ``rotary_dim`` (channels per head) as v5's
    ``partial_rotary_factor`` in ``rope_parameters``, where ``rope_from_hf`` reads it."""
    parameters = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    if "partial_rotary_factor" not in parameters and hf_config.get("rotary_dim"):
        parameters["partial_rotary_factor"] = hf_config["rotary_dim"] / head_dim
    parameters.setdefault("rope_theta", hf_config.get("rope_theta", ROPE_THETA))
    return {**hf_config, "rope_parameters": parameters}


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", "silu", "meshlm's experts are SwiGLU")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*E" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope", qk_norm=True, qk_norm_scope="all",
        **rope_from_hf(with_rotary_fraction(hf_config, head_dim), ROPE_THETA, NAME, partial_rotary=True),
        mlp_activation="swiglu", mlp_bias=False, norm="rmsnorm", norm_eps=hf["rms_norm_eps"],
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"],
        moe_num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"], moe_score_function="sigmoid", moe_normalize_topk=True,
        moe_aux_loss_coeff=hf["router_aux_loss_coef"])


FIXED = {"mlp_activation": "swiglu", "mlp_bias": False, "attention_bias": False, "qk_norm_scope": "all",
         "moe_score_function": "sigmoid", "moe_normalize_topk": True, "moe_routed_scaling_factor": 1.0,
         "moe_router_num_groups": None, "moe_shared_expert_ffn_hidden_size": 0, "moe_latent_size": None}
"""What a MiniMax-M2 layer always is."""


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=True, supported=frozenset({"qk_norm_scope", "rope_fraction"}))
    reasons += blocks_of(config, r"(\*E)+", "MiniMax-M2 layers are attention then MoE: '*E' repeated")
    reasons += window_unsupported(config, "MiniMax-M2", uniform_only=False)
    return reasons + fixed_fields_unsupported(config, "MiniMax-M2", FIXED)


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = {**hf_common_fields(config, NAME, "minimax_m2"), **attention_to_hf(config),
              "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_moe_ffn_hidden_size,
              "num_local_experts": config.moe_num_experts, "num_experts_per_tok": config.moe_top_k,
              "rotary_dim": config.rotary_dim, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
              "router_aux_loss_coef": config.moe_aux_loss_coeff, "output_router_logits": False,
              "scoring_func": "sigmoid", "use_routing_bias": True,
              "max_position_embeddings": DEFAULTS["max_position_embeddings"]}
    values["rope_parameters"] = {**values["rope_parameters"], "partial_rotary_factor": float(config.rope_fraction)}
    return values


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Mixtral's layers (``mixtral.sparse_layer_maps``) with the score-correction bias as the router's expert bias."""
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        maps += sparse_layer_maps(config, layer)
        maps.append(rename(f"blocks.{2 * layer + 1}.mixer.router.expert_bias",
                           f"model.layers.{layer}.block_sparse_moe.e_score_correction_bias"))
    return maps


def skipped_mtp_modules(config: ModelConfig, names: set) -> Callable[[str], bool]:
    """The released folders' multi-token-prediction modules, stored as layers past the last decoder
    layer, which transformers does not read either."""
    layers = config.num_blocks // 2

    def skipped(name: str) -> bool:
        match = LAYER.match(name)
        return match is not None and int(match.group(1)) >= layers
    return skipped


ARCHITECTURE = Architecture(NAME, "minimax_m2", config_from_hf, config_to_hf, tensor_maps, unsupported,
                            skipped_hf_tensors=skipped_mtp_modules)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf

__all__ = ["ARCHITECTURE", "NAME", "config_from_hf", "config_to_hf", "state_from_hf", "state_to_hf", "tensor_maps",
           "unsupported"]
