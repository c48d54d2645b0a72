"""``PhiForCausalLM`` <-> meshlm (Gunasekar et al. 2023, "Textbooks Are All You Need" (phi-1); Li et
al. 2023, "Textbooks Are All You Need II" (phi-1.5); Microsoft's Phi-2): phi-1, phi-1.5, Phi-2.

A Phi layer runs attention and the MLP side by side through one LayerNorm,
``h + attn(ln(h)) + mlp(ln(h))`` (``model.parallel_residual`` with
``model.parallel_residual_shared_norm``), with:

- **partial rotary**: RoPE on the first ``partial_rotary_factor`` of each head's channels (Phi-2:
  0.4, 32 of 80; the class default 0.5) -- ``model.rope_fraction`` -- rotate-half pairs as meshlm's;
- biases on every linear layer: q, k, v and ``dense`` (``model.attention_bias``), ``fc1`` and
  ``fc2`` (``model.mlp_bias``), and on the output head, ``lm_head`` (``model.output_bias``);
- a non-gated MLP ``fc1`` -> ``hidden_act`` (``gelu_new``, GELU's tanh approximation) -> ``fc2``;
- LayerNorm with a bias before each layer and at the end (``final_layernorm``).

``resid_pdrop`` is ``model.hidden_dropout`` (``embd_pdrop`` too: meshlm's hidden dropout covers the
embeddings) and ``attention_dropout`` ``model.attention_dropout``. Training only.

With ``qk_layernorm`` one LayerNorm with a bias, shared by the heads, normalizes each head of q
and of k before RoPE: ``model.qk_norm`` with ``qk_norm_type=layernorm`` and ``qk_norm_bias``.

Not supported, refused by name: ``tie_word_embeddings`` (a tied head with a bias of its own).
"""

from __future__ import annotations

from meshlm.hf.common import (ACTIVATION_FROM_HF, ACTIVATION_TO_HF_GELU_NEW, QK_LAYERNORM_FEATURES, Architecture,
                              TensorMap, decoder_layers_unsupported, hf_common_fields, layer_norm_maps, linear_maps,
                              non_gated_activation_unsupported, qk_layernorm_unsupported, rename, require,
                              rope_from_hf, rope_with_defaults, split_heads_unsupported, window_unsupported,
                              with_defaults)
from meshlm.hf.llama import attention_fields, attention_to_hf
from meshlm.models.config import ModelConfig

NAME = "PhiForCausalLM"
MODEL_TYPE = "phi"
DEFAULTS = {"vocab_size": 51200, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
            "num_attention_heads": 32, "resid_pdrop": 0.0, "attention_dropout": 0.0, "hidden_act": "gelu_new",
            "max_position_embeddings": 2048, "initializer_range": 0.02, "layer_norm_eps": 1e-5,
            "tie_word_embeddings": False, "qk_layernorm": False, "partial_rotary_factor": 0.5}
FIXED_FIELDS = {"norm": "layernorm", "position_embedding": "rope", "parallel_residual": True,
                "parallel_residual_shared_norm": True, "attention_bias": True, "mlp_bias": True,
                "output_bias": True}
"""What every Phi layer has."""
SUPPORTED_FEATURES = frozenset({"norm", "rope_fraction", "parallel_residual", "parallel_residual_shared_norm",
                                "output_bias"}) | QK_LAYERNORM_FEATURES


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", tuple(ACTIVATION_FROM_HF), "meshlm's non-gated MLPs")
    require(hf, NAME, "tie_word_embeddings", False, "Phi's lm_head has a bias of its own, and meshlm's tied head has "
            "none (model.output_bias needs an untied head)")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **{**attention_fields(hf), "attention_bias": True}, position_embedding="rope",
        **rope_from_hf(rope_with_defaults(hf_config, DEFAULTS["partial_rotary_factor"], 10000.0), 10000.0, NAME,
                       partial_rotary=True),
        parallel_residual=True, parallel_residual_shared_norm=True, hidden_dropout=float(hf["resid_pdrop"]),
        mlp_activation=ACTIVATION_FROM_HF[hf["hidden_act"]], ffn_hidden_size=hf["intermediate_size"], mlp_bias=True,
        norm="layernorm", norm_eps=hf["layer_norm_eps"], output_bias=True, init_std=hf["initializer_range"],
        **qk_layernorm_fields(bool(hf["qk_layernorm"])))


def qk_layernorm_fields(qk_layernorm: bool) -> dict:
    """Phi's optional QK-norm: one LayerNorm with a bias, shared by the heads."""
    return {"qk_norm": True, "qk_norm_type": "layernorm", "qk_norm_bias": True} if qk_layernorm else {}


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "Phi", SUPPORTED_FEATURES, FIXED_FIELDS)
    reasons += window_unsupported(config, "Phi", uniform_only=False)
    reasons += non_gated_activation_unsupported(config, "Phi", ACTIVATION_TO_HF_GELU_NEW)
    reasons += split_heads_unsupported(config, "Phi")
    reasons += qk_layernorm_unsupported(config, "Phi", per_head=False, bias=True)
    if not config.resolved_attention_output_bias:
        reasons.append("model.attention_output_bias=False (Phi's dense has a bias)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    attention = attention_to_hf(config)
    attention["rope_parameters"]["partial_rotary_factor"] = float(config.rope_fraction)
    del attention["head_dim"]  # Phi's heads always split the hidden size
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **attention,
            "partial_rotary_factor": float(config.rope_fraction), "num_hidden_layers": config.num_blocks // 2,
            "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": ACTIVATION_TO_HF_GELU_NEW[config.mlp_activation],
            "layer_norm_eps": config.norm_eps, "qk_layernorm": config.qk_norm, "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout, "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [rename("embedding.weight", "model.embed_tokens.weight"),
            *layer_norm_maps("final_norm", "model.final_layernorm"), *linear_maps("output", "lm_head", True)]
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"model.layers.{layer}"
        maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.input_layernorm")  # the MLP block applies it too
        for projection in ("q_proj", "k_proj", "v_proj"):
            maps += linear_maps(f"{attention}.mixer.{projection}", f"{theirs}.self_attn.{projection}", True)
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.self_attn.dense", True)
        if config.qk_norm:
            maps += layer_norm_maps(f"{attention}.mixer.q_norm", f"{theirs}.self_attn.q_layernorm")
            maps += layer_norm_maps(f"{attention}.mixer.k_norm", f"{theirs}.self_attn.k_layernorm")
        maps += linear_maps(f"{mlp}.mixer.up_proj", f"{theirs}.mlp.fc1", True)
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.fc2", True)
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
