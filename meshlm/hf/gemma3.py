"""``Gemma3ForCausalLM`` <-> meshlm (Gemma Team 2025, "Gemma 3 Technical Report"): the text model.

A Gemma 3 decoder layer is attention then a gated MLP, like Llama's, with four differences, each a
meshlm model field:

- **sandwich norms** (``model.block_output_norm``): the attention and MLP outputs are normalized
  again before the residual add, so a layer has four norms -- ``input_layernorm`` and
  ``post_attention_layernorm`` around attention (meshlm block 2i's ``norm`` and ``output_norm``),
  ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP (block 2i+1's);
- **zero-centered norm weights** (``model.norm_zero_centered``): every RMSNorm, QK-norms included,
  multiplies by 1 + weight, and the files store the weight;
- **scaled embeddings** (``model.embedding_multiplier``): sqrt(hidden_size), rounded to the
  embedding's dtype as transformers does;
- **GeGLU** (``model.mlp_activation=geglu``): gelu_pytorch_tanh(gate) * up.

Attention has QK-norm (before RoPE), grouped KV heads and a 256-wide head; five of every six layers
attend within a sliding window (``sliding_window``, ``layer_types`` or v4's
``sliding_window_pattern``: ``model.sliding_window`` and ``model.sliding_window_pattern``) and
rotate with their own RoPE base, 10000, unscaled (``model.rope_local_theta``), while the full
layers use ``rope_theta`` (1e6) with the config's scaling (linear x8 in the 4B-27B models). The
output head is tied to the embedding.

**The multimodal folders** (``Gemma3ForConditionalGeneration``: Gemma 3 4B, 12B and 27B) hold
the same language model beside a SigLIP vision tower. Import reads their ``text_config`` and the
language model's tensors (``language_model.model.*`` as the hub files name them, or transformers
v5's ``model.language_model.*``) and leaves the vision tower and its projector out: the result is
the text model, which export writes as ``Gemma3ForCausalLM``.

The attention logits are scaled by ``query_pre_attn_scalar ** -0.5``: 1/sqrt(head_dim) in most
sizes, and in 27B (head_dim 128, scalar 168) ``model.attention_scale``.

Of Gemma 2's soft-capping (``gemma2.py``), which Gemma 3's published configs leave null, the
output logits' cap (``final_logit_softcapping``: ``model.final_logit_softcap``) is read and
written; ``attn_logit_softcapping`` is a field of the config that transformers' Gemma 3 attention
never reads, so import ignores it as transformers does, and a model with capped attention scores
exports as Gemma 2, not 3. Not supported, refused by name: bidirectional attention.
"""

from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.hf.common import (SLIDING_ATTENTION, Architecture, TensorMap, decoder_layers_unsupported,
                              hf_common_fields, layer_types_from_hf, layer_types_to_hf, layered_rope_fields,
                              layered_rope_to_hf, linear_maps, rename, require, window_fields, with_defaults)
from meshlm.hf.llama import attention_fields, attention_maps, decoder_embedding_maps
from meshlm.hf.multimodal import language_model_tensors
from meshlm.models.config import ModelConfig

NAME = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0
"""transformers' RoPE bases when config.json gives none: full layers, sliding layers."""
SLIDING_WINDOW_PATTERN = 6
"""v4 configs: every sixth layer is full (``sliding_window_pattern``)."""
DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "use_bidirectional_attention": False, "initializer_range": 0.02, "max_position_embeddings": 131072}
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
FIXED_FIELDS = {"mlp_activation": "geglu", "qk_norm": True, "norm_zero_centered": True, "block_output_norm": True,
                "position_embedding": "rope", "attention_bias": False, "mlp_bias": False}
"""What every Gemma 3 layer has."""
SUPPORTED_FEATURES = frozenset({"block_output_norm", "norm_zero_centered", "embedding_multiplier", "rope_local_theta",
                                "attention_scale", "final_logit_softcap"})


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_activation", GELU_TANH, "meshlm's GeGLU is gelu_pytorch_tanh(gate) * up")
    require(hf, NAME, "use_bidirectional_attention", False, "meshlm attention is causal")
    scalar = hf["query_pre_attn_scalar"]
    scale = None if scalar == hf["head_dim"] else scalar ** -0.5  # transformers' scaling, computed alike
    types = layer_types_from_hf(hf, NAME, hf.get("sliding_window_pattern") or SLIDING_WINDOW_PATTERN)
    windows = window_fields(hf.get("sliding_window"), [kind == SLIDING_ATTENTION for kind in types])
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **attention_fields(hf), attention_scale=scale, position_embedding="rope", qk_norm=True, **windows,
        final_logit_softcap=hf.get("final_logit_softcapping"),  # (attn_logit_softcapping: unread, module docstring)
        **layered_rope_fields(hf_config, NAME, GLOBAL_THETA, LOCAL_THETA, "rope_local_base_freq", bool(windows)),
        **gemma_layer_fields(hf))


def gemma_layer_fields(hf: dict) -> dict:
    """The fields Gemma 2 and 3 set alike from config.json (``hf``, defaults filled): GeGLU MLPs,
    zero-centered RMSNorms before and after each block, sqrt(hidden) embeddings."""
    return dict(mlp_activation="geglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=False, norm="rmsnorm",
                norm_eps=hf["rms_norm_eps"], norm_zero_centered=True, block_output_norm=True,
                embedding_multiplier=hf["hidden_size"] ** 0.5, tie_embeddings=bool(hf["tie_word_embeddings"]),
                init_std=hf["initializer_range"])


def gemma_unsupported(config: ModelConfig, label: str, supported: frozenset[str], fixed: dict) -> list[str]:
    """Why ``config`` is not a Gemma layer stack (``label``: "Gemma 2", "Gemma 3"), by field."""
    # (per-head QK-norm and block input norms: common_unsupported refuses their alternatives)
    reasons = decoder_layers_unsupported(config, label, supported, fixed)
    if config.resolved_attention_output_bias:
        reasons.append(f"model.attention_output_bias=True ({label}'s attention has no biases)")
    if config.embedding_multiplier != config.hidden_size ** 0.5:
        reasons.append(f"model.embedding_multiplier={config.embedding_multiplier} ({label} scales the embeddings by "
                       f"sqrt(hidden_size) = {config.hidden_size ** 0.5})")
    return reasons


def unsupported(config: ModelConfig) -> list[str]:
    reasons = gemma_unsupported(config, "Gemma 3", SUPPORTED_FEATURES, FIXED_FIELDS)
    if config.rope_local_theta is None and config.sliding_window is not None and config.rope_scaling != "none":
        reasons.append(f"model.rope_local_theta=None with model.rope_scaling={config.rope_scaling!r} (Gemma 3's "
                       "sliding layers rotate unscaled; set model.rope_local_theta, e.g. to model.rope_theta)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    layers = config.num_blocks // 2
    return {**hf_common_fields(config, NAME, MODEL_TYPE),
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.resolved_num_kv_heads,
            "head_dim": config.resolved_head_dim, "query_pre_attn_scalar": query_pre_attn_scalar(config),
            "attention_dropout": config.attention_dropout, "attention_bias": False,
            "num_hidden_layers": layers, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": config.norm_eps,
            "sliding_window": config.sliding_window, "layer_types": layer_types_to_hf(config),
            **layered_rope_to_hf(config),
            "attn_logit_softcapping": None, "final_logit_softcapping": config.final_logit_softcap,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def query_pre_attn_scalar(config: ModelConfig) -> float | int:
    """Gemma's name for the attention scale: s with scale = s ** -0.5 (a whole number when it is one)."""
    if config.attention_scale is None:
        return config.resolved_head_dim
    scalar = config.attention_scale ** -2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = 2 * layer, 2 * layer + 1, f"model.layers.{layer}"
        maps += attention_maps(config, attention, layer)  # input_layernorm, q/k/v/o, q_norm/k_norm
        maps += [rename(f"blocks.{attention}.output_norm.weight", f"{theirs}.post_attention_layernorm.weight"),
                 rename(f"blocks.{mlp}.norm.weight", f"{theirs}.pre_feedforward_layernorm.weight"),
                 rename(f"blocks.{mlp}.output_norm.weight", f"{theirs}.post_feedforward_layernorm.weight")]
        for projection in ("gate_proj", "up_proj", "down_proj"):
            maps += linear_maps(f"blocks.{mlp}.mixer.{projection}", f"{theirs}.mlp.{projection}", False)
    return maps


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf


# --- the multimodal folders: their language model -----------------------------------------------------
MULTIMODAL_NAME = "Gemma3ForConditionalGeneration"
def text_config_from_multimodal(hf_config: dict) -> ModelConfig:
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{MULTIMODAL_NAME} config.json has no text_config; it is not a Gemma 3 folder meshlm reads.")
    return config_from_hf(text)


def multimodal_unsupported(config: ModelConfig) -> list[str]:
    return [f"meshlm holds only the language model of a {MULTIMODAL_NAME} folder; export it as {NAME}"]


MULTIMODAL = Architecture(MULTIMODAL_NAME, "gemma3", text_config_from_multimodal, config_to_hf, tensor_maps,
                          multimodal_unsupported, normalize_hf_tensors=language_model_tensors)
"""Import only: the text model of Gemma 3's multimodal folders."""
