"""``NemotronHForCausalLM`` <-> meshlm (NVIDIA 2025, "Nemotron-H"; Nemotron 3 for the MoE parts).

Nemotron-H is the model meshlm's pattern string comes from: one pre-norm residual block per
symbol of its ``hybrid_override_pattern`` (transformers v5: ``layers_block_type``), with

    M  Mamba-2 mixer         ('linear_attention', legacy 'mamba')
    *  attention, no RoPE    ('full_attention', legacy 'attention'); the Mamba blocks carry order
    -  MLP, not gated        ('mlp'), activation ``mlp_hidden_act`` (relu2 = squared ReLU)
    E  MoE                   ('moe'), Nemotron 3's router and experts:

The MoE block scores experts with a sigmoid, picks the top k of score + ``e_score_correction_bias``
(the bias steers the choice only), weighs them by their plain scores (renormalized iff
``norm_topk_prob``) times ``routed_scaling_factor``, and adds an always-on shared expert. With
``moe_latent_size`` the routed experts work in a smaller latent space between ``fc1_latent_proj``
and ``fc2_latent_proj`` (LatentMoE). Names (hub layout, one nn.Linear per expert):

    backbone.layers.{i}.mixer.gate.weight                  blocks.{i}.mixer.router.weight
    backbone.layers.{i}.mixer.gate.e_score_correction_bias blocks.{i}.mixer.router.expert_bias
    backbone.layers.{i}.mixer.experts.{e}.{up,down}_proj.weight  blocks.{i}.mixer.experts.{up,down}_weight[e]
    backbone.layers.{i}.mixer.shared_experts.*             blocks.{i}.mixer.shared_expert.*
    backbone.layers.{i}.mixer.fc{1,2}_latent_proj.*        blocks.{i}.mixer.latent_{in,out}_proj.*

Files whose keys start with ``model.`` instead of ``backbone.`` (transformers' in-memory names)
and fused ``experts.up_proj`` / ``experts.down_proj`` [E, out, in] tensors are accepted too.
``time_step_min`` is both the lower clamp of dt in the Mamba forward (meshlm's
``mamba_dt_clamp_min``) and the smallest dt drawn at init; export writes the clamp. (transformers
applies that clamp in its chunked scan but not in its single-token decoding step; meshlm clamps
in both, so the two agree whenever no dt falls below it.) Not supported yet: grouped routing (``n_group`` > 1) and MTP layers
(``num_nextn_predict_layers`` > 0). transformers never ties Nemotron-H's output head to its
embedding, so an imported model is always untied, and a tied meshlm model is written with a copy
of its embedding as ``lm_head.weight``.
"""

from __future__ import annotations

import math

from meshlm.errors import ConfigError
from meshlm.hf.common import (ACTIVATION_FROM_HF, ACTIVATION_TO_HF, Architecture, TensorMap, common_unsupported,
                              embedding_maps, hf_common_fields, linear_maps, rename, require, split_fused_experts,
                              stack, window_unsupported, with_defaults)
from meshlm.hf.llama import attention_fields
from meshlm.hf.mamba2 import mamba_fields, mamba_mixer_maps, mamba_to_hf
from meshlm.models.config import ModelConfig

NAME = "NemotronHForCausalLM"
SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
LAYER_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
DEFAULTS = {"vocab_size": 131072, "hidden_size": 4096, "tie_word_embeddings": False, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, "intermediate_size": 21504,
            "mlp_hidden_act": "relu2", "mlp_bias": False, "ssm_state_size": 128, "mamba_num_heads": 128,
            "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4, "expand": 2,
            "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4, "use_conv_bias": True,
            "chunk_size": 128, "n_routed_experts": 8, "moe_intermediate_size": 7688,
            "moe_shared_expert_intermediate_size": 7688, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0,
            "n_group": 1, "norm_topk_prob": True, "num_nextn_predict_layers": 0, "use_bias": False,
            "initializer_range": 0.02, "layer_norm_epsilon": 1e-5}
# Older (remote-code) config names that transformers still accepts, and the names they stand for.
LEGACY_NAMES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
                "mamba_dt_init_floor": "time_step_floor", "mamba_conv_bias": "use_conv_bias",
                "mamba_chunk_size": "chunk_size", "num_local_experts": "n_routed_experts"}


def pattern_from_hf(hf_config: dict) -> str:
    layer_types = hf_config.get("layers_block_type")
    if layer_types is None:
        if "hybrid_override_pattern" not in hf_config:
            raise ConfigError(f"{NAME} config.json has neither layers_block_type nor hybrid_override_pattern; "
                              "one of them must list the layers.")
        return hf_config["hybrid_override_pattern"]
    unknown = sorted(set(layer_types) - set(SYMBOLS))
    if unknown:
        raise ConfigError(f"{NAME} config.json: layers_block_type holds {unknown}, not one of {sorted(SYMBOLS)}.")
    return "".join(SYMBOLS[layer_type] for layer_type in layer_types)


def config_from_hf(hf_config: dict) -> ModelConfig:
    renamed = {LEGACY_NAMES.get(key, key): value for key, value in hf_config.items()}
    hf = with_defaults(renamed, DEFAULTS)
    if hf["num_nextn_predict_layers"]:
        raise ConfigError(f"{NAME} config.json: num_nextn_predict_layers={hf['num_nextn_predict_layers']}: "
                          "Nemotron-H MTP layers are not supported yet; convert a checkpoint without them.")
    require(hf, NAME, "n_group", 1, "grouped expert routing is not supported yet")
    require(hf, NAME, "sliding_window", (None,), "meshlm attention is full causal attention")
    require(hf, NAME, "mamba_hidden_act", "silu", "meshlm's Mamba convolution is followed by silu")
    require(hf, NAME, "mlp_hidden_act", tuple(ACTIVATION_FROM_HF), "meshlm has no such MLP activation")
    pattern = pattern_from_hf(renamed)
    shared_size = hf["moe_shared_expert_intermediate_size"] or hf["intermediate_size"]  # transformers' fallback
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern,
        **{**attention_fields(hf), "attention_bias": False}, position_embedding="none",
        mlp_activation=ACTIVATION_FROM_HF[hf["mlp_hidden_act"]], ffn_hidden_size=hf["intermediate_size"],
        mlp_bias=bool(hf["mlp_bias"]),
        **mamba_fields(hf, hf["mamba_num_heads"], hf["mamba_head_dim"], hf["ssm_state_size"], hf["time_step_min"]),
        norm="rmsnorm", norm_eps=hf["layer_norm_epsilon"], tie_embeddings=False, init_std=hf["initializer_range"],
        hidden_dropout=float(hf.get("hidden_dropout") or 0.0),
        moe_num_experts=hf["n_routed_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_shared_expert_ffn_hidden_size=shared_size if "E" in pattern else 0,
        moe_score_function="sigmoid", moe_normalize_topk=bool(hf["norm_topk_prob"]),
        moe_routed_scaling_factor=float(hf["routed_scaling_factor"]), moe_latent_size=hf.get("moe_latent_size"))


def unsupported(config: ModelConfig) -> list[str]:
    kinds, reasons = set(config.block_kinds), common_unsupported(config)
    reasons += window_unsupported(config, "Nemotron-H", uniform_only=False)
    if "*" in kinds:
        if config.position_embedding != "none":
            reasons.append(f"model.position_embedding={config.position_embedding!r} (Nemotron-H attention has no "
                           "positional embedding)")
        if config.qk_norm:
            reasons.append("model.qk_norm=True (Nemotron-H attention has no QK-norm)")
        if config.attention_bias or config.resolved_attention_output_bias:
            reasons.append(f"model.attention_bias={config.attention_bias}, model.attention_output_bias="
                           f"{config.attention_output_bias} (Nemotron-H attention has no biases)")
    if kinds & {"-", "E"} and config.mlp_activation not in ACTIVATION_TO_HF:
        reasons.append(f"model.mlp_activation={config.mlp_activation!r} (Nemotron-H MLPs and experts are not "
                       f"gated: one of {', '.join(ACTIVATION_TO_HF)})")
    if "E" in kinds:
        if config.moe_score_function != "sigmoid":
            reasons.append(f"model.moe_score_function={config.moe_score_function!r} (Nemotron-H routes by sigmoid)")
        if config.moe_shared_expert_ffn_hidden_size <= 0:
            reasons.append("model.moe_shared_expert_ffn_hidden_size=0 (Nemotron-H MoE blocks always have a "
                           "shared expert)")
        if config.moe_num_experts < 2:
            reasons.append(f"model.moe_num_experts={config.moe_num_experts} (Nemotron-H's router needs >= 2)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, "nemotron_h"), **mamba_to_hf(config),
            "layers_block_type": [LAYER_TYPES[kind] for kind in config.block_kinds],
            "tie_word_embeddings": False,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.resolved_num_kv_heads,
            "head_dim": config.resolved_head_dim, "attention_bias": False, "sliding_window": None,
            "attention_dropout": config.attention_dropout, "hidden_dropout": config.hidden_dropout,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"],
            "intermediate_size": config.resolved_ffn_hidden_size, "mlp_bias": config.mlp_bias,
            "mlp_hidden_act": ACTIVATION_TO_HF.get(config.mlp_activation, "relu2"),
            "ssm_state_size": config.mamba_state_size, "mamba_num_heads": config.resolved_mamba_num_heads,
            "mamba_head_dim": config.mamba_head_dim, "mamba_hidden_act": "silu", "expand": config.mamba_expand,
            "mamba_proj_bias": config.mamba_proj_bias, "time_step_min": config.mamba_dt_clamp_min,
            "time_step_limit": [config.mamba_dt_clamp_min, math.inf],
            "n_routed_experts": config.moe_num_experts, "num_experts_per_tok": config.moe_top_k,
            "moe_intermediate_size": config.resolved_moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": config.moe_shared_expert_ffn_hidden_size,
            "n_shared_experts": 1, "moe_latent_size": config.moe_latent_size,
            "routed_scaling_factor": config.moe_routed_scaling_factor, "norm_topk_prob": config.moe_normalize_topk,
            "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0, "residual_in_fp32": False}


def moe_maps(config: ModelConfig, block: int, theirs: str) -> list[TensorMap]:
    ours = f"blocks.{block}.mixer"
    experts = range(config.moe_num_experts)
    maps = [rename(f"{ours}.router.weight", f"{theirs}.gate.weight"),
            rename(f"{ours}.router.expert_bias", f"{theirs}.gate.e_score_correction_bias"),
            stack(f"{ours}.experts.up_weight", [f"{theirs}.experts.{e}.up_proj.weight" for e in experts]),
            stack(f"{ours}.experts.down_weight", [f"{theirs}.experts.{e}.down_proj.weight" for e in experts])]
    for name in ("up_proj", "down_proj"):
        maps += linear_maps(f"{ours}.shared_expert.{name}", f"{theirs}.shared_experts.{name}", config.mlp_bias)
    if config.moe_latent_size is not None:
        maps += linear_maps(f"{ours}.latent_in_proj", f"{theirs}.fc1_latent_proj", config.mlp_bias)
        maps += linear_maps(f"{ours}.latent_out_proj", f"{theirs}.fc2_latent_proj", config.mlp_bias)
    return maps


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "backbone.embeddings.weight", "backbone.norm_f.weight")
    if config.tie_embeddings:  # written as an explicit copy: transformers does not tie Nemotron-H
        maps.append(rename("embedding.weight", "lm_head.weight"))
    for block, kind in enumerate(config.block_kinds):
        theirs = f"backbone.layers.{block}"
        if kind == "M":
            maps += mamba_mixer_maps(config, block, theirs)
            continue
        maps.append(rename(f"blocks.{block}.norm.weight", f"{theirs}.norm.weight"))
        if kind == "*":
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                maps.append(rename(f"blocks.{block}.mixer.{name}.weight", f"{theirs}.mixer.{name}.weight"))
        elif kind == "-":
            for name in ("up_proj", "down_proj"):
                maps += linear_maps(f"blocks.{block}.mixer.{name}", f"{theirs}.mixer.{name}", config.mlp_bias)
        else:
            maps += moe_maps(config, block, f"{theirs}.mixer")
    return maps


def normalize_hf_tensors(tensors: dict) -> dict:
    """Accept 'model.'-prefixed names and fused [E, out, in] expert tensors (transformers' in-memory
    layout) by rewriting them to the hub layout."""
    if not any(name.startswith("backbone.") for name in tensors):
        tensors = {("backbone." + name[len("model."):] if name.startswith("model.") else name): tensor
                   for name, tensor in tensors.items()}
    for name in ("up_proj", "down_proj"):
        tensors = split_fused_experts(tensors, f"mixer.experts.{name}", lambda prefix, e, name=name: [
            (f"{prefix}mixer.experts.{e}.{name}.weight", 0)])
    return tensors


ARCHITECTURE = Architecture(NAME, "nemotron_h", config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
