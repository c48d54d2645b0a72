"""``LlamaForCausalLM`` <-> meshlm (Touvron et al. 2023, "LLaMA").

A Llama decoder layer is two pre-norm residual steps, attention then a SwiGLU MLP, so HF layer
i becomes meshlm blocks 2i ('*') and 2i+1 ('-'): ``input_layernorm`` is the attention block's
norm and ``post_attention_layernorm`` the MLP block's norm. Everything else is a rename:

    model.embed_tokens.weight                     embedding.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj     blocks.{2i}.mixer.{q,k,v,o}_proj
    model.layers.{i}.mlp.{gate,up,down}_proj      blocks.{2i+1}.mixer.{gate,up,down}_proj
    model.norm.weight / lm_head.weight            final_norm.weight / output.weight

The attention and MLP maps here are reused by the Qwen3-MoE and Mixtral adapters, whose decoder
layers differ only in what follows the attention.
"""

from __future__ import annotations

from meshlm.hf.common import (FULL_ATTENTION, SLIDING_ATTENTION, Architecture, TensorMap, blocks_of, common_unsupported,
                              embedding_maps, hf_common_fields, layer_types_from_hf, layer_types_to_hf, linear_maps,
                              rename, require, rope_from_hf, rope_to_hf, window_fields, window_unsupported,
                              with_defaults)
from meshlm.models.config import ModelConfig

NAME = "LlamaForCausalLM"
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02, "max_position_embeddings": 2048}


# --- pieces shared with the other decoder-layer architectures ------------------------------------
def attention_fields(hf: dict) -> dict:
    """meshlm attention fields from an HF config (defaults left as None, so round trips are exact)."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads
    return {"num_attention_heads": heads, "num_kv_heads": None if kv_heads == heads else kv_heads,
            "head_dim": None if head_dim == hidden // heads else head_dim,
            "attention_bias": bool(hf.get("attention_bias", False)),
            "attention_dropout": float(hf.get("attention_dropout") or 0.0)}


def attention_to_hf(config: ModelConfig) -> dict:
    return {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.resolved_num_kv_heads,
            "head_dim": config.resolved_head_dim, "attention_dropout": config.attention_dropout, **rope_to_hf(config)}


def decoder_unsupported(config: ModelConfig, qk_norm: bool, output_bias_apart: bool = False,
                        supported: frozenset[str] = frozenset()) -> list[str]:
    """Reasons a config's attention blocks differ from an HF decoder layer's (RoPE, QK-norm; o's bias
    follows q/k/v's unless ``output_bias_apart``: the class checks that itself; ``supported``: the
    layer features of ``common.LAYER_FEATURES`` the class holds)."""
    reasons = common_unsupported(config, supported=supported)
    if not output_bias_apart and config.resolved_attention_output_bias != config.attention_bias:
        reasons.append(f"model.attention_output_bias={config.attention_output_bias} with model.attention_bias="
                       f"{config.attention_bias} (its q/k/v/o projections all have biases or none do)")
    if config.position_embedding != "rope":
        reasons.append(f"model.position_embedding={config.position_embedding!r} (its attention uses RoPE)")
    if config.qk_norm != qk_norm:
        reasons.append(f"model.qk_norm={config.qk_norm} (its attention {'always' if qk_norm else 'never'} "
                       "normalizes queries and keys)")
    return reasons


def attention_maps(config: ModelConfig, block: int, layer: int) -> list[TensorMap]:
    ours, theirs = f"blocks.{block}", f"model.layers.{layer}"
    maps = [rename(f"{ours}.norm.weight", f"{theirs}.input_layernorm.weight")]
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
        bias = config.resolved_attention_output_bias if projection == "o_proj" else config.attention_bias
        maps += linear_maps(f"{ours}.mixer.{projection}", f"{theirs}.self_attn.{projection}", bias)
    if config.qk_norm:
        maps += [rename(f"{ours}.mixer.q_norm.weight", f"{theirs}.self_attn.q_norm.weight"),
                 rename(f"{ours}.mixer.k_norm.weight", f"{theirs}.self_attn.k_norm.weight")]
    return maps


def dense_mlp_maps(config: ModelConfig, block: int, layer: int) -> list[TensorMap]:
    ours, theirs = f"blocks.{block}", f"model.layers.{layer}"
    maps = [rename(f"{ours}.norm.weight", f"{theirs}.post_attention_layernorm.weight")]
    for projection in ("gate_proj", "up_proj", "down_proj"):
        maps += linear_maps(f"{ours}.mixer.{projection}", f"{theirs}.mlp.{projection}", config.mlp_bias)
    return maps


def decoder_embedding_maps(config: ModelConfig) -> list[TensorMap]:
    return embedding_maps(config, "model.embed_tokens.weight", "model.norm.weight")


# --- the dense '*-' decoders: Llama, and Mistral and Qwen3 built on it ------------------------------
def dense_decoder_config(hf: dict, hf_config: dict, name: str, qk_norm: bool = False, partial_rotary: bool = False,
                         **fields) -> ModelConfig:
    """The meshlm config of a Llama-style HF decoder (``hf``: config.json with its class's defaults
    filled in): layer i is blocks 2i ('*', RoPE attention) and 2i+1 ('-', SwiGLU MLP); ``fields``
    replace what the class fixes (Qwen2's attention biases); ``partial_rotary``: the class rotates
    part of each head (``rope_from_hf``)."""
    require(hf, name, "hidden_act", "silu", "meshlm's gated MLP is SwiGLU, silu(gate) * up")
    values = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        **attention_fields(hf), position_embedding="rope", qk_norm=qk_norm,
        **rope_from_hf(hf_config, 10000.0, name, partial_rotary),
        mlp_activation="swiglu", ffn_hidden_size=hf["intermediate_size"], mlp_bias=bool(hf.get("mlp_bias", False)),
        norm="rmsnorm", norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"])
    return ModelConfig(**{**values, **fields})


def qwen_windows_from_hf(hf: dict, name: str) -> dict:
    """meshlm's window fields from a Qwen2/Qwen3 config.json (``hf`` with the class's defaults):
    with ``use_sliding_window``, the layers ``layer_types`` marks sliding -- or, without it, the
    layers from ``max_window_layers`` on -- attend within ``sliding_window``; without it (or with a
    null window) every layer attends to every earlier token, whatever ``layer_types`` says
    (transformers' rule)."""
    window, layers = hf.get("sliding_window"), hf["num_hidden_layers"]
    if not hf.get("use_sliding_window") or window is None:
        return {}
    if hf.get("layer_types") is None:  # the layers from max_window_layers on slide
        hf = {**hf, "layer_types": [SLIDING_ATTENTION if index >= hf["max_window_layers"] else FULL_ATTENTION
                                    for index in range(layers)]}
    types = layer_types_from_hf(hf, name)
    return window_fields(window, [kind == SLIDING_ATTENTION for kind in types])


def qwen_windows_to_hf(config: ModelConfig, layers: int) -> dict:
    """A Qwen-style config.json's window fields: ``layer_types`` per layer, and ``max_window_layers``
    as the full layers before the first sliding one (what older transformers read instead)."""
    types = layer_types_to_hf(config)
    if SLIDING_ATTENTION not in types:
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers, "layer_types": types}
    return {"use_sliding_window": True, "sliding_window": config.sliding_window,
            "max_window_layers": types.index(SLIDING_ATTENTION), "layer_types": types}


def dense_decoder_to_hf(config: ModelConfig, name: str, model_type: str, max_positions: int, **fields) -> dict:
    """The config.json of a '*-' SwiGLU decoder class (``dense_decoder_config`` read back): the
    fields every such class shares, then the class's own ``fields`` (which may replace them)."""
    return {**hf_common_fields(config, name, model_type), **attention_to_hf(config),
            "num_hidden_layers": config.num_blocks // 2, "intermediate_size": config.resolved_ffn_hidden_size,
            "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "max_position_embeddings": max_positions,
            **fields}


def dense_decoder_unsupported(config: ModelConfig, label: str, qk_norm: bool, output_bias_apart: bool = False,
                              supported: frozenset[str] = frozenset()) -> list[str]:
    """Why ``config`` is not a '*-' SwiGLU decoder of class ``label`` (with or without QK-norm)."""
    reasons = decoder_unsupported(config, qk_norm=qk_norm, output_bias_apart=output_bias_apart, supported=supported)
    reasons += blocks_of(config, r"(\*-)+", f"{label} layers are attention then MLP: '*-' repeated")
    if config.mlp_activation != "swiglu":
        reasons.append(f"model.mlp_activation={config.mlp_activation!r} ({label}'s MLP is SwiGLU)")
    return reasons


# --- Llama ------------------------------------------------------------------------------------------
def config_from_hf(hf_config: dict) -> ModelConfig:
    return dense_decoder_config(with_defaults(hf_config, DEFAULTS), hf_config, NAME)


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Llama", qk_norm=False)
    reasons += window_unsupported(config, "Llama", uniform_only=False)
    if config.hidden_size % config.num_attention_heads:
        reasons.append(f"model.hidden_size={config.hidden_size} (transformers requires a multiple of "
                       f"num_attention_heads={config.num_attention_heads})")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    return dense_decoder_to_hf(config, NAME, "llama", DEFAULTS["max_position_embeddings"],
                               attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, pretraining_tp=1)


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = decoder_embedding_maps(config)
    for layer in range(config.num_blocks // 2):
        maps += attention_maps(config, 2 * layer, layer) + dense_mlp_maps(config, 2 * layer + 1, layer)
    return maps


ARCHITECTURE = Architecture(NAME, "llama", config_from_hf, config_to_hf, tensor_maps, unsupported)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
