"""``Mamba2ForCausalLM`` <-> meshlm (Dao & Gu 2024, "Transformers are SSMs").

A pure Mamba-2 model is the meshlm pattern 'MMM...': every HF layer is one pre-norm residual
block whose mixer is a Mamba-2 layer. meshlm's mixer uses HF's parameter names and layouts
(in_proj rows ordered z, x, B, C, dt; conv channels x, B, C; a gated RMSNorm over groups of
d_inner / n_groups channels), so the map is a rename of the prefix only:

    backbone.embeddings.weight                 embedding.weight
    backbone.layers.{i}.norm.weight            blocks.{i}.norm.weight
    backbone.layers.{i}.mixer.<name>           blocks.{i}.mixer.<name>
    backbone.norm_f.weight / lm_head.weight    final_norm.weight / output.weight

Config: ``num_heads``, ``head_dim``, ``state_size``, ``n_groups``, ``conv_kernel``,
``chunk_size``, ``use_conv_bias`` and ``use_bias`` (in/out projections) map one to one;
``time_step_limit[0]`` is the lower clamp of dt in the forward (``mamba_dt_clamp_min``) and
``time_step_min/max/floor`` only shape the init. transformers requires
``num_heads * head_dim == expand * hidden_size``, so meshlm models whose inner width is not a
whole multiple of the hidden size cannot be written as Mamba2.
"""

from __future__ import annotations

import math

from meshlm.errors import ConfigError
from meshlm.hf.common import (Architecture, TensorMap, blocks_of, common_unsupported, embedding_maps, hf_common_fields,
                              linear_maps, rename, require, with_defaults)
from meshlm.models.config import ModelConfig

NAME = "Mamba2ForCausalLM"
DEFAULTS = {"num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
            "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 8,
            "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "initializer_range": 0.1,
            "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
            "time_step_limit": [0.0, math.inf], "chunk_size": 256, "tie_word_embeddings": False}


# --- the Mamba mixer, shared with Nemotron-H --------------------------------------------------------
def mamba_mixer_maps(config: ModelConfig, block: int, theirs: str, mixer: str = "mixer", norm: str = "norm"
                     ) -> list[TensorMap]:
    """Norm and mixer tensors of Mamba block ``block``, stored under HF prefix ``theirs`` as
    ``{theirs}.{norm}`` and ``{theirs}.{mixer}.*`` (Granite 4.0: ``input_layernorm``, ``mamba``)."""
    ours, mixer = f"blocks.{block}", f"{theirs}.{mixer}"
    maps = [rename(f"{ours}.norm.weight", f"{theirs}.{norm}.weight")]
    maps += linear_maps(f"{ours}.mixer.in_proj", f"{mixer}.in_proj", config.mamba_proj_bias)
    maps += linear_maps(f"{ours}.mixer.conv1d", f"{mixer}.conv1d", config.mamba_conv_bias)
    maps += [rename(f"{ours}.mixer.{name}", f"{mixer}.{name}") for name in ("dt_bias", "A_log", "D")]
    maps.append(rename(f"{ours}.mixer.norm.weight", f"{mixer}.norm.weight"))
    maps += linear_maps(f"{ours}.mixer.out_proj", f"{mixer}.out_proj", config.mamba_proj_bias)
    return maps


def mamba_fields(hf: dict, num_heads: int, head_dim: int, state_size: int, dt_clamp_min: float) -> dict:
    """meshlm Mamba fields from an HF config whose field names the two architectures share."""
    dt_min = hf["time_step_min"] if hf["time_step_min"] > 0 else 0.001  # init only; must be > 0 in meshlm
    inner_width = hf["expand"] * hf["hidden_size"]  # meshlm derives the head count from it when left as None
    derived = inner_width % head_dim == 0 and inner_width // head_dim == num_heads
    return {"mamba_num_heads": None if derived else num_heads, "mamba_head_dim": head_dim,
            "mamba_state_size": state_size,
            "mamba_num_groups": hf["n_groups"], "mamba_conv_kernel": hf["conv_kernel"],
            "mamba_expand": hf["expand"], "mamba_chunk_size": hf["chunk_size"],
            "mamba_conv_bias": bool(hf["use_conv_bias"]), "mamba_proj_bias": bool(hf["use_bias"]),
            "mamba_dt_min": dt_min, "mamba_dt_max": hf["time_step_max"], "mamba_dt_init_floor": hf["time_step_floor"],
            "mamba_dt_clamp_min": float(dt_clamp_min)}


def mamba_to_hf(config: ModelConfig) -> dict:
    return {"n_groups": config.mamba_num_groups, "conv_kernel": config.mamba_conv_kernel,
            "chunk_size": config.mamba_chunk_size, "use_conv_bias": config.mamba_conv_bias,
            "use_bias": config.mamba_proj_bias, "time_step_max": config.mamba_dt_max,
            "time_step_floor": config.mamba_dt_init_floor, "layer_norm_epsilon": config.norm_eps}


# --- Mamba2 ------------------------------------------------------------------------------------------
def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", "silu", "meshlm's Mamba convolution is followed by silu")
    clamp_min, clamp_max = hf["time_step_limit"]
    if clamp_max != math.inf:
        raise ConfigError(f"{NAME} config.json: time_step_limit={list(hf['time_step_limit'])} is not supported "
                          "yet (meshlm clamps dt from below only); use an upper limit of Infinity.")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="M" * hf["num_hidden_layers"],
        **mamba_fields(hf, hf["num_heads"], hf["head_dim"], hf["state_size"], clamp_min),
        norm="rmsnorm", norm_eps=hf["layer_norm_epsilon"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = common_unsupported(config) + blocks_of(config, "M+", "Mamba2 models are Mamba blocks only: 'MMM...'")
    if config.mamba_inner_size % config.hidden_size:
        reasons.append(f"model.mamba_num_heads * model.mamba_head_dim = {config.mamba_inner_size} (transformers "
                       f"needs a whole multiple of hidden_size={config.hidden_size})")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, "mamba2"), **mamba_to_hf(config),
            "num_hidden_layers": config.num_blocks, "num_heads": config.resolved_mamba_num_heads,
            "head_dim": config.mamba_head_dim, "state_size": config.mamba_state_size,
            "expand": config.mamba_inner_size // config.hidden_size, "hidden_act": "silu",
            "time_step_min": config.mamba_dt_min, "time_step_limit": [config.mamba_dt_clamp_min, math.inf],
            "time_step_rank": "auto", "residual_in_fp32": True, "rescale_prenorm_residual": False}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "backbone.embeddings.weight", "backbone.norm_f.weight")
    for block in range(config.num_blocks):
        maps += mamba_mixer_maps(config, block, f"backbone.layers.{block}")
    return maps


ARCHITECTURE = Architecture(NAME, "mamba2", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
