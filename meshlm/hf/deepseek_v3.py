"""``DeepseekV3ForCausalLM`` <-> meshlm (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"; Kimi K2
and Moonlight ship in the same class).

A DeepSeek-V3 decoder layer is multi-head latent attention (MLA, ``meshlm/models/latent_attention.py``)
followed by a SwiGLU MLP in the first ``first_k_dense_replace`` layers and by an MoE block in the
others, so HF layer i is blocks 2i ('*') and 2i+1 ('-', then 'E'): the pattern is '*-' k times,
then '*E'. The attention keeps HF's names, but for two:

    model.layers.{i}.self_attn.q_a_proj, q_b_proj (or q_proj)   blocks.{2i}.mixer.q_a_proj, q_b_proj (or q_proj)
    model.layers.{i}.self_attn.q_a_layernorm                    blocks.{2i}.mixer.q_a_norm
    model.layers.{i}.self_attn.kv_a_proj_with_mqa               blocks.{2i}.mixer.kv_a_proj
    model.layers.{i}.self_attn.kv_a_layernorm                   blocks.{2i}.mixer.kv_a_norm
    model.layers.{i}.self_attn.kv_b_proj, o_proj                blocks.{2i}.mixer.kv_b_proj, o_proj

**Rotary channels.** DeepSeek rotates *adjacent* pairs (2j, 2j+1) of the last ``qk_rope_head_dim``
channels of each query head and of the shared rotary key (``rope_interleave``: transformers'
default, and the layout of every released checkpoint); meshlm rotates pairs (j, j + d/2), as Llama
does. transformers' interleaved rotation de-interleaves as it rotates (its output is in the
rotate-half layout), so reordering the rows that make those channels -- the even ones first, then
the odd ones -- hands meshlm exactly the queries and keys transformers computes. Import reorders the
rotary rows of q_b_proj (or q_proj) within every head and the last rows of kv_a_proj_with_mqa; export
puts them back and writes ``rope_interleave: true``. (Adapters on those layers would need the same
reordering, so a LoRA model's ``--adapter-only`` export refuses them; the merged export is exact.)

**Scale.** transformers scales the scores by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) and, when
the RoPE is scaled (YaRN, as DeepSeek-V3 and Kimi K2 are) and ``rope_parameters`` has
``mscale_all_dim`` k, by m(s, k)^2 more, with m(s, k) = 0.1 k ln(s) + 1 (YaRN's temperature kept
for the whole head, since MLA's unrotated channels see no YaRN factor on cos and sin). That
product is ``model.attention_scale``; export solves it back for k. YaRN's own factor on cos and
sin, m(s, mscale) / m(s, mscale_all_dim), is ``model.rope_attention_factor`` (``rope_from_hf``).

**Routing** is DeepSeek-V3's (``meshlm/models/moe/router.py``): sigmoid scores, the top
``num_experts_per_tok`` of score + ``e_score_correction_bias`` (meshlm's ``expert_bias``: it steers
the choice only) among the experts of each token's ``topk_group`` best of ``n_group`` groups, the
chosen scores renormalized iff ``norm_topk_prob``, times ``routed_scaling_factor``; plus a shared
SwiGLU expert ``n_shared_experts`` experts wide. The hub files keep one ``nn.Linear`` per expert:

    model.layers.{i}.mlp.gate.weight                         blocks.{2i+1}.mixer.router.weight
    model.layers.{i}.mlp.gate.e_score_correction_bias        blocks.{2i+1}.mixer.router.expert_bias
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj     blocks.{2i+1}.mixer.experts.{gate,up,down}_weight[e]
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj  blocks.{2i+1}.mixer.shared_expert.{gate,up,down}_proj

transformers' in-memory layout (fused ``experts.gate_up_proj``, stacked ``experts.down_proj``) is
read too. The remote-code configs' ``aux_loss_alpha`` and ``seq_aux`` are ``model.moe_aux_loss_coeff``
and ``moe_aux_loss_type=sequence``; DeepSeek's bias-update speed has no config.json field (meshlm:
``model.moe_bias_update_rate``, 0.001 in the paper).

**Norms.** transformers' latent norms (q_a_layernorm, kv_a_layernorm) always use eps 1e-6 and the
others ``rms_norm_eps``; meshlm has one ``model.norm_eps``, so both directions need it to be 1e-6
(the value of every released model).

**Multi-token prediction.** The files keep ``num_nextn_predict_layers`` MTP layers after the last
decoder layer (DeepSeek-V3's layer 61), which transformers skips; meshlm imports them as its MTP
depths (``model.mtp_depth``, ``mtp_pattern='*E'``; ``meshlm/models/mtp.py`` is DeepSeek-V3's
design), so a converted model trains them and drafts with them (``--speculative mtp``):

    model.layers.{L+d}.hnorm, enorm, shared_head.norm     mtp.depths.{d}.hidden_norm, embedding_norm, final_norm
    model.layers.{L+d}.eh_proj                            mtp.depths.{d}.projection (its two column halves
                                                          swapped: DeepSeek concatenates [embedding; hidden])
    model.layers.{L+d}.<decoder layer>                    mtp.depths.{d}.blocks.0 (attention), blocks.1 (MoE)

Each MTP layer's own ``embed_tokens`` and ``shared_head.head`` repeat the model's embedding and
head: import skips them, export writes them. A folder without the layers (transformers writes
none) imports without MTP, whatever its config.json counts. The released FP8 folders (block-wise
E4M3 with 128 x 128 scales) are dequantized as they are read (``fp8_import.py``). Refused:
``rope_interleave`` false (import cannot see the flag when it reorders the tensors),
``moe_layer_freq`` other than 1, biases, activations other than silu.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from meshlm.errors import ConfigError
from meshlm.hf.common import (Architecture, RegroupedRows, TensorMap, blocks_of, common_unsupported,
                              deinterleaved_rotary_rows, embedding_maps, hf_common_fields, linear_maps, rename, require,
                              rope_from_hf, rope_to_hf, rows_of, split_fused_experts, window_unsupported, with_defaults)
from meshlm.hf.llama import dense_mlp_maps
from meshlm.hf.qwen3_moe import routed_expert_maps
from meshlm.models.config import ModelConfig

NAME = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6
"""transformers' eps for q_a_layernorm and kv_a_layernorm, whatever rms_norm_eps says."""
DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
            "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
            "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
            "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


# --- config -------------------------------------------------------------------------------------
def yarn_mscale(factor: float, k: float) -> float:
    """m(s, k) = 0.1 k ln(s) + 1, and 1 for s <= 1 (transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * k * math.log(factor) + 1.0


def scale_from_mscale(qk_head_dim: int, factor: float, mscale_all_dim: float) -> float:
    """transformers' softmax scale: 1/sqrt(d) times m(s, mscale_all_dim)^2, in its order of operations."""
    mscale = yarn_mscale(factor, mscale_all_dim)
    return qk_head_dim ** -0.5 * mscale * mscale


def attention_scale_from_hf(hf_config: dict, rope: dict, qk_head_dim: int) -> float | None:
    """``model.attention_scale`` of a config.json whose RoPE fields are ``rope``; None when it is
    the plain 1/sqrt(qk_head_dim) (no scaling, no ``mscale_all_dim``, or m = 1)."""
    parameters = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    mscale_all_dim = parameters.get("mscale_all_dim")
    if "rope_scaling" not in rope or not mscale_all_dim:
        return None
    if yarn_mscale(rope["rope_scaling_factor"], mscale_all_dim) == 1.0:
        return None
    return scale_from_mscale(qk_head_dim, rope["rope_scaling_factor"], mscale_all_dim)


def check_importable(hf: dict, hf_config: dict, name: str = NAME) -> None:
    """Refuse what meshlm's layer does not compute (one ConfigError naming the field; ``name``: the
    class, DeepSeek-V3 or one built on its layer)."""
    require(hf, name, "hidden_act", "silu", "meshlm's MLPs and experts are SwiGLU")
    require(hf, name, "attention_bias", False, "meshlm's latent attention has no biases")
    # read as written: transformers takes a null rope_interleave as false, with_defaults would make it true
    require({"rope_interleave": hf_config.get("rope_interleave", True)}, name, "rope_interleave", True,
            "meshlm reorders the rotary rows of interleaved checkpoints, the layout of every released DeepSeek-V3, "
            "Kimi K2 and Moonlight model")
    require(hf, name, "moe_layer_freq", 1, "transformers' DeepSeek-V3 makes every layer after "
            "first_k_dense_replace an MoE layer")
    require(hf, name, "scoring_func", "sigmoid", "DeepSeek-V3 routes by sigmoid scores")
    require(hf, name, "topk_method", "noaux_tc", "DeepSeek-V3 picks experts by group-limited top-k of the biased "
            "scores")
    if hf["n_shared_experts"] < 1:
        raise ConfigError(f"{name} config.json: n_shared_experts={hf['n_shared_experts']} is not supported; "
                          "meshlm reads DeepSeek-V3 MoE layers with a shared expert (n_shared_experts >= 1).")


def moe_fields(hf: dict, hf_config: dict) -> dict:
    """meshlm's MoE fields of a config.json with MoE layers."""
    groups = hf["n_group"] if hf["n_group"] and hf["n_group"] > 1 else None
    return dict(moe_num_experts=hf["n_routed_experts"], moe_top_k=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_shared_expert_ffn_hidden_size=hf["moe_intermediate_size"] * hf["n_shared_experts"],
                moe_score_function="sigmoid", moe_normalize_topk=bool(hf["norm_topk_prob"]),
                moe_routed_scaling_factor=float(hf["routed_scaling_factor"]),
                moe_router_num_groups=groups, moe_router_group_top_k=hf["topk_group"] if groups else None,
                moe_aux_loss_coeff=float(hf_config.get("aux_loss_alpha") or 0.0),
                moe_aux_loss_type="sequence" if hf_config.get("seq_aux") else "micro_batch")


def dense_then_moe_pattern(hf: dict) -> str:
    """'*-' for the first ``first_k_dense_replace`` layers, then '*E' (DeepSeek-V3's layout, and
    GLM-4.5's and dots.llm1's)."""
    layers = hf["num_hidden_layers"]
    dense = min(hf["first_k_dense_replace"], layers)
    return "*-" * dense + "*E" * (layers - dense)


def moe_fields_to_hf(config: ModelConfig) -> dict:
    """``moe_fields`` read back, with ``first_k_dense_replace`` (the '*-' layers)."""
    moe = "E" in config.block_kinds or config.mtp_depth > 0
    return {"first_k_dense_replace": config.block_kinds.count("-"), "n_routed_experts": config.moe_num_experts,
            "num_experts_per_tok": config.moe_top_k, "moe_intermediate_size": config.resolved_moe_ffn_hidden_size,
            "n_shared_experts": (config.moe_shared_expert_ffn_hidden_size // config.resolved_moe_ffn_hidden_size
                                 if moe else 1),
            "n_group": config.moe_router_num_groups or 1, "topk_group": config.moe_router_group_top_k or 1,
            "norm_topk_prob": config.moe_normalize_topk, "routed_scaling_factor": config.moe_routed_scaling_factor,
            "aux_loss_alpha": config.moe_aux_loss_coeff, "seq_aux": config.moe_aux_loss_type == "sequence"}


def mtp_fields(hf_config: dict) -> dict:
    """``model.mtp_depth`` and ``mtp_pattern`` of the MTP layers a config.json counts
    (``num_nextn_predict_layers``, transformers' GLM-4.5 also ``num_mtp_layers``): each is a decoder
    layer past ``first_k_dense_replace``, an MoE one."""
    depth = int(hf_config.get("num_nextn_predict_layers", hf_config.get("num_mtp_layers", 0)) or 0)
    return {"mtp_depth": depth, "mtp_pattern": "*E"} if depth > 0 else {}


def moe_config_with_defaults(hf_config: dict, defaults: dict) -> dict:
    """``hf_config`` with the class's ``defaults`` filled in, the routed experts' count read under either
    name (transformers v5 saves the attribute-mapped ``num_local_experts`` for ``n_routed_experts``):
    DeepSeek-V3's config, and GLM-4.5's, GLM-4.7-Flash's and dots.llm1's, which share it."""
    hf = with_defaults(hf_config, defaults)
    if "num_local_experts" in hf_config:
        hf["n_routed_experts"] = hf_config["num_local_experts"]
    return hf


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = moe_config_with_defaults(hf_config, DEFAULTS)
    check_importable(hf, hf_config)
    return latent_moe_config(hf, hf_config, dense_then_moe_pattern(hf), NAME, DEFAULTS["q_lora_rank"])


def latent_moe_config(hf: dict, hf_config: dict, pattern: str, name: str, default_q_lora_rank: int | None
                      ) -> ModelConfig:
    """The meshlm config of DeepSeek-V3's layer read from ``hf`` (config.json with the class's
    defaults) in the layer ``pattern``: latent attention, SwiGLU MLPs, DeepSeek's MoE, MTP layers."""
    mtp = mtp_fields(hf_config)
    rope = rope_from_hf(hf_config, 10000.0, name)
    qk_head_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern,
        num_attention_heads=hf["num_attention_heads"], attention_type="mla",
        # a null q_lora_rank means q_proj (DeepSeek-V2-Lite's shape); with_defaults would replace it
        mla_q_lora_rank=hf_config.get("q_lora_rank", default_q_lora_rank), mla_kv_lora_rank=hf["kv_lora_rank"],
        mla_qk_nope_head_dim=hf["qk_nope_head_dim"], mla_qk_rope_head_dim=hf["qk_rope_head_dim"],
        mla_v_head_dim=hf["v_head_dim"], attention_dropout=float(hf["attention_dropout"] or 0.0),
        position_embedding="rope", **rope, attention_scale=attention_scale_from_hf(hf_config, rope, qk_head_dim),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False,
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        mla_latent_norm_eps=latent_norm_eps(hf["rms_norm_eps"]),
        init_std=hf["initializer_range"], **(moe_fields(hf, hf_config) if "E" in pattern or mtp else {}), **mtp)


def latent_norm_eps(rms_norm_eps: float) -> float | None:
    """``model.mla_latent_norm_eps`` for a config.json's ``rms_norm_eps``: transformers' latent norms use
    1e-6 whatever it says (None where the two agree)."""
    return None if rms_norm_eps == LATENT_NORM_EPS else LATENT_NORM_EPS


def exact(value: float, reproduces) -> float | None:
    """``value`` rounded to the fewest decimals (6, 9, 12 or all) for which ``reproduces`` holds, so
    that a number read from config.json (1.0, 0.707) is written back as it was; None if none does."""
    return next((candidate for candidate in (round(value, 6), round(value, 9), round(value, 12), value)
                 if reproduces(candidate)), None)


def mscale_parameters(config: ModelConfig) -> dict:
    """``rope_parameters`` entries that make transformers' scale ``model.attention_scale``:
    ``mscale_all_dim`` k solving 1/sqrt(d) m(s, k)^2 = scale, and, for a YaRN attention factor a,
    ``mscale`` solving m(s, mscale) / m(s, k) = a (in place of ``attention_factor``) when one
    reproduces a exactly. Empty for the plain scale."""
    if config.attention_scale is None:
        return {}
    d, factor = config.resolved_head_dim, config.rope_scaling_factor
    per_unit = 0.1 * math.log(factor)  # dm(s, k) / dk
    solved = (math.sqrt(config.attention_scale / d ** -0.5) - 1.0) / per_unit
    k = exact(solved, lambda k: scale_from_mscale(d, factor, k) == config.attention_scale)
    entries = {"mscale_all_dim": solved if k is None else k}
    target, k = config.rope_attention_factor, entries["mscale_all_dim"]
    if target is not None and config.rope_scaling == "yarn":
        mscale = exact((target * yarn_mscale(factor, k) - 1.0) / per_unit,  # transformers ignores a zero mscale
                       lambda m: m != 0 and yarn_mscale(factor, m) / yarn_mscale(factor, k) == target)
        if mscale is not None:
            entries["mscale"] = mscale
    return entries


def rope_parameters_to_hf(config: ModelConfig) -> dict:
    fields = rope_to_hf(config)
    extra = mscale_parameters(config)
    if "mscale" in extra:  # the pair gives the attention factor (transformers' _compute_yarn_parameters)
        fields["rope_parameters"].pop("attention_factor", None)
    fields["rope_parameters"].update(extra)
    return fields


def max_positions(config: ModelConfig) -> int:
    """The context config.json claims: YaRN's scaled one (transformers checks factor against it)."""
    if config.rope_scaling == "yarn":
        return int(config.rope_original_max_positions * config.rope_scaling_factor)
    return DEFAULTS["max_position_embeddings"]


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**latent_moe_config_to_hf(config, NAME, "deepseek_v3"), "moe_layer_freq": 1, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc"}


def latent_moe_config_to_hf(config: ModelConfig, name: str, model_type: str) -> dict:
    """config.json of DeepSeek-V3's layer for class ``name`` (``latent_moe_config`` read back)."""
    return {**hf_common_fields(config, name, model_type), "num_hidden_layers": config.num_blocks // 2,
            **moe_fields_to_hf(config),
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_attention_heads,
            "q_lora_rank": config.mla_q_lora_rank, "kv_lora_rank": config.mla_kv_lora_rank,
            "qk_nope_head_dim": config.mla_qk_nope_head_dim, "qk_rope_head_dim": config.mla_qk_rope_head_dim,
            "v_head_dim": config.mla_v_head_dim, "attention_bias": False, "attention_dropout": config.attention_dropout,
            "rope_interleave": True, **rope_parameters_to_hf(config), "max_position_embeddings": max_positions(config),
            "hidden_act": "silu", "intermediate_size": config.resolved_ffn_hidden_size, "rms_norm_eps": config.norm_eps,
            "num_nextn_predict_layers": config.mtp_depth}


# --- what cannot be written -------------------------------------------------------------------------
def attention_unsupported(config: ModelConfig, name: str = NAME) -> list[str]:
    if config.attention_type != "mla":
        return [f"model.attention_type={config.attention_type!r} ({name}'s attention is multi-head latent "
                "attention: model.attention_type=mla)"]
    reasons = []
    latent_eps = config.norm_eps if config.mla_latent_norm_eps is None else config.mla_latent_norm_eps
    if latent_eps != LATENT_NORM_EPS:
        reasons.append(f"model.mla_latent_norm_eps={config.mla_latent_norm_eps} with model.norm_eps={config.norm_eps} "
                       f"({name}'s latent norms always use {LATENT_NORM_EPS}; set model.mla_latent_norm_eps="
                       f"{LATENT_NORM_EPS})")
    scaled = config.rope_scaling != "none" and config.rope_scaling_factor > 1
    if config.attention_scale is not None and not scaled:
        reasons.append(f"model.attention_scale={config.attention_scale} ({name} scales attention by "
                       "1/sqrt(mla_qk_nope_head_dim + mla_qk_rope_head_dim), changed only by YaRN's mscale_all_dim "
                       "when the RoPE is scaled)")
    return reasons


def moe_unsupported(config: ModelConfig, name: str = NAME) -> list[str]:
    """Why ``config``'s MoE blocks are not DeepSeek-V3's (class ``name``: GLM-4.5's are the same)."""
    if "E" not in config.block_kinds:
        return []
    reasons, width, shared = [], config.resolved_moe_ffn_hidden_size, config.moe_shared_expert_ffn_hidden_size
    if config.moe_score_function != "sigmoid":
        reasons.append(f"model.moe_score_function={config.moe_score_function!r} ({name} routes by sigmoid scores)")
    if shared <= 0 or shared % width:
        reasons.append(f"model.moe_shared_expert_ffn_hidden_size={shared} ({name}'s shared expert is "
                       f"n_shared_experts >= 1 experts wide: a multiple of model.moe_ffn_hidden_size={width})")
    if config.moe_latent_size is not None:
        reasons.append(f"model.moe_latent_size={config.moe_latent_size} ({name} has no latent projection)")
    if config.moe_router_num_groups and config.moe_num_experts // config.moe_router_num_groups < 2:
        reasons.append(f"model.moe_router_num_groups={config.moe_router_num_groups} ({name} scores a group by its "
                       "two best experts, so each group needs at least 2)")
    return reasons


def mtp_unsupported(config: ModelConfig, name: str = NAME) -> list[str]:
    """Why ``config``'s MTP depths are not the class's MTP layers (decoder layers with an MoE block)."""
    if config.mtp_depth and config.mtp_pattern != "*E":
        return [f"model.mtp_pattern={config.mtp_pattern!r} ({name}'s MTP layers are attention then MoE: '*E')"]
    return []


def unsupported(config: ModelConfig, name: str = NAME, label: str = "DeepSeek-V3") -> list[str]:
    """Why ``config`` is not DeepSeek-V3's layer (for class ``name``, called ``label`` in prose)."""
    reasons = common_unsupported(config, supported=frozenset({"attention_scale", "attention_type", "mtp_depth"}))
    reasons += mtp_unsupported(config, name)
    reasons += dense_then_moe_unsupported(config, label)
    reasons += window_unsupported(config, label, uniform_only=False)
    reasons += attention_unsupported(config, name)
    return reasons + moe_unsupported(config, name)


def dense_then_moe_unsupported(config: ModelConfig, label: str) -> list[str]:
    """Why ``config``'s blocks are not DeepSeek-V3's stack (also GLM-4.5's and dots.llm1's, called
    ``label``): attention then a SwiGLU MLP without biases in the first layers, attention then MoE after."""
    reasons = blocks_of(config, r"(\*-)*(\*E)*", f"{label} layers are attention then MLP in the first "
                        "first_k_dense_replace layers, attention then MoE after: '*-' repeated, then '*E' repeated")
    if config.mlp_activation != "swiglu" or config.mlp_bias:
        reasons.append(f"model.mlp_activation={config.mlp_activation!r}, model.mlp_bias={config.mlp_bias} ({label}'s "
                       "MLPs and experts are SwiGLU without biases)")
    return reasons


# --- tensors ------------------------------------------------------------------------------------
def rotary_row_orders(config: ModelConfig) -> dict[str, torch.Tensor]:
    """{projection: order} for the two projections of an MLA block that make rotary channels ("q",
    q_b_proj or q_proj; "kv", kv_a_proj): meshlm's row r is HF's row order[r]."""
    nope, rope, latent = config.mla_qk_nope_head_dim, config.mla_qk_rope_head_dim, config.mla_kv_lora_rank
    return {"q": deinterleaved_rotary_rows(config.num_attention_heads, nope + rope, rope, offset=nope),
            "kv": deinterleaved_rotary_rows(1, latent + rope, rope, offset=latent)}


def rotary_projections(config: ModelConfig) -> list[tuple[str, str, torch.Tensor]]:
    """(meshlm name, HF name, order) of every weight whose rows ``rotary_row_orders`` reorders."""
    orders, query = rotary_row_orders(config), "q_proj" if config.mla_q_lora_rank is None else "q_b_proj"
    layers = config.num_blocks // 2
    attention = [(f"blocks.{2 * layer}.mixer", layer) for layer in range(layers)]
    attention += [(f"mtp.depths.{depth}.blocks.0.mixer", layers + depth) for depth in range(config.mtp_depth)]
    out = []
    for ours, layer in attention:
        theirs = f"model.layers.{layer}.self_attn"
        out += [(f"{ours}.{query}.weight", f"{theirs}.{query}.weight", orders["q"]),
                (f"{ours}.kv_a_proj.weight", f"{theirs}.kv_a_proj_with_mqa.weight", orders["kv"])]
    return out


def rotary_reordered(ours: str, theirs: str, rows: int) -> TensorMap:
    """A weight whose rows are reordered on the way (``regrouped_rows``), mapped as rows [0, rows)
    of its HF tensor (``common.RegroupedRows`` says why not as a rename)."""
    return rows_of(ours, theirs, 0, rows)


def attention_maps(config: ModelConfig, layer: int) -> list[TensorMap]:
    ours, theirs = f"blocks.{2 * layer}", f"model.layers.{layer}"
    attention, mixer = f"{theirs}.self_attn", f"{ours}.mixer"
    heads, head = config.num_attention_heads, config.resolved_head_dim
    maps = [rename(f"{ours}.norm.weight", f"{theirs}.input_layernorm.weight")]
    if config.mla_q_lora_rank is None:
        maps.append(rotary_reordered(f"{mixer}.q_proj.weight", f"{attention}.q_proj.weight", heads * head))
    else:
        maps += [rename(f"{mixer}.q_a_proj.weight", f"{attention}.q_a_proj.weight"),
                 rename(f"{mixer}.q_a_norm.weight", f"{attention}.q_a_layernorm.weight"),
                 rotary_reordered(f"{mixer}.q_b_proj.weight", f"{attention}.q_b_proj.weight", heads * head)]
    latent_rows = config.mla_kv_lora_rank + config.mla_qk_rope_head_dim
    return maps + [rotary_reordered(f"{mixer}.kv_a_proj.weight", f"{attention}.kv_a_proj_with_mqa.weight",
                                    latent_rows),
                   rename(f"{mixer}.kv_a_norm.weight", f"{attention}.kv_a_layernorm.weight"),
                   rename(f"{mixer}.kv_b_proj.weight", f"{attention}.kv_b_proj.weight"),
                   rename(f"{mixer}.o_proj.weight", f"{attention}.o_proj.weight")]


def moe_maps(config: ModelConfig, layer: int, bias: str = "gate.e_score_correction_bias") -> list[TensorMap]:
    """HF layer ``layer``'s MoE block under DeepSeek-V3's names (``bias``: where the correction bias
    lives under ``mlp``; ERNIE 4.5 keeps it in ``moe_statics``), the shared expert when it has one."""
    block, theirs = 2 * layer + 1, f"model.layers.{layer}.mlp"
    maps = [rename(f"blocks.{block}.norm.weight", f"model.layers.{layer}.post_attention_layernorm.weight")]
    maps += routed_expert_maps(block, f"{theirs}.gate.weight", lambda e: tuple(
        f"{theirs}.experts.{e}.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")),
        config.moe_num_experts)
    maps.append(rename(f"blocks.{block}.mixer.router.expert_bias", f"{theirs}.{bias}"))
    if config.moe_shared_expert_ffn_hidden_size:
        for name in ("gate_proj", "up_proj", "down_proj"):
            maps += linear_maps(f"blocks.{block}.mixer.shared_expert.{name}", f"{theirs}.shared_experts.{name}",
                                False)
    return maps


def decoder_maps(config: ModelConfig, layer_attention_maps) -> list[TensorMap]:
    """The embedding, the final norm and every decoder layer: ``layer_attention_maps(i)`` (HF layer i's
    attention as block 2i), then its MoE block or dense MLP (DeepSeek-V3's, GLM-4.5's, dots.llm1's)."""
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight")
    for layer in range(config.num_blocks // 2):
        maps += layer_attention_maps(layer)
        maps += moe_maps(config, layer) if config.block_kinds[2 * layer + 1] == "E" else dense_mlp_maps(
            config, 2 * layer + 1, layer)
    return maps


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_maps(config, lambda layer: attention_maps(config, layer))
    return maps + mtp_maps(config, lambda layer: attention_maps(config, layer) + moe_maps(config, layer))


# --- multi-token prediction -----------------------------------------------------------------------
MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")
"""A multi-token-prediction layer's mark: its projection of [embedding; hidden state]."""
LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layers_in(names) -> set[int]:
    """The HF layer indices of the MTP layers among tensor ``names``."""
    return {int(match.group(1)) for match in map(MTP_LAYER.match, names) if match}


def mtp_maps(config: ModelConfig, decoder_layer_maps) -> list[TensorMap]:
    """MTP depth d as HF layer L + d (L decoder layers; module docstring); ``decoder_layer_maps(i)``:
    the maps of HF decoder layer i as meshlm blocks 2i and 2i + 1, moved here into the depth."""
    maps, layers, hidden = [], config.num_blocks // 2, config.hidden_size
    for depth in range(config.mtp_depth):
        layer, ours = layers + depth, f"mtp.depths.{depth}"
        theirs = f"model.layers.{layer}"
        maps += [rename(f"{ours}.hidden_norm.weight", f"{theirs}.hnorm.weight"),
                 rename(f"{ours}.embedding_norm.weight", f"{theirs}.enorm.weight"),
                 rows_of(f"{ours}.projection.weight", f"{theirs}.eh_proj.weight", 0, hidden),  # halves swapped
                 rename(f"{ours}.final_norm.weight", f"{theirs}.shared_head.norm.weight")]
        moved = {f"blocks.{2 * layer}.": f"{ours}.blocks.0.", f"blocks.{2 * layer + 1}.": f"{ours}.blocks.1."}
        for entry in decoder_layer_maps(layer):
            prefix = next(old for old in moved if entry.ours.startswith(old))
            maps.append(dataclasses.replace(entry, ours=moved[prefix] + entry.ours[len(prefix):]))
    return maps


def mtp_projection_halves(config: ModelConfig) -> list[RegroupedRows]:
    """Each depth's projection: meshlm concatenates [hidden; embedding], DeepSeek [embedding; hidden]."""
    hidden, layers = config.hidden_size, config.num_blocks // 2
    order = torch.cat((torch.arange(hidden, 2 * hidden), torch.arange(hidden)))
    return [RegroupedRows(((f"mtp.depths.{depth}.projection.weight", 2 * hidden),),
                          f"model.layers.{layers + depth}.eh_proj.weight", order, dim=1)
            for depth in range(config.mtp_depth)]


def fit_mtp_depth(config: ModelConfig, names: set) -> ModelConfig:
    """``config`` with the MTP depths the files hold, in a row after the last decoder layer (no
    more than config.json counts): none in a folder transformers wrote."""
    present, first = mtp_layers_in(names), config.num_blocks // 2
    depth = 0
    while depth < config.mtp_depth and first + depth in present:
        depth += 1
    if depth == config.mtp_depth:
        return config
    unset = {} if depth else {"mtp_pattern": ModelConfig.__dataclass_fields__["mtp_pattern"].default}
    return dataclasses.replace(config, mtp_depth=depth, **unset)


def skipped_mtp_layers(config: ModelConfig, names: set):
    """The files' MTP layers past the depths ``config`` keeps (all of them with mtp_depth 0)."""
    skipped = {layer for layer in mtp_layers_in(names) if layer >= config.num_blocks // 2 + config.mtp_depth}

    def is_skipped(name: str) -> bool:
        match = LAYER_INDEX.match(name)
        return match is not None and int(match.group(1)) in skipped
    return is_skipped


def mtp_copies(config: ModelConfig) -> list[tuple[str, str]]:
    """Each MTP layer's own embedding and head: copies of the model's (``Architecture.export_copies``)."""
    head = "embedding.weight" if config.tie_embeddings else "output.weight"
    layers = config.num_blocks // 2
    return [pair for depth in range(config.mtp_depth)
            for pair in (("embedding.weight", f"model.layers.{layers + depth}.embed_tokens.weight"),
                         (head, f"model.layers.{layers + depth}.shared_head.head.weight"))]


def normalize_hf_tensors(tensors: dict) -> dict:
    """Split transformers' fused in-memory expert tensors into the hub's per-expert names."""
    tensors = split_fused_experts(tensors, "experts.gate_up_proj", lambda prefix, e: [
        (f"{prefix}experts.{e}.gate_proj.weight", 0), (f"{prefix}experts.{e}.up_proj.weight", 0)])
    return split_fused_experts(tensors, "experts.down_proj", lambda prefix, e: [
        (f"{prefix}experts.{e}.down_proj.weight", 0)])


def regrouped_rows(config: ModelConfig) -> list[RegroupedRows]:
    """The query and shared-key projections, their rotary rows de-interleaved (module docstring),
    and the MTP projections' halves."""
    return ([RegroupedRows(((ours, len(order)),), theirs, order) for ours, theirs, order in rotary_projections(config)]
            + mtp_projection_halves(config))


ARCHITECTURE = Architecture(NAME, "deepseek_v3", config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors, regrouped_rows, skipped_mtp_layers, fit_mtp_depth, mtp_copies)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
