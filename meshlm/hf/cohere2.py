"""``Cohere2ForCausalLM`` <-> meshlm (Cohere's Command R7B and Command A; Cohere 2025, "Command A:
An Enterprise-Ready Large Language Model").

A Cohere2 layer is Command R's (``cohere.py``): attention and a SwiGLU MLP side by side through one
LayerNorm without a bias, RoPE over interleaved pairs of whole heads (reordered into meshlm's
rotate-half pairs on import and back on export), logits scaled by ``logit_scale``. What it adds is
an interleaved attention pattern: three layers in four attend within ``sliding_window`` (4096) and
rotate their queries and keys; every fourth attends to the whole context with no position encoding
at all (NoPE, Kazemnejad et al. 2023). ``layer_types`` names each layer's kind (older config.json
files give ``sliding_window_pattern``, 4: every fourth layer full), and meshlm holds it as
``model.sliding_window_pattern`` ("SSSF") with ``model.rope_pattern`` ("RRRN"), the two always
letter for letter.
"""

from __future__ import annotations

from meshlm.hf import cohere
from meshlm.hf.common import (SLIDING_ATTENTION, Architecture, fixed_fields_unsupported,
                              layer_rotates, layer_types_from_hf, layer_types_to_hf, layer_windows,
                              rope_pattern_fields, split_heads_unsupported, window_fields, with_defaults)
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported
from meshlm.models.config import ModelConfig

NAME = "Cohere2ForCausalLM"
MODEL_TYPE = "cohere2"
DEFAULTS = {**{name: value for name, value in cohere.DEFAULTS.items() if name != "use_qk_norm"},
            "sliding_window": 4096}
SUPPORTED_FEATURES = frozenset({"norm", "norm_bias", "parallel_residual", "parallel_residual_shared_norm",
                                "logit_divisor", "rope_pattern"})


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    # without layer_types, the older field: every sliding_window_pattern-th layer full
    types = layer_types_from_hf(hf, NAME, full_every=hf.get("sliding_window_pattern", 4))
    sliding = [kind == SLIDING_ATTENTION for kind in types]
    return dense_decoder_config({**hf, "rms_norm_eps": hf["layer_norm_eps"]}, hf_config, NAME, norm="layernorm",
                                norm_bias=False, parallel_residual=True, parallel_residual_shared_norm=True,
                                logit_divisor=1.0 / float(hf["logit_scale"]),
                                **window_fields(hf["sliding_window"], sliding), **rope_pattern_fields(sliding))


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Cohere2", qk_norm=False, supported=SUPPORTED_FEATURES)
    reasons += fixed_fields_unsupported(config, "Cohere2", cohere.FIXED_FIELDS)
    reasons += split_heads_unsupported(config, "Cohere2")
    if layer_rotates(config) != [window is not None for window in layer_windows(config)]:
        reasons.append(f"model.rope_pattern={config.rope_pattern!r} with model.sliding_window_pattern="
                       f"{config.sliding_window_pattern!r} and model.sliding_window={config.sliding_window} (Cohere2 "
                       "rotates exactly its sliding layers; its full layers have no RoPE)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                                 layer_norm_eps=config.norm_eps, logit_scale=1.0 / config.logit_divisor,
                                 attention_bias=config.attention_bias, layer_types=layer_types_to_hf(config),
                                 sliding_window=config.sliding_window)
    del values["rms_norm_eps"], values["head_dim"]
    return values


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, cohere.tensor_maps, unsupported,
                            regrouped_rows=cohere.regrouped_rows)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
