"""``Ernie4_5ForCausalLM`` <-> meshlm (Baidu 2025, "ERNIE 4.5 Technical Report"): the dense ERNIE 4.5
models (ERNIE-4.5-0.3B, base and post-trained).

An ERNIE 4.5 layer is Llama's -- RoPE attention with grouped KV heads, a SwiGLU MLP, RMSNorm, a
tied head by default -- with two differences:

- **RoPE over interleaved pairs, the whole head**: transformers' ``Ernie4_5`` rotates channels
  (2j, 2j + 1) by frequency j (GLM's ``rotate_half`` at full width), where meshlm rotates
  (j, j + d/2). Import takes the rows of ``q_proj`` and ``k_proj`` (and their biases) in the
  order ``half_from_interleaved`` gives, the same on both, so no score changes; export puts them
  back (``glm.regrouped_rows``, which GLM applies to half of each head).
- **one switch for every bias** (``use_bias``): q, k, v, o and the MLP's gate, up and down all
  have one or none do (``model.attention_bias``, ``model.attention_output_bias`` and
  ``model.mlp_bias`` all alike).

transformers computes the rotation in fp32 and casts back, as meshlm does. The MoE models
(``Ernie4_5_MoeForCausalLM``) are ``ernie4_5_moe.py``.
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, embedding_maps, linear_maps, query_key_tensors, rename,
                              rope_from_hf, rope_with_defaults, rows_of, window_unsupported, with_defaults)
from meshlm.hf.glm import regrouped_rows  # each head's rotary rows de-interleaved: here the whole head
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported, dense_mlp_maps
from meshlm.models.config import ModelConfig

NAME = "Ernie4_5ForCausalLM"
MODEL_TYPE = "ernie4_5"
DEFAULTS = {"vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "use_bias": False}
ROPE_THETA = 500000.0
"""transformers' ``Ernie4_5Config.default_theta``."""


def with_rope_defaults(hf_config: dict) -> dict:
    """config.json with the class's RoPE base (500000) where it names none, the whole head rotated."""
    return rope_with_defaults(hf_config, 1.0, ROPE_THETA)


def rope_fields(hf_config: dict) -> dict:
    """meshlm's RoPE fields of an ERNIE 4.5 config.json (dense or MoE)."""
    return rope_from_hf(with_rope_defaults(hf_config), ROPE_THETA, NAME)


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    bias = bool(hf["use_bias"])
    return dense_decoder_config({**hf, "attention_bias": bias, "mlp_bias": bias}, with_rope_defaults(hf_config), NAME,
                                attention_bias=bias)


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "ERNIE 4.5", qk_norm=False)
    reasons += window_unsupported(config, "ERNIE 4.5", uniform_only=False)
    if config.mlp_bias != config.attention_bias:
        reasons.append(f"model.mlp_bias={config.mlp_bias} with model.attention_bias={config.attention_bias} (ERNIE "
                       "4.5's use_bias gives every projection a bias or none)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                                 use_bias=config.attention_bias, pad_token_id=None, bos_token_id=None,
                                 eos_token_id=None)
    for key in ("attention_bias", "mlp_bias"):  # one switch, use_bias
        values.pop(key, None)
    return values


def query_key_maps(config: ModelConfig) -> list[TensorMap]:
    """Every layer's q_proj and k_proj (weights and biases) as rows of their HF tensors, which
    ``regrouped_rows`` then reorders."""
    head_dim = config.resolved_head_dim
    return [rows_of(ours, theirs, 0, heads * head_dim) for ours, theirs, heads in query_key_tensors(config)]


def attention_maps(config: ModelConfig, layer: int) -> list[TensorMap]:
    """HF layer ``layer``'s attention as block 2 * layer, but for q and k (``query_key_maps``)."""
    ours, theirs = f"blocks.{2 * layer}", f"model.layers.{layer}"
    maps = [rename(f"{ours}.norm.weight", f"{theirs}.input_layernorm.weight")]
    for projection in ("v_proj", "o_proj"):
        maps += linear_maps(f"{ours}.mixer.{projection}", f"{theirs}.self_attn.{projection}", config.attention_bias)
    return maps


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight") + query_key_maps(config)
    for layer in range(config.num_blocks // 2):
        maps += attention_maps(config, layer) + dense_mlp_maps(config, 2 * layer + 1, layer)
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            regrouped_rows=regrouped_rows)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf

__all__ = ["ARCHITECTURE", "NAME", "attention_maps", "config_from_hf", "config_to_hf", "query_key_maps", "rope_fields",
           "state_from_hf", "state_to_hf", "tensor_maps", "unsupported"]
