"""``Ernie4_5_MoeForCausalLM`` <-> meshlm (Baidu 2025, "ERNIE 4.5 Technical Report"): the text MoE
models, ERNIE-4.5-21B-A3B and ERNIE-4.5-300B-A47B (base and post-trained).

A layer is ERNIE 4.5's attention (``ernie4_5.py``: RoPE over interleaved pairs, reordered on the
way in and out) followed by a SwiGLU MLP or an MoE block. Layer i is MoE when ``(i + 1) %
moe_layer_interval == 0`` and ``moe_layer_start_index <= i <= moe_layer_end_index`` (the released
models: every layer from the second, or from the fourth), which meshlm's pattern writes out ('*-'
or '*E' per layer; export finds the three numbers again and refuses a pattern they cannot give).

The MoE block (``moe_num_experts`` experts of ``moe_intermediate_size``, top ``moe_k``):

- the router scores all experts by a softmax in fp32 (``model.moe_score_function=softmax``,
  ``moe_softmax_before_topk``), chooses the top k of score + ``e_score_correction_bias`` (meshlm's
  ``expert_bias``, as DeepSeek-V3's; the bias steers the choice, never the weights) and divides
  the chosen scores by their sum (``model.moe_normalize_topk``; transformers clamps the sum at
  ``moe_norm_min`` 1e-12, meshlm adds 1e-20: the same for any softmax);
- ``moe_num_shared_experts`` shared experts run as one ungated SwiGLU of that many times the
  expert width (``model.moe_shared_expert_ffn_hidden_size``).

Tensors, beside the attention's:

    model.layers.{i}.mlp.gate.weight                           blocks.{2i+1}.mixer.router.weight
    model.layers.{i}.mlp.moe_statics.e_score_correction_bias   ... .router.expert_bias ([1, E] there)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   ... .experts.{gate,up,down}_weight
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight  ... .shared_expert.*

(transformers holds the experts fused and the bias under ``mlp.gate.moe_statics``; both forms
import). ``use_bias`` (biases on every projection) is refused with MoE layers: the released models
have none, and the experts never do. Multi-token-prediction tensors (``mtp*``), which transformers
also leaves out, are skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

from meshlm.checkpoint.safetensors_stream import PlannedTensor, load
from meshlm.errors import ConfigError
from meshlm.hf import ernie4_5
from meshlm.hf.common import (Architecture, DerivedTensor, TensorMap, blocks_of, embedding_maps, hf_common_fields,
                              require, window_unsupported, with_defaults)
from meshlm.hf.deepseek_v3 import moe_maps
from meshlm.hf.deepseek_v3 import normalize_hf_tensors as split_fused_experts
from meshlm.hf.llama import attention_fields, attention_to_hf, decoder_unsupported, dense_mlp_maps
from meshlm.models.config import ModelConfig

NAME = "Ernie4_5_MoeForCausalLM"
MODEL_TYPE = "ernie4_5_moe"
DEFAULTS = {"vocab_size": 103424, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 28,
            "num_attention_heads": 20, "num_key_value_heads": 4, "hidden_act": "silu",
            "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "use_bias": False, "moe_intermediate_size": 1536, "moe_k": 6,
            "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
            "moe_layer_end_index": -1, "moe_layer_interval": 1, "router_aux_loss_coef": 0.001}
BIAS = "moe_statics.e_score_correction_bias"
MTP = re.compile(r"(^|\.)mtp")


def hf_with_defaults(hf_config: dict) -> dict:
    """config.json with the class's defaults, the expert count and k read under either name
    (transformers' attribute map: ``num_experts``, ``num_experts_per_tok``)."""
    hf = with_defaults(hf_config, DEFAULTS)
    hf["moe_num_experts"] = hf_config.get("num_experts", hf["moe_num_experts"])
    hf["moe_k"] = hf_config.get("num_experts_per_tok", hf["moe_k"])
    if hf["moe_layer_end_index"] == -1:
        hf["moe_layer_end_index"] = hf["num_hidden_layers"] - 1
    return hf


def is_moe_layer(hf: dict, layer: int) -> bool:
    """transformers' rule (the module docstring)."""
    return ((layer + 1) % hf["moe_layer_interval"] == 0
            and hf["moe_layer_start_index"] <= layer <= hf["moe_layer_end_index"])


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = hf_with_defaults(hf_config)
    require(hf, NAME, "hidden_act", "silu", "meshlm's MLPs and experts are SwiGLU")
    if hf["use_bias"] and any(is_moe_layer(hf, layer) for layer in range(hf["num_hidden_layers"])):
        raise ConfigError(f"{NAME} with use_bias=true and MoE layers is not read: its shared experts would have "
                          "biases, which meshlm's shared expert does not hold.")
    pattern = "".join("*E" if is_moe_layer(hf, layer) else "*-" for layer in range(hf["num_hidden_layers"]))
    bias = bool(hf["use_bias"])
    moe = dict(moe_num_experts=hf["moe_num_experts"], moe_top_k=hf["moe_k"],
               moe_ffn_hidden_size=hf["moe_intermediate_size"],
               moe_shared_expert_ffn_hidden_size=hf["moe_intermediate_size"] * hf["moe_num_shared_experts"],
               moe_score_function="softmax", moe_softmax_before_topk=True, moe_normalize_topk=True,
               moe_aux_loss_coeff=float(hf["router_aux_loss_coef"] or 0.0)) if "E" in pattern else {}
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern=pattern,
        **{**attention_fields(hf), "attention_bias": bias}, position_embedding="rope",
        **ernie4_5.rope_fields(hf_config), mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"],
        mlp_bias=bias, norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"], **moe)


def moe_layout(config: ModelConfig) -> tuple[int, int, int] | None:
    """(start, end, interval) whose rule gives ``config``'s MoE layers, or None if none does."""
    moe = [layer for layer in range(config.num_blocks // 2) if config.block_kinds[2 * layer + 1] == "E"]
    if not moe:
        return None
    steps = {after - before for before, after in zip(moe, moe[1:])}
    interval = min(steps) if steps else moe[0] + 1
    layout = {"moe_layer_start_index": moe[0], "moe_layer_end_index": moe[-1], "moe_layer_interval": interval}
    chosen = [layer for layer in range(config.num_blocks // 2) if is_moe_layer(layout, layer)]
    return (moe[0], moe[-1], interval) if chosen == moe else None


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=False) + window_unsupported(config, "ERNIE 4.5", uniform_only=False)
    reasons += blocks_of(config, r"(\*[-E])+", "ERNIE 4.5 layers are attention then an MLP or an MoE block")
    if config.mlp_activation != "swiglu" or config.mlp_bias != config.attention_bias:
        reasons.append(f"model.mlp_activation={config.mlp_activation!r}, model.mlp_bias={config.mlp_bias} (ERNIE "
                       "4.5's MLPs are SwiGLU, with biases exactly when its attention has them)")
    if "E" not in config.block_kinds:
        return reasons
    if moe_layout(config) is None:
        reasons.append(f"model.pattern={config.pattern!r} (ERNIE 4.5's MoE layers are every "
                       "moe_layer_interval-th layer between two indices)")
    if config.attention_bias:
        reasons.append("model.attention_bias=True (ERNIE 4.5's use_bias would give the shared experts biases)")
    width, shared = config.resolved_moe_ffn_hidden_size, config.moe_shared_expert_ffn_hidden_size
    if shared % width or config.moe_shared_expert_gate:
        reasons.append(f"model.moe_shared_expert_ffn_hidden_size={shared}, model.moe_shared_expert_gate="
                       f"{config.moe_shared_expert_gate} (ERNIE 4.5's shared experts are moe_num_shared_experts "
                       f"ungated experts: a multiple of model.moe_ffn_hidden_size={width})")
    if (config.moe_score_function, config.moe_softmax_before_topk, config.moe_normalize_topk) != ("softmax", True,
                                                                                               True):
        reasons.append(f"model.moe_score_function={config.moe_score_function!r}, moe_softmax_before_topk="
                       f"{config.moe_softmax_before_topk}, moe_normalize_topk={config.moe_normalize_topk} (ERNIE "
                       "4.5 routes by a softmax over all experts, then renormalizes the top k)")
    if (config.moe_routed_scaling_factor != 1.0 or config.moe_router_num_groups or config.moe_router_bias
            or config.moe_expert_linear_bias or config.moe_latent_size is not None):
        reasons.append("model.moe_routed_scaling_factor, moe_router_num_groups, moe_router_bias, "
                       "moe_expert_linear_bias or moe_latent_size set (ERNIE 4.5's router and experts have none)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config),
              "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
              "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "use_bias": config.attention_bias,
              "max_position_embeddings": DEFAULTS["max_position_embeddings"], "pad_token_id": None,
              "bos_token_id": None, "eos_token_id": None}
    layout = moe_layout(config)
    if layout is None:  # no MoE layer: an interval past the stack
        layout = (0, 0, config.num_blocks // 2 + 1)
    width = config.resolved_moe_ffn_hidden_size
    values.update(moe_layer_start_index=layout[0], moe_layer_end_index=layout[1], moe_layer_interval=layout[2],
                  moe_num_experts=config.moe_num_experts, moe_k=config.moe_top_k, moe_intermediate_size=width,
                  moe_num_shared_experts=config.moe_shared_expert_ffn_hidden_size // width,
                  router_aux_loss_coef=config.moe_aux_loss_coeff)
    return values


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight") + ernie4_5.query_key_maps(config)
    for layer in range(config.num_blocks // 2):
        maps += ernie4_5.attention_maps(config, layer)
        maps += moe_maps(config, layer, BIAS) if config.block_kinds[2 * layer + 1] == "E" else dense_mlp_maps(
            config, 2 * layer + 1, layer)
    return maps


def _flat(tensor) -> object:
    return load(tensor).reshape(-1)


def normalize_hf_tensors(tensors: dict) -> dict:
    """The hub's names and shapes: experts per expert, the correction bias under ``mlp.moe_statics``
    and flat ([1, E] -> [E], meshlm's ``expert_bias``)."""
    out = {}
    for name, tensor in split_fused_experts(tensors).items():
        if name.endswith(BIAS):
            name = name.replace(".mlp.gate.moe_statics.", ".mlp.moe_statics.")
            tensor = DerivedTensor((tensor.shape[-1],), tensor.dtype, partial(_flat, tensor))
        out[name] = tensor
    return out


def _unflattened(produce) -> object:
    return produce().reshape(1, -1)


@dataclass(frozen=True)
class ErnieMoeArchitecture(Architecture):
    """The maps above, with each correction bias written [1, E], as the released checkpoints hold it."""

    def plan_to_hf(self, stored, read, config):
        plan = super().plan_to_hf(stored, read, config)
        for name in [name for name in plan if name.endswith(BIAS)]:
            entry = plan[name]
            plan[name] = PlannedTensor((1, *entry.shape), entry.dtype, partial(_unflattened, entry.produce))
        return plan


ARCHITECTURE = ErnieMoeArchitecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                                    normalize_hf_tensors, regrouped_rows=ernie4_5.regrouped_rows,
                                    skipped_hf_tensors=lambda config, names: lambda name: bool(MTP.search(name)))
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf

__all__ = ["ARCHITECTURE", "NAME", "config_from_hf", "config_to_hf", "hf_with_defaults", "is_moe_layer", "moe_layout",
           "state_from_hf", "state_to_hf", "tensor_maps", "unsupported"]
