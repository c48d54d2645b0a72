"""IBM Granite's Mixture-of-Experts families <-> meshlm:

- ``GraniteMoeForCausalLM`` (Granite 3.0 1B-A400M, 3B-A800M): Granite's attention layer (``granite.py``:
  RoPE, grouped KV heads, its muP constants) followed by an MoE block in every layer;
- ``GraniteMoeSharedForCausalLM``: the same with a shared expert beside the routed ones
  (``shared_intermediate_size`` > 0);
- ``GraniteMoeHybridForCausalLM`` (Granite 4.0-H Micro, Tiny, Small): each layer a Mamba-2 mixer or an
  attention mixer (``layer_types``), then the MoE block with its shared expert, or with
  ``num_local_experts`` 0 the shared MLP alone, a dense SwiGLU MLP. Its attention rotates only with
  ``position_embedding_type: rope``; the released models use none (NoPE), the Mamba layers carrying order.

HF layer i is meshlm blocks 2i ('*' or 'M') and 2i+1 ('E', or '-' for the dense hybrid). The four
muP constants are Granite's: ``embedding_multiplier``, ``attention_multiplier`` (the factor on
q k^T: ``model.attention_scale``), ``residual_multiplier`` and ``logits_scaling``
(``model.logit_divisor``).

The router takes the top k of the logits and softmaxes over those k (meshlm ``moe_score_function
softmax`` with ``moe_softmax_before_topk false``). The experts are SwiGLU without biases, stored fused,
as are the shared expert's gate and up projections (the gate first):

    model.layers.{i}.block_sparse_moe.router.layer.weight   blocks.{2i+1}.mixer.router.weight
    model.layers.{i}.block_sparse_moe.input_linear.weight   [E, 2F, h]: experts.gate_weight, up_weight
    model.layers.{i}.block_sparse_moe.output_linear.weight  [E, h, F]: experts.down_weight
    model.layers.{i}.shared_mlp.input_linear.weight         [2S, h]: shared_expert.gate_proj, up_proj
    model.layers.{i}.shared_mlp.output_linear.weight        shared_expert.down_proj (a dense layer's
                                                            mixer.{gate,up,down}_proj)
    model.layers.{i}.mamba.*                                blocks.{2i}.mixer.* (Mamba2's names)

transformers v5's in-memory names (``block_sparse_moe.experts.gate_up_proj``, ``.experts.down_proj``,
``.router.weight``) are read too; export writes the hub's, which transformers maps on load.
"""

from __future__ import annotations

import math

from meshlm.errors import ConfigError
from meshlm.hf.common import (Architecture, TensorMap, common_unsupported, embedding_maps, fused_rows,
                              hf_common_fields, linear_maps, ours_only, rename, require, rope_from_hf,
                              window_unsupported, with_defaults)
from meshlm.hf.granite import mup_fields, mup_to_hf
from meshlm.hf.llama import attention_fields, attention_maps, attention_to_hf
from meshlm.hf.mamba2 import mamba_fields, mamba_mixer_maps
from meshlm.models.config import ModelConfig

MOE_NAME, SHARED_NAME, HYBRID_NAME = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM",
                                      "GraniteMoeHybridForCausalLM")
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048,
            "initializer_range": 0.02, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
            "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
            "attention_multiplier": 1.0, "num_local_experts": 8, "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.001, "shared_intermediate_size": 0}
HYBRID_DEFAULTS = {**DEFAULTS, "shared_intermediate_size": 1024, "position_embedding_type": None,
                   "mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto",
                   "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
                   "mamba_proj_bias": False, "time_step_limit": [0.0, math.inf]}
MIXERS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*"}
"""``layer_types`` entries (transformers v5's, and the hub files' older names) and meshlm's symbol."""
LAYER_TYPES = {"M": "linear_attention", "*": "full_attention"}
SUPPORTED_FEATURES = frozenset({"embedding_multiplier", "attention_scale", "residual_multiplier", "logit_divisor"})
MAMBA_INIT = {"time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4}
"""Granite keeps no dt init range in config.json: meshlm's defaults, which shape the init only."""


# --- config ------------------------------------------------------------------------------------------
def granite_fields(hf: dict) -> dict:
    """The muP constants and the attention, MLP and (with experts) MoE fields all three classes share."""
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], **attention_fields(hf), **mup_fields(hf),
                mlp_activation="swiglu", mlp_bias=False, norm="rmsnorm", norm_eps=hf["rms_norm_eps"],
                tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"],
                **(dict(moe_num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
                        moe_ffn_hidden_size=hf["intermediate_size"], moe_score_function="softmax",
                        moe_softmax_before_topk=False, moe_aux_loss_coeff=hf["router_aux_loss_coef"])
                   if hf["num_local_experts"] > 0 else {}))


def moe_config_from_hf(hf_config: dict, name: str) -> ModelConfig:
    """GraniteMoe / GraniteMoeShared: '*E' per layer, RoPE attention."""
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, name, "hidden_act", "silu", "meshlm's experts are SwiGLU")
    if hf["num_local_experts"] < 1:
        raise ConfigError(f"{name} config.json: num_local_experts={hf['num_local_experts']}; every layer of this "
                          "class is an MoE block, which needs at least one expert.")
    shared = hf["shared_intermediate_size"] if name == SHARED_NAME else 0
    return ModelConfig(pattern="*E" * hf["num_hidden_layers"], position_embedding="rope",
                       **rope_from_hf(hf_config, 10000.0, name), **granite_fields(hf),
                       moe_shared_expert_ffn_hidden_size=shared)


def hybrid_config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, HYBRID_DEFAULTS)
    require(hf, HYBRID_NAME, "hidden_act", "silu", "meshlm's MLPs, experts and Mamba convolution use silu")
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["linear_attention"] * hf["num_hidden_layers"]
    unknown = sorted(set(types) - set(MIXERS))
    if unknown or len(types) != hf["num_hidden_layers"]:
        raise ConfigError(f"{HYBRID_NAME} config.json: layer_types must list num_hidden_layers="
                          f"{hf['num_hidden_layers']} entries of {sorted(MIXERS)}; it holds {types}.")
    experts = hf["num_local_experts"] > 0
    shared = hf["shared_intermediate_size"]
    rope = hf["position_embedding_type"] == "rope"
    return ModelConfig(
        pattern="".join(MIXERS[kind] + ("E" if experts else "-") for kind in types),
        position_embedding="rope" if rope else "none",
        **(rope_from_hf(hf_config, 10000.0, HYBRID_NAME) if rope else {}), **granite_fields(hf),
        ffn_hidden_size=None if experts else shared, moe_shared_expert_ffn_hidden_size=shared if experts else 0,
        **hybrid_mamba_fields(hf, HYBRID_NAME))


def hybrid_mamba_fields(hf: dict, name: str) -> dict:
    """meshlm's Mamba fields from the ``mamba_*`` fields IBM's hybrids share (Granite 4.0-H, Bamba;
    ``hf`` with the class's defaults): ``mamba_d_head`` 'auto' is the inner width over the heads,
    ``time_step_limit[0]`` the lower clamp of dt (an upper one is refused)."""
    clamp_min, clamp_max = hf["time_step_limit"]
    if clamp_max != math.inf:
        raise ConfigError(f"{name} config.json: time_step_limit={list(hf['time_step_limit'])} is not "
                          "supported (meshlm clamps dt from below only); use an upper limit of Infinity.")
    inner = hf["mamba_expand"] * hf["hidden_size"]
    head_dim = inner // hf["mamba_n_heads"] if hf["mamba_d_head"] == "auto" else hf["mamba_d_head"]
    mamba = {"hidden_size": hf["hidden_size"], "expand": hf["mamba_expand"], "n_groups": hf["mamba_n_groups"],
             "conv_kernel": hf["mamba_d_conv"], "chunk_size": hf["mamba_chunk_size"],
             "use_conv_bias": hf["mamba_conv_bias"], "use_bias": hf["mamba_proj_bias"], **MAMBA_INIT}
    return mamba_fields(mamba, hf["mamba_n_heads"], head_dim, hf["mamba_d_state"], clamp_min)


def hybrid_mamba_to_hf(config: ModelConfig) -> dict:
    """``hybrid_mamba_fields`` read back."""
    return {"mamba_n_heads": config.resolved_mamba_num_heads, "mamba_n_groups": config.mamba_num_groups,
            "mamba_d_state": config.mamba_state_size, "mamba_d_head": config.mamba_head_dim,
            "mamba_d_conv": config.mamba_conv_kernel, "mamba_expand": config.mamba_expand,
            "mamba_chunk_size": config.mamba_chunk_size, "mamba_conv_bias": config.mamba_conv_bias,
            "mamba_proj_bias": config.mamba_proj_bias, "time_step_limit": [config.mamba_dt_clamp_min, math.inf]}


def hybrid_mamba_unsupported(config: ModelConfig, label: str) -> list[str]:
    """Why ``config``'s Mamba blocks do not fit IBM's hybrids (their inner width is expand x hidden)."""
    if "M" in config.block_kinds and config.mamba_inner_size != config.mamba_expand * config.hidden_size:
        return [f"model.mamba_num_heads * model.mamba_head_dim = {config.mamba_inner_size} ({label} needs "
                f"model.mamba_expand * hidden_size = {config.mamba_expand * config.hidden_size})"]
    return []


# --- what each class can hold ------------------------------------------------------------------------
def granite_moe_unsupported(config: ModelConfig, label: str, mixers: str, shared: bool | None) -> list[str]:
    """Why ``config`` is not a Granite MoE class: layers of a mixer in ``mixers`` then one MoE block (or,
    for the hybrid, ``shared`` None, a dense MLP in every layer); ``shared``: whether its MoE blocks
    have a shared expert (None: both kinds of class)."""
    kinds = config.block_kinds
    reasons = common_unsupported(config, supported=SUPPORTED_FEATURES)
    reasons += window_unsupported(config, label, uniform_only=False)
    second = set(kinds[1::2])
    dense_allowed = shared is None and second == {"-"}
    if len(kinds) % 2 or set(kinds[::2]) - set(mixers) or not (second == {"E"} or dense_allowed):
        reasons.append(f"model.pattern={config.pattern!r} ({label} layers are {' or '.join(map(repr, mixers))} "
                       f"then {'an MoE block' if shared is not None else 'MoE blocks in all layers or MLPs in all'})")
    if "*" in kinds:
        if config.qk_norm:
            reasons.append(f"model.qk_norm=True ({label} attention has no QK-norm)")
        if config.resolved_attention_output_bias != config.attention_bias:
            reasons.append(f"model.attention_output_bias={config.attention_output_bias} with model.attention_bias="
                           f"{config.attention_bias} ({label}'s q/k/v/o projections all have biases or none do)")
    if config.mlp_activation != "swiglu" or config.mlp_bias:
        reasons.append(f"model.mlp_activation={config.mlp_activation!r}, model.mlp_bias={config.mlp_bias} ({label}'s "
                       "MLPs and experts are SwiGLU without biases)")
    if "E" in kinds:
        if config.moe_score_function != "softmax" or config.moe_softmax_before_topk or config.moe_normalize_topk:
            reasons.append(f"model.moe_score_function={config.moe_score_function!r}, moe_softmax_before_topk="
                           f"{config.moe_softmax_before_topk}, moe_normalize_topk={config.moe_normalize_topk} ({label} "
                           "softmaxes over the top-k logits: 'softmax', false, false)")
        if config.moe_routed_scaling_factor != 1.0 or config.moe_router_num_groups is not None:
            reasons.append(f"model.moe_routed_scaling_factor={config.moe_routed_scaling_factor}, "
                           f"moe_router_num_groups={config.moe_router_num_groups} ({label} has neither)")
        has_shared = config.moe_shared_expert_ffn_hidden_size > 0
        if shared is not None and has_shared != shared:
            reasons.append(f"model.moe_shared_expert_ffn_hidden_size={config.moe_shared_expert_ffn_hidden_size} "
                           f"({label}'s MoE blocks {'always' if shared else 'never'} have a shared expert)")
        if config.moe_latent_size is not None:
            reasons.append(f"model.moe_latent_size={config.moe_latent_size} ({label} has no latent projections)")
    return reasons


def moe_unsupported(config: ModelConfig) -> list[str]:
    reasons = granite_moe_unsupported(config, "GraniteMoe", "*", shared=False)
    return reasons + rope_unsupported(config, "GraniteMoe")


def shared_unsupported(config: ModelConfig) -> list[str]:
    reasons = granite_moe_unsupported(config, "GraniteMoeShared", "*", shared=True)
    return reasons + rope_unsupported(config, "GraniteMoeShared")


def rope_unsupported(config: ModelConfig, label: str) -> list[str]:
    if config.position_embedding != "rope":
        return [f"model.position_embedding={config.position_embedding!r} ({label} attention uses RoPE)"]
    return []


def hybrid_unsupported(config: ModelConfig) -> list[str]:
    label = "GraniteMoeHybrid"
    reasons = granite_moe_unsupported(config, label, "M*", shared=None)
    if "*" in config.block_kinds and config.position_embedding not in ("rope", "none"):
        reasons.append(f"model.position_embedding={config.position_embedding!r} ({label} attention uses RoPE or "
                       "nothing)")
    if "E" in config.block_kinds and config.moe_shared_expert_ffn_hidden_size <= 0:
        reasons.append(f"model.moe_shared_expert_ffn_hidden_size=0 ({label}'s MoE blocks always have a shared expert)")
    return reasons + hybrid_mamba_unsupported(config, label)


# --- config.json out ---------------------------------------------------------------------------------
def granite_to_hf(config: ModelConfig, name: str, model_type: str) -> dict:
    moe = "E" in config.block_kinds
    return {**hf_common_fields(config, name, model_type), **attention_to_hf(config), **mup_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
            "attention_bias": config.attention_bias, "intermediate_size": config.resolved_moe_ffn_hidden_size,
            "num_local_experts": config.moe_num_experts if moe else 0, "num_experts_per_tok": config.moe_top_k,
            "router_aux_loss_coef": config.moe_aux_loss_coeff, "output_router_logits": False,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def moe_config_to_hf(config: ModelConfig) -> dict:
    MOE.check_expressible(config)
    return granite_to_hf(config, MOE_NAME, "granitemoe")


def shared_config_to_hf(config: ModelConfig) -> dict:
    SHARED.check_expressible(config)
    return {**granite_to_hf(config, SHARED_NAME, "granitemoeshared"),
            "shared_intermediate_size": config.moe_shared_expert_ffn_hidden_size}


def hybrid_config_to_hf(config: ModelConfig) -> dict:
    HYBRID.check_expressible(config)
    kinds = config.block_kinds
    shared = config.moe_shared_expert_ffn_hidden_size if "E" in kinds else config.resolved_ffn_hidden_size
    fields = {**granite_to_hf(config, HYBRID_NAME, "granitemoehybrid"), "shared_intermediate_size": shared,
              "layer_types": [LAYER_TYPES[kind] for kind in kinds[::2]],
              "position_embedding_type": "rope" if config.position_embedding == "rope" else "nope",
              **hybrid_mamba_to_hf(config)}
    return fields


# --- tensors -----------------------------------------------------------------------------------------
def granite_tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight")
    kinds, width = config.block_kinds, config.resolved_moe_ffn_hidden_size
    for layer in range(config.num_blocks // 2):
        mixer, mlp, theirs = 2 * layer, 2 * layer + 1, f"model.layers.{layer}"
        if kinds[mixer] == "M":
            maps += mamba_mixer_maps(config, mixer, theirs, mixer="mamba", norm="input_layernorm")
        else:
            maps += attention_maps(config, mixer, layer)
        maps.append(rename(f"blocks.{mlp}.norm.weight", f"{theirs}.post_attention_layernorm.weight"))
        ours = f"blocks.{mlp}.mixer"
        if kinds[mlp] == "-":  # the hybrid without experts: the shared MLP is the block
            maps += swiglu_maps(ours, f"{theirs}.shared_mlp", config.resolved_ffn_hidden_size)
            continue
        moe = f"{theirs}.block_sparse_moe"
        maps.append(rename(f"{ours}.router.weight", f"{moe}.router.layer.weight"))
        maps += fused_rows([(f"{ours}.experts.gate_weight", width), (f"{ours}.experts.up_weight", width)],
                           f"{moe}.input_linear.weight", dim=1)
        maps.append(rename(f"{ours}.experts.down_weight", f"{moe}.output_linear.weight"))
        maps.append(ours_only(f"{ours}.router.expert_bias"))  # unused by softmax routing
        shared = config.moe_shared_expert_ffn_hidden_size
        if shared:
            maps += swiglu_maps(f"{ours}.shared_expert", f"{theirs}.shared_mlp", shared)
    return maps


def swiglu_maps(ours: str, theirs: str, width: int) -> list[TensorMap]:
    """A SwiGLU MLP stored as Granite's ``input_linear`` (gate rows, then up rows) and ``output_linear``."""
    return (fused_rows([(f"{ours}.gate_proj.weight", width), (f"{ours}.up_proj.weight", width)],
                       f"{theirs}.input_linear.weight")
            + linear_maps(f"{ours}.down_proj", f"{theirs}.output_linear", False))


V5_NAMES = {"block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
            "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
            "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight"}
"""transformers v5's in-memory names of the MoE tensors and the hub's."""


def hub_names(tensors: dict) -> dict:
    """transformers v5's in-memory MoE names as the hub's (the same tensors, renamed)."""
    out = {}
    for name, tensor in tensors.items():
        for v5, hub in V5_NAMES.items():
            if name.endswith(v5):
                name = name[: -len(v5)] + hub
                break
        out[name] = tensor
    return out


MOE = Architecture(MOE_NAME, "granitemoe", lambda hf: moe_config_from_hf(hf, MOE_NAME), moe_config_to_hf,
                   granite_tensor_maps, moe_unsupported, hub_names)
SHARED = Architecture(SHARED_NAME, "granitemoeshared", lambda hf: moe_config_from_hf(hf, SHARED_NAME),
                      shared_config_to_hf, granite_tensor_maps, shared_unsupported, hub_names)
HYBRID = Architecture(HYBRID_NAME, "granitemoehybrid", hybrid_config_from_hf, hybrid_config_to_hf,
                      granite_tensor_maps, hybrid_unsupported, hub_names)
