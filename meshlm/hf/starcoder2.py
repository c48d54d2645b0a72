"""``Starcoder2ForCausalLM`` <-> meshlm (Lozhkov et al. 2024, "StarCoder 2 and The Stack v2: The Next
Generation"): the StarCoder2 code models (3B, 7B, 15B).

A StarCoder2 layer is attention with RoPE and grouped KV heads, then a non-gated MLP, as meshlm's
``*-``, with GPT-2's habits (``gpt2.py``) where Llama changed them:

- **LayerNorm** with a bias (``model.norm=layernorm``, eps ``norm_epsilon``) before each block
  and at the end;
- **biases** on every linear layer when ``use_bias`` (``model.attention_bias``,
  ``model.mlp_bias``);
- a non-gated MLP ``c_fc`` -> ``gelu_pytorch_tanh`` -> ``c_proj``
  (``model.mlp_activation=gelu_tanh``), plain ``nn.Linear`` layers here (not GPT-2's Conv1D);
- a ``sliding_window`` in every layer, or null (``model.sliding_window``).

``attention_dropout`` is ``model.attention_dropout`` and ``residual_dropout``
``model.hidden_dropout`` (which also covers the embeddings, where StarCoder2 has
``embedding_dropout``: the residual value stands for both). Training only.
"""

from __future__ import annotations

from meshlm.hf.common import (ACTIVATION_FROM_HF, ACTIVATION_TO_HF, Architecture, TensorMap,
                              decoder_layers_unsupported, embedding_maps, hf_common_fields, layer_norm_maps,
                              linear_maps, non_gated_activation_unsupported, rename, require, rope_from_hf,
                              uniform_window, window_fields, window_unsupported, with_defaults)
from meshlm.hf.llama import attention_fields, attention_to_hf
from meshlm.models.config import ModelConfig

NAME = "Starcoder2ForCausalLM"
MODEL_TYPE = "starcoder2"
DEFAULTS = {"vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
            "num_attention_heads": 24, "num_key_value_heads": 2, "hidden_act": "gelu_pytorch_tanh",
            "norm_epsilon": 1e-5, "use_bias": True, "residual_dropout": 0.0, "tie_word_embeddings": True,
            "initializer_range": 0.018042, "max_position_embeddings": 4096}
FIXED_FIELDS = {"norm": "layernorm", "position_embedding": "rope", "qk_norm": False}
SUPPORTED_FEATURES = frozenset({"norm"})


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", tuple(ACTIVATION_FROM_HF), "meshlm's non-gated MLPs")
    bias = bool(hf["use_bias"])
    window = hf_config.get("sliding_window")  # null, or one window for every layer
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **{**attention_fields(hf), "attention_bias": bias}, position_embedding="rope",
        **rope_from_hf(hf_config, 10000.0, NAME), **window_fields(window, [True] * hf["num_hidden_layers"]),
        hidden_dropout=float(hf["residual_dropout"]), mlp_activation=ACTIVATION_FROM_HF[hf["hidden_act"]],
        ffn_hidden_size=hf["intermediate_size"], mlp_bias=bias, norm="layernorm", norm_eps=hf["norm_epsilon"],
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "StarCoder2", SUPPORTED_FEATURES, FIXED_FIELDS)
    reasons += window_unsupported(config, "StarCoder2", uniform_only=True)
    reasons += non_gated_activation_unsupported(config, "StarCoder2", ACTIVATION_TO_HF)
    if not config.attention_bias == config.resolved_attention_output_bias == config.mlp_bias:
        reasons.append(f"model.attention_bias={config.attention_bias}, model.attention_output_bias="
                       f"{config.attention_output_bias}, model.mlp_bias={config.mlp_bias} (StarCoder2's use_bias puts "
                       "biases on every linear layer or none)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": ACTIVATION_TO_HF[config.mlp_activation], "norm_epsilon": config.norm_eps,
            "use_bias": config.attention_bias, "sliding_window": uniform_window(config),
            "residual_dropout": config.hidden_dropout, "embedding_dropout": config.hidden_dropout,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight")
    maps.append(rename("final_norm.bias", "model.norm.bias"))
    bias = config.attention_bias
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"model.layers.{layer}"
        maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.input_layernorm")
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            maps += linear_maps(f"{attention}.mixer.{projection}", f"{theirs}.self_attn.{projection}", bias)
        maps += layer_norm_maps(f"{mlp}.norm", f"{theirs}.post_attention_layernorm")
        maps += linear_maps(f"{mlp}.mixer.up_proj", f"{theirs}.mlp.c_fc", bias)
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.c_proj", bias)
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
