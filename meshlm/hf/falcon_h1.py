"""``FalconH1ForCausalLM`` <-> meshlm (TII 2025, Falcon-H1: a *parallel* hybrid, 0.5B to 34B).

Where Nemotron-H and Bamba give each layer one mixer, every Falcon-H1 layer runs attention and a
Mamba-2 mixer side by side on one normalized input and adds both to the residual stream, then a
SwiGLU MLP:

    h = h + attn(norm1(h)) + mamba(norm1(h));   h = h + mlp(norm2(h))

In meshlm that is the pattern ``"*M-"`` per layer with ``model.parallel_residual`` (an attention
block and the Mamba block after it read the same input) and ``parallel_residual_shared_norm``
(the one norm is the attention block's): HF layer i is blocks 3i ('*'), 3i+1 ('M') and 3i+2 ('-').
The Mamba mixers have no output norm in the released models (``mamba_rms_norm: false``:
``model.mamba_gated_norm=false``) and an inner width of their own (``mamba_d_ssm``). Names:

    model.layers.{i}.input_layernorm                     blocks.{3i}.norm (shared with 3i+1)
    model.layers.{i}.self_attn.{q,k,v,o}_proj            blocks.{3i}.mixer.*
    model.layers.{i}.mamba.*                             blocks.{3i+1}.mixer.* (Mamba2's names)
    model.layers.{i}.pre_ff_layernorm, feed_forward.*    blocks.{3i+2}.norm, mixer.{gate,up,down}_proj

**The muP multipliers.** Falcon-H1 was trained with muP-style constants that scale the inputs and
outputs of its sublayers: the attention input and output (``attention_in_multiplier``,
``attention_out_multiplier``), the keys (``key_multiplier``), the Mamba input and output
(``ssm_in_multiplier``, ``ssm_out_multiplier``), each of the five parts of the Mamba projection --
z, x, B, C, dt -- (``ssm_multipliers``), the MLP's gate and output (``mlp_multipliers``), the
embeddings and the logits. Each multiplies a linear map's input or output, so it is a factor on
that map's weight (and bias): import folds them into the weights (``folded_multipliers``), e.g.
k_proj's weight times ``attention_in_multiplier * key_multiplier`` and its bias times
``key_multiplier``; in_proj's rows times their part's ``ssm_multipliers`` entry. The embedding
multiplier is ``model.embedding_multiplier`` (a tied embedding is also the head) and the logits'
is ``model.logit_divisor`` = 1 / ``lm_head_multiplier``. Export writes the folded weights with
every sublayer multiplier at 1, the same function.
"""

from __future__ import annotations

import math

import torch

from meshlm.errors import ConfigError
from meshlm.hf.common import (Architecture, TensorMap, embedding_maps, hf_common_fields, linear_maps, rename, require,
                              rope_from_hf, rope_to_hf, with_defaults)
from meshlm.hf.granite_moe import MAMBA_INIT
from meshlm.hf.llama import attention_fields, decoder_unsupported
from meshlm.hf.mamba2 import mamba_fields
from meshlm.models.config import ModelConfig

NAME = "FalconH1ForCausalLM"
MODEL_TYPE = "falcon_h1"
DEFAULTS = {"vocab_size": 128000, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
            "initializer_range": 0.02, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
            "attention_dropout": 0.0, "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto",
            "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
            "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
            "mamba_norm_before_gate": True, "mamba_rms_norm": False, "time_step_limit": [0.0, math.inf],
            "projectors_bias": False, "lm_head_multiplier": 1.0, "embedding_multiplier": 1.0,
            "mlp_multipliers": [1.0, 1.0], "key_multiplier": 1.0, "attention_out_multiplier": 1.0,
            "attention_in_multiplier": 1.0, "ssm_multipliers": [1.0] * 5, "ssm_in_multiplier": 1.0,
            "ssm_out_multiplier": 1.0, "attention_bias": False, "mlp_bias": False}
THETA = 10_000.0
"""transformers' RoPE base when config.json gives none."""
SUPPORTED_FEATURES = frozenset({"parallel_residual", "parallel_residual_shared_norm", "embedding_multiplier",
                                "logit_divisor"})


def mamba_inner_size(hf: dict) -> int:
    return hf["mamba_expand"] * hf["hidden_size"] if hf["mamba_d_ssm"] is None else hf["mamba_d_ssm"]


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", "silu", "meshlm's MLPs and Mamba convolution use silu")
    if hf["mamba_rms_norm"] and hf["mamba_norm_before_gate"]:
        raise ConfigError(f"{NAME} config.json: mamba_rms_norm with mamba_norm_before_gate=true normalizes before "
                          "the gate, and meshlm's Mamba norm comes after it (norm(y * silu(z))); only "
                          "mamba_norm_before_gate=false or mamba_rms_norm=false convert.")
    clamp_min, clamp_max = hf["time_step_limit"]
    if clamp_max != math.inf:
        raise ConfigError(f"{NAME} config.json: time_step_limit={list(hf['time_step_limit'])} is not supported "
                          "(meshlm clamps dt from below only); use an upper limit of Infinity.")
    if hf["lm_head_multiplier"] == 0:
        raise ConfigError(f"{NAME} config.json: lm_head_multiplier=0 makes every logit 0; nothing to convert.")
    if bool(hf["mamba_proj_bias"]) != bool(hf["projectors_bias"]):
        raise ConfigError(f"{NAME} config.json: mamba_proj_bias={hf['mamba_proj_bias']} (in_proj's bias) and "
                          f"projectors_bias={hf['projectors_bias']} (out_proj's) differ; meshlm's Mamba projections "
                          "have biases or none do (model.mamba_proj_bias).")
    inner = mamba_inner_size(hf)
    heads = hf["mamba_n_heads"]
    head_dim = inner // heads if hf["mamba_d_head"] == "auto" else hf["mamba_d_head"]
    mamba = {"hidden_size": hf["hidden_size"], "expand": hf["mamba_expand"], "n_groups": hf["mamba_n_groups"],
             "conv_kernel": hf["mamba_d_conv"], "chunk_size": hf["mamba_chunk_size"],
             "use_conv_bias": hf["mamba_conv_bias"], "use_bias": hf["projectors_bias"], **MAMBA_INIT}
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*M-" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope", **rope_from_hf(hf_config, THETA, NAME),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=bool(hf["mlp_bias"]),
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"], parallel_residual=True, parallel_residual_shared_norm=True,
        embedding_multiplier=float(hf["embedding_multiplier"]), logit_divisor=1.0 / float(hf["lm_head_multiplier"]),
        mamba_gated_norm=bool(hf["mamba_rms_norm"]),
        **mamba_fields(mamba, heads, head_dim, hf["mamba_d_state"], clamp_min))


def unsupported(config: ModelConfig) -> list[str]:
    kinds = config.block_kinds
    reasons = decoder_unsupported(config, qk_norm=False, supported=SUPPORTED_FEATURES)  # RoPE on whole heads
    if len(kinds) % 3 or config.pattern != "*M-" * (len(kinds) // 3):
        reasons.append(f"model.pattern={config.pattern!r} (Falcon-H1 layers are attention beside Mamba, then an "
                       "MLP: '*M-' per layer)")
    if not (config.parallel_residual and config.parallel_residual_shared_norm):
        reasons.append("model.parallel_residual and model.parallel_residual_shared_norm must both be true (Falcon-H1 "
                       "runs attention and Mamba side by side on one norm)")
    if config.sliding_window is not None:
        reasons.append(f"model.sliding_window={config.sliding_window} (Falcon-H1 attends to every earlier token)")
    if config.mlp_activation != "swiglu":
        reasons.append(f"model.mlp_activation={config.mlp_activation!r} (Falcon-H1's MLP is SwiGLU)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **rope_to_hf(config),
            "num_hidden_layers": config.num_blocks // 3, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.resolved_num_kv_heads, "head_dim": config.resolved_head_dim,
            "attention_dropout": config.attention_dropout, "attention_bias": config.attention_bias,
            "mlp_bias": config.mlp_bias, "hidden_act": "silu", "rms_norm_eps": config.norm_eps,
            "intermediate_size": config.resolved_ffn_hidden_size,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"],
            "mamba_d_ssm": config.mamba_inner_size, "mamba_n_heads": config.resolved_mamba_num_heads,
            "mamba_d_head": config.mamba_head_dim, "mamba_n_groups": config.mamba_num_groups,
            "mamba_d_state": config.mamba_state_size, "mamba_d_conv": config.mamba_conv_kernel,
            "mamba_expand": config.mamba_expand, "mamba_chunk_size": config.mamba_chunk_size,
            "mamba_conv_bias": config.mamba_conv_bias, "projectors_bias": config.mamba_proj_bias,
            "mamba_proj_bias": config.mamba_proj_bias, "mamba_rms_norm": config.mamba_gated_norm,
            "mamba_norm_before_gate": False, "time_step_limit": [config.mamba_dt_clamp_min, math.inf],
            "embedding_multiplier": config.embedding_multiplier, "lm_head_multiplier": 1.0 / config.logit_divisor,
            "mlp_multipliers": [1.0, 1.0], "key_multiplier": 1.0, "attention_in_multiplier": 1.0,
            "attention_out_multiplier": 1.0, "ssm_multipliers": [1.0] * 5, "ssm_in_multiplier": 1.0,
            "ssm_out_multiplier": 1.0}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.final_layernorm.weight")
    for layer in range(config.num_blocks // 3):
        attention, mamba, mlp = (f"blocks.{3 * layer + offset}" for offset in range(3))
        theirs = f"model.layers.{layer}"
        maps.append(rename(f"{attention}.norm.weight", f"{theirs}.input_layernorm.weight"))
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            maps += linear_maps(f"{attention}.mixer.{projection}", f"{theirs}.self_attn.{projection}",
                                config.attention_bias)
        maps += linear_maps(f"{mamba}.mixer.in_proj", f"{theirs}.mamba.in_proj", config.mamba_proj_bias)
        maps += linear_maps(f"{mamba}.mixer.conv1d", f"{theirs}.mamba.conv1d", config.mamba_conv_bias)
        maps += [rename(f"{mamba}.mixer.{name}", f"{theirs}.mamba.{name}") for name in ("dt_bias", "A_log", "D")]
        if config.mamba_gated_norm:
            maps.append(rename(f"{mamba}.mixer.norm.weight", f"{theirs}.mamba.norm.weight"))
        maps += linear_maps(f"{mamba}.mixer.out_proj", f"{theirs}.mamba.out_proj", config.mamba_proj_bias)
        maps.append(rename(f"{mlp}.norm.weight", f"{theirs}.pre_ff_layernorm.weight"))
        for projection in ("gate_proj", "up_proj", "down_proj"):
            maps += linear_maps(f"{mlp}.mixer.{projection}", f"{theirs}.feed_forward.{projection}", config.mlp_bias)
    return maps


def folded_multipliers(hf_config: dict, config: ModelConfig) -> dict[str, float | torch.Tensor]:
    """The factors import multiplies meshlm's weights and biases by (module docstring)."""
    hf = with_defaults(hf_config, DEFAULTS)
    attention_in, key = hf["attention_in_multiplier"], hf["key_multiplier"]
    gate, down = hf["mlp_multipliers"]
    ssm = hf["ssm_multipliers"]
    inner, bc = config.mamba_inner_size, config.mamba_num_groups * config.mamba_state_size
    widths = (inner, inner, bc, bc, config.resolved_mamba_num_heads)  # in_proj's rows: z, x, B, C, dt
    per_row = torch.cat([torch.full((width,), float(factor)) for width, factor in zip(widths, ssm)])[:, None]
    factors: dict[str, float | torch.Tensor] = {}
    for layer in range(config.num_blocks // 3):
        attention, mamba, mlp = (f"blocks.{3 * layer + offset}.mixer" for offset in range(3))
        factors |= {f"{attention}.q_proj.weight": attention_in, f"{attention}.k_proj.weight": attention_in * key,
                    f"{attention}.k_proj.bias": key, f"{attention}.v_proj.weight": attention_in,
                    f"{attention}.o_proj.weight": hf["attention_out_multiplier"],
                    f"{attention}.o_proj.bias": hf["attention_out_multiplier"],
                    f"{mamba}.in_proj.weight": per_row * hf["ssm_in_multiplier"], f"{mamba}.in_proj.bias": per_row[:, 0],
                    f"{mamba}.out_proj.weight": hf["ssm_out_multiplier"],
                    f"{mamba}.out_proj.bias": hf["ssm_out_multiplier"],
                    f"{mlp}.gate_proj.weight": gate, f"{mlp}.gate_proj.bias": gate,
                    f"{mlp}.down_proj.weight": down, f"{mlp}.down_proj.bias": down}
    return {name: factor for name, factor in factors.items() if not (isinstance(factor, float) and factor == 1.0)}


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            folded_multipliers=folded_multipliers)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf

__all__ = ["ARCHITECTURE", "NAME", "config_from_hf", "config_to_hf", "folded_multipliers", "state_from_hf",
           "state_to_hf", "tensor_maps"]
