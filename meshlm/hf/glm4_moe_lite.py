"""``Glm4MoeLiteForCausalLM`` <-> meshlm (Z.ai 2026: GLM-4.7-Flash).

GLM-4.7-Flash is DeepSeek-V3's layer (``deepseek_v3.py``) in GLM's dress: multi-head latent
attention with the queries through a latent (``q_lora_rank``) and interleaved rotary rows, then a
dense SwiGLU MLP or DeepSeek's MoE block (sigmoid scores with the score-correction bias,
group-limited top-k, a shared expert, a routed scale), the same tensor names, and its MTP layers
past the last decoder layer. What differs is read here:

- which layers are dense: ``mlp_layer_types`` ("dense" / "sparse" per layer; default: the first
  dense, the rest sparse), where DeepSeek-V3 counts ``first_k_dense_replace``; the layers must still
  be dense first, then sparse (meshlm's ``*-...*E...``);
- the block norms' ``rms_norm_eps`` (1e-5), while transformers' latent norms keep 1e-6
  (``model.mla_latent_norm_eps``);
- the defaults of an unlisted field (GLM-4.7-Flash's sizes, a routed scale of 1.8).
"""

from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.hf import deepseek_v3
from meshlm.hf.common import Architecture
from meshlm.models.config import ModelConfig

NAME = "Glm4MoeLiteForCausalLM"
MODEL_TYPE = "glm4_moe_lite"
DEFAULTS = {**deepseek_v3.DEFAULTS, "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
            "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20, "n_shared_experts": 1,
            "n_routed_experts": 64, "routed_scaling_factor": 1.8, "kv_lora_rank": 512, "q_lora_rank": 768,
            "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
            "num_experts_per_tok": 4, "norm_topk_prob": True, "max_position_embeddings": 202752,
            "rms_norm_eps": 1e-5}
DENSE, SPARSE = "dense", "sparse"


def layer_pattern(hf: dict, hf_config: dict) -> str:
    """'*-' per dense layer and '*E' per sparse one, from ``mlp_layer_types`` (else
    ``first_k_dense_replace``, else the first layer dense); refused unless the dense come first."""
    layers = hf["num_hidden_layers"]
    types = hf_config.get("mlp_layer_types")
    if types is None:
        dense = hf_config.get("first_k_dense_replace", 1)
        types = [DENSE if index < dense else SPARSE for index in range(layers)]
    if len(types) != layers or set(types) - {DENSE, SPARSE}:
        raise ConfigError(f"{NAME} config.json: mlp_layer_types={types!r} must name {layers} layers, each "
                          f"{DENSE!r} or {SPARSE!r}.")
    dense = types.count(DENSE)
    if types != [DENSE] * dense + [SPARSE] * (layers - dense):
        raise ConfigError(f"{NAME} config.json: mlp_layer_types={types!r} puts a dense layer after a sparse one; "
                          "meshlm reads GLM-4.7-Flash's layout, the dense layers first.")
    return "*-" * dense + "*E" * (layers - dense)


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = deepseek_v3.moe_config_with_defaults(hf_config, DEFAULTS)
    deepseek_v3.check_importable(hf, hf_config, NAME)
    return deepseek_v3.latent_moe_config(hf, hf_config, layer_pattern(hf, hf_config), NAME, DEFAULTS["q_lora_rank"])


def unsupported(config: ModelConfig) -> list[str]:
    return deepseek_v3.unsupported(config, NAME, "GLM-4.7-Flash")


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = deepseek_v3.latent_moe_config_to_hf(config, NAME, MODEL_TYPE)
    values.pop("first_k_dense_replace")
    values["mlp_layer_types"] = [DENSE if kind == "-" else SPARSE for kind in config.block_kinds[1::2]]
    values["max_position_embeddings"] = max(values["max_position_embeddings"], DEFAULTS["max_position_embeddings"])
    return values


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, deepseek_v3.tensor_maps, unsupported,
                            deepseek_v3.normalize_hf_tensors, deepseek_v3.regrouped_rows,
                            deepseek_v3.skipped_mtp_layers, deepseek_v3.fit_mtp_depth, deepseek_v3.mtp_copies)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf

__all__ = ["ARCHITECTURE", "NAME", "config_from_hf", "config_to_hf", "layer_pattern", "state_from_hf", "state_to_hf",
           "unsupported"]
