"""``GptOssForCausalLM`` <-> meshlm (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card").

A gpt-oss decoder layer is an attention block and an MoE block, so HF layer i is blocks 2i ('*')
and 2i+1 ('E'):

- attention: grouped-query heads with biases on q, k, v and o, RoPE with YaRN scaling, a learned
  sink logit per head in every softmax denominator (``model.attention_sinks``,
  ``meshlm/models/explicit_attention.py``), and layers alternating between a 128-token sliding
  window and full attention (``layer_types``; transformers' rule without it: even layers slide);
- MoE: a router with a bias (``model.moe_router_bias``) that takes the top k logits and softmaxes
  over them (``moe_softmax_before_topk`` false), and experts with biases
  (``model.moe_expert_linear_bias``) and a clamped SwiGLU (``mlp_activation: clamped_swiglu``,
  ``swiglu_limit``, ``swiglu_alpha``; ``meshlm/models/mlp.py``).

**The experts' tensors.** transformers holds each block's experts as two stacked tensors with the
gate and up projections *interleaved* along the output (column 2j is gate row j, column 2j + 1 up
row j) and every weight transposed, [in, out]:

    mlp.experts.gate_up_proj       [E, d, 2F]    blocks.{2i+1}.mixer.experts.gate_weight [E, F, d] (even columns)
                                                 blocks.{2i+1}.mixer.experts.up_weight   [E, F, d] (odd columns)
    mlp.experts.gate_up_proj_bias  [E, 2F]       experts.gate_bias, experts.up_bias [E, F] (even, odd)
    mlp.experts.down_proj          [E, F, d]     experts.down_weight [E, d, F] (transposed)
    mlp.experts.down_proj_bias     [E, d]        experts.down_bias
    mlp.router.weight / .bias                    mixer.router.weight / .bias
    self_attn.sinks                [heads]       blocks.{2i}.mixer.sinks

**MXFP4 checkpoints.** The released gpt-oss folders store the expert weights in MXFP4 (OCP
Microscaling formats 1.0): ``gate_up_proj_blocks`` [E, 2F, d/32, 16] and ``down_proj_blocks``
[E, d, F/32, 16] hold two FP4 (E2M1) values per byte, the low nibble first, in the [out, in]
layout, and ``*_scales`` [E, out, in/32] one power of two per 32 values, an E8M0 byte with bias
127: value = E2M1[nibble] * 2^(scale - 127) (``meshlm/precision/formats/mxfp4.py``). Import
dequantizes them to bf16, one expert at a time, as transformers' ``Mxfp4Config(dequantize=True)``
does; export writes the bf16 tensors (a folder transformers reads with no quantization config),
or with ``--quantize mxfp4`` the released MXFP4 layout again (``meshlm/hf/mxfp4_export.py``).

Import reads each HF form through a ``DerivedTensor`` (its shape and dtype now, its values when
the writer asks, an expert at a time), named after the HF tensor and the part it takes (for
example ``model.layers.0.mlp.experts.gate_up_proj[gate]``); export joins the parts back
(``join_experts_for_hf``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from meshlm.checkpoint.safetensors_stream import PlannedTensor, load
from meshlm.hf.common import (SLIDING_ATTENTION, Architecture, DerivedTensor, TensorMap, blocks_of,
                              fixed_fields_unsupported, hf_common_fields, layer_types_from_hf, layer_types_to_hf,
                              layer_windows, ours_only, rename, rope_from_hf, window_fields, with_defaults)
from meshlm.hf.llama import (attention_fields, attention_maps, attention_to_hf, decoder_embedding_maps,
                             decoder_unsupported)
from meshlm.models.config import ModelConfig
from meshlm.precision.formats.mxfp4 import dequantize_mxfp4

NAME = "GptOssForCausalLM"
DEFAULTS = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
            "num_experts_per_tok": 4, "sliding_window": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "router_aux_loss_coef": 0.001,
            "initializer_range": 0.02, "max_position_embeddings": 131072, "attention_dropout": 0.0}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
"""transformers' RoPE for a gpt-oss config.json that names none."""

EXPERT_PARTS = ("gate", "up")
"""The interleaved halves of ``gate_up_proj``, in order: column 2j + index."""


def _per_expert(shape: tuple[int, ...], dtype: torch.dtype, experts: int, expert: Callable[[int], torch.Tensor]
                ) -> torch.Tensor:
    """A stacked [E, ...] tensor built one expert at a time (only one expert's input is held)."""
    out = torch.empty(shape, dtype=dtype)
    for index in range(experts):
        out[index].copy_(expert(index))
    return out


def _mxfp4_expert(blocks, scales, part: int | None, index: int) -> torch.Tensor:
    """Expert ``index`` of an MXFP4 weight [out, in], or its rows ``part``::2 (gate 0, up 1)."""
    weight = dequantize_mxfp4(load(blocks[index]), load(scales[index]))
    return weight if part is None else weight[part::2]


def _fused_expert(tensor, part: int | None, index: int) -> torch.Tensor:
    """Expert ``index`` of transformers' [in, out] weight, as [out, in]: its columns ``part``::2 when given."""
    weight = load(tensor[index])
    return (weight if part is None else weight[:, part::2]).t()


def _bias_part(bias, part: int) -> torch.Tensor:
    return load(bias)[:, part::2].contiguous()


def experts_from_hf(tensors: dict) -> dict:
    """``tensors`` with every expert tensor of the forms above replaced by its parts in meshlm's layout
    (``DerivedTensor``s, named ``<HF name>[gate]``, ``[up]``, or ``[meshlm]`` for a whole one)."""
    out = dict(tensors)
    for name in [name for name in tensors if name.endswith("mlp.experts.gate_up_proj_bias")]:
        bias = out.pop(name)
        experts, width = bias.shape
        for part, label in enumerate(EXPERT_PARTS):
            out[f"{name}[{label}]"] = DerivedTensor((experts, width // 2), bias.dtype, partial(_bias_part, bias, part))
    for name in [name for name in tensors if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensor = out.pop(name)
        experts, inputs, outputs = tensor.shape
        out.update(_weight_parts(name, experts, outputs, inputs, tensor.dtype, partial(_fused_expert, tensor)))
    for name in [name for name in tensors if name.endswith("_blocks")]:
        stem = name[: -len("_blocks")]
        if stem + "_scales" not in tensors:
            continue  # left for the map to report as unexpected
        blocks, scales = out.pop(name), out.pop(stem + "_scales")
        experts, outputs, groups, width = blocks.shape
        out.update(_weight_parts(stem, experts, outputs, groups * width * 2, torch.bfloat16,
                                 partial(_mxfp4_expert, blocks, scales)))
    return out


def _weight_parts(stem: str, experts: int, outputs: int, inputs: int, dtype: torch.dtype,
                  expert: Callable[[int | None, int], torch.Tensor]) -> dict[str, DerivedTensor]:
    """The ``DerivedTensor``s of a stacked expert weight ``stem`` (HF outputs x inputs per expert) in
    meshlm's [E, out, in] layout: the gate and up halves of a ``gate_up_proj`` (its rows ::2, 1::2), or
    the whole weight (``[meshlm]``); ``expert(part, index)`` gives one expert's part (None: whole)."""
    parts = list(enumerate(EXPERT_PARTS)) if stem.endswith("gate_up_proj") else [(None, "meshlm")]
    derived = {}
    for part, label in parts:
        shape = (experts, outputs if part is None else outputs // 2, inputs)
        derived[f"{stem}[{label}]"] = DerivedTensor(shape, dtype, partial(_per_expert, shape, dtype, experts,
                                                                          partial(expert, part)))
    return derived


def _interleaved(gate: PlannedTensor, up: PlannedTensor, dtype: torch.dtype, weights: bool) -> torch.Tensor:
    """transformers' gate_up tensor from meshlm's gate and up: weights [E, F, d] -> [E, d, 2F], biases
    [E, F] -> [E, 2F], gate in the even columns and up in the odd ones."""
    halves = [gate.produce().to(dtype), up.produce().to(dtype)]
    if weights:
        halves = [half.transpose(1, 2) for half in halves]
    return torch.stack(halves, dim=-1).flatten(-2).contiguous()


def _transposed_experts(produce: Callable[[], torch.Tensor]) -> torch.Tensor:
    return produce().transpose(1, 2).contiguous()


def join_experts_for_hf(plan: dict[str, PlannedTensor]) -> dict[str, PlannedTensor]:
    """The export plan with each expert tensor's parts (named as ``experts_from_hf`` names them)
    joined into transformers' tensor."""
    out = {name: entry for name, entry in plan.items() if not name.endswith("]")}
    for name in [name for name in plan if name.endswith("[gate]")]:
        stem = name[: -len("[gate]")]
        gate, up = plan[name], plan[f"{stem}[up]"]
        dtype, weights = torch.promote_types(gate.dtype, up.dtype), len(gate.shape) == 3
        shape = (gate.shape[0], gate.shape[2], 2 * gate.shape[1]) if weights else (gate.shape[0], 2 * gate.shape[1])
        out[stem] = PlannedTensor(shape, dtype, partial(_interleaved, gate, up, dtype, weights))
    for name in [name for name in plan if name.endswith("[meshlm]")]:
        entry = plan[name]
        experts, outputs, inputs = entry.shape
        out[name[: -len("[meshlm]")]] = PlannedTensor((experts, inputs, outputs), entry.dtype,
                                                      partial(_transposed_experts, entry.produce))
    return out


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    if not (hf_config.get("rope_parameters") or hf_config.get("rope_scaling")):
        hf_config = {**hf_config, "rope_parameters": {**DEFAULT_ROPE,
                                                      "rope_theta": hf_config.get("rope_theta", 150000.0)}}
    layers = hf["num_hidden_layers"]
    sliding = [kind == SLIDING_ATTENTION for kind in layer_types_from_hf(hf, NAME, full_every=2)]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*E" * layers,
        **attention_fields(hf), position_embedding="rope", qk_norm=False, attention_sinks=True,
        **rope_from_hf(hf_config, 150000.0, NAME),
        mlp_activation="clamped_swiglu", swiglu_limit=float(hf["swiglu_limit"]),
        swiglu_alpha=float(hf["swiglu_alpha"]),
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"],
        moe_num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"], moe_score_function="softmax", moe_softmax_before_topk=False,
        moe_router_bias=True, moe_expert_linear_bias=True, moe_aux_loss_coeff=hf["router_aux_loss_coef"],
        **window_fields(hf["sliding_window"], sliding))


FIXED = {"position_embedding": "rope", "attention_sinks": True, "mlp_activation": "clamped_swiglu",
         "moe_score_function": "softmax", "moe_softmax_before_topk": False, "moe_router_bias": True,
         "moe_expert_linear_bias": True, "moe_routed_scaling_factor": 1.0, "moe_shared_expert_ffn_hidden_size": 0,
         "moe_latent_size": None, "moe_router_num_groups": None}
"""What a gpt-oss layer always is."""


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_unsupported(config, qk_norm=False,
                                  supported=frozenset({"attention_sinks", "moe_router_bias", "moe_expert_linear_bias"}))
    reasons += blocks_of(config, r"(\*E)+", "gpt-oss layers are attention then MoE: '*E'")
    reasons += fixed_fields_unsupported(config, "gpt-oss", FIXED)
    if len({window for window in layer_windows(config) if window is not None}) > 1:
        reasons.append("windows of several sizes (gpt-oss has one sliding_window)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    windows = [window for window in layer_windows(config) if window is not None]
    return {**hf_common_fields(config, NAME, "gpt_oss"), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_moe_ffn_hidden_size,
            "num_local_experts": config.moe_num_experts, "num_experts_per_tok": config.moe_top_k,
            "rms_norm_eps": config.norm_eps, "attention_bias": config.attention_bias,
            "swiglu_limit": config.swiglu_limit, "swiglu_alpha": config.swiglu_alpha,
            "router_aux_loss_coef": config.moe_aux_loss_coeff, "output_router_logits": False,
            "sliding_window": windows[0] if windows else None, "layer_types": layer_types_to_hf(config),
            "hidden_act": "silu", "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        attention, moe, theirs = 2 * layer, 2 * layer + 1, f"model.layers.{layer}"
        maps += attention_maps(config, attention, layer)
        maps.append(rename(f"blocks.{attention}.mixer.sinks", f"{theirs}.self_attn.sinks"))
        ours, experts = f"blocks.{moe}.mixer", f"{theirs}.mlp.experts"
        maps += [rename(f"blocks.{moe}.norm.weight", f"{theirs}.post_attention_layernorm.weight"),
                 rename(f"{ours}.router.weight", f"{theirs}.mlp.router.weight"),
                 rename(f"{ours}.router.bias", f"{theirs}.mlp.router.bias"),
                 rename(f"{ours}.experts.gate_weight", f"{experts}.gate_up_proj[gate]"),
                 rename(f"{ours}.experts.up_weight", f"{experts}.gate_up_proj[up]"),
                 rename(f"{ours}.experts.down_weight", f"{experts}.down_proj[meshlm]"),
                 rename(f"{ours}.experts.gate_bias", f"{experts}.gate_up_proj_bias[gate]"),
                 rename(f"{ours}.experts.up_bias", f"{experts}.gate_up_proj_bias[up]"),
                 rename(f"{ours}.experts.down_bias", f"{experts}.down_proj_bias"),
                 ours_only(f"{ours}.router.expert_bias")]  # unused by softmax routing
    return maps


@dataclass(frozen=True)
class GptOssArchitecture(Architecture):
    """gpt-oss's adapter: the maps above, with the experts' parts joined back on export."""

    def plan_to_hf(self, stored, read, config):
        return join_experts_for_hf(super().plan_to_hf(stored, read, config))


ARCHITECTURE = GptOssArchitecture(NAME, "gpt_oss", config_from_hf, config_to_hf, tensor_maps, unsupported,
                                  experts_from_hf, quantizations=("mxfp4",))
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf

__all__ = ["ARCHITECTURE", "NAME", "config_from_hf", "config_to_hf", "experts_from_hf", "join_experts_for_hf",
           "state_from_hf", "state_to_hf", "tensor_maps", "unsupported"]
