"""``GPTNeoXForCausalLM`` <-> meshlm (Black et al. 2022, "GPT-NeoX-20B"; Biderman et al. 2023,
"Pythia"): GPT-NeoX-20B, the Pythia suite (70M to 12B, with checkpoints through training, the usual
models of interpretability and training-dynamics research), and the models trained with
EleutherAI's GPT-NeoX library in that shape.

A GPT-NeoX layer is an attention block and an MLP block, meshlm's ``*-``, with:

- a **parallel residual** (``use_parallel_residual``, true in all of these): attention and MLP
  read the same input, ``h + attn(ln1(h)) + mlp(ln2(h))`` (``model.parallel_residual``); false
  gives the usual sequential layer;
- **LayerNorm** with a bias before each block and at the end (``model.norm=layernorm``, eps
  ``layer_norm_eps``);
- **partial rotary**: RoPE on the first quarter of each head's channels (``rotary_pct`` 0.25,
  in transformers v5 ``partial_rotary_factor``: ``model.rope_fraction``), base
  ``rotary_emb_base`` (v5: ``rope_theta``) 10000, rotate-half pairs as meshlm's;
- multi-head attention with biases on ``query_key_value`` and ``dense`` (``attention_bias``), a
  non-gated MLP ``dense_h_to_4h`` -> ``hidden_act`` (exact GELU) -> ``dense_4h_to_h``, always
  with biases; an untied output head (``embed_out``; ``lm_head`` in transformers v5's state).

**Tensors.** q, k and v are one ``query_key_value`` whose rows are grouped *per head*: head i's
query, key and value rows, then head i + 1's (``[q_0 k_0 v_0 q_1 k_1 v_1 ...]``, each head_dim
rows). meshlm keeps three projections, so import reorders the rows into ``[q; k; v]`` and cuts
them apart, and export joins them and puts each head's rows back together
(``common.grouped_qkv_row_order``). Older files (Pythia's) hold each layer's causal mask (``attention.bias``,
``attention.masked_bias``) and RoPE frequencies (``rotary_emb.inv_freq``): buffers, left out.

``attention_dropout`` is ``model.attention_dropout`` and ``hidden_dropout`` ``model.hidden_dropout``
(after the embedding and each block, as in GPT-NeoX). Training only.
"""

from __future__ import annotations

from meshlm.hf.common import (ACTIVATION_FROM_HF, ACTIVATION_TO_HF, Architecture, RegroupedRows, TensorMap,
                              decoder_layers_unsupported, fused_qkv_tensors, fused_rows, grouped_qkv_row_order,
                              hf_common_fields, layer_norm_maps, linear_maps, multi_head_unsupported,
                              non_gated_activation_unsupported, rename, require, rope_from_hf, rope_to_hf,
                              rope_with_defaults, window_unsupported, with_defaults)
from meshlm.models.config import ModelConfig

NAME = "GPTNeoXForCausalLM"
MODEL_TYPE = "gpt_neox"
DEFAULTS = {"vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
            "intermediate_size": 24576, "hidden_act": "gelu", "rotary_pct": 0.25, "rotary_emb_base": 10000,
            "attention_dropout": 0.0, "hidden_dropout": 0.0, "max_position_embeddings": 2048,
            "initializer_range": 0.02, "layer_norm_eps": 1e-5, "tie_word_embeddings": False,
            "use_parallel_residual": True, "attention_bias": True}
FIXED_FIELDS = {"norm": "layernorm", "position_embedding": "rope", "qk_norm": False, "mlp_bias": True}
SUPPORTED_FEATURES = frozenset({"norm", "rope_fraction", "parallel_residual"})
PREFIX = "gpt_neox."
HEAD_NAMES = ("embed_out.weight", "lm_head.weight")
"""The output head in hub files (``embed_out``, which export writes: every transformers version
reads it) and in transformers v5's own state dict (``lm_head``)."""
BUFFER_SUFFIXES = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "hidden_act", tuple(ACTIVATION_FROM_HF), "meshlm's non-gated MLPs")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], pattern="*-" * hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"], attention_bias=bool(hf["attention_bias"]),
        position_embedding="rope", **rope_from_hf(rope_with_defaults(
            hf_config, DEFAULTS["rotary_pct"], DEFAULTS["rotary_emb_base"], "rotary_pct", "rotary_emb_base"),
            DEFAULTS["rotary_emb_base"], NAME, partial_rotary=True),
        parallel_residual=bool(hf["use_parallel_residual"]), attention_dropout=float(hf["attention_dropout"]),
        hidden_dropout=float(hf["hidden_dropout"]), mlp_activation=ACTIVATION_FROM_HF[hf["hidden_act"]],
        ffn_hidden_size=hf["intermediate_size"], mlp_bias=True, norm="layernorm", norm_eps=hf["layer_norm_eps"],
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "GPT-NeoX", SUPPORTED_FEATURES, FIXED_FIELDS)
    reasons += window_unsupported(config, "GPT-NeoX", uniform_only=False)
    reasons += non_gated_activation_unsupported(config, "GPT-NeoX", ACTIVATION_TO_HF)
    reasons += multi_head_unsupported(config, "GPT-NeoX")
    if config.resolved_attention_output_bias != config.attention_bias:
        reasons.append(f"model.attention_output_bias={config.attention_output_bias} with model.attention_bias="
                       f"{config.attention_bias} (GPT-NeoX's attention_bias is on query_key_value and dense alike)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    rope = rope_to_hf(config)
    rope["rope_parameters"]["partial_rotary_factor"] = float(config.rope_fraction)
    return {**hf_common_fields(config, NAME, MODEL_TYPE), **rope,
            "num_hidden_layers": config.num_blocks // 2, "num_attention_heads": config.num_attention_heads,
            "intermediate_size": config.resolved_ffn_hidden_size, "hidden_act": ACTIVATION_TO_HF[config.mlp_activation],
            # v4's names too: transformers before v5 reads these and not rope_parameters
            "rotary_pct": float(config.rope_fraction), "rotary_emb_base": float(config.rope_theta),
            "use_parallel_residual": config.parallel_residual, "attention_bias": config.attention_bias,
            "layer_norm_eps": config.norm_eps, "attention_dropout": config.attention_dropout,
            "hidden_dropout": config.hidden_dropout, "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def qkv_tensors(config: ModelConfig) -> list[tuple[list[str], str]]:
    """([meshlm q, k, v names], HF name) of each fused ``query_key_value`` weight and bias."""
    return fused_qkv_tensors(config, lambda layer: f"{PREFIX}layers.{layer}.attention.query_key_value")


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [rename("embedding.weight", f"{PREFIX}embed_in.weight"),
            *layer_norm_maps("final_norm", f"{PREFIX}final_layer_norm")]
    if not config.tie_embeddings:
        maps.append(rename("output.weight", HEAD_NAMES[0]))
    hidden, bias = config.hidden_size, config.attention_bias
    for (q, k, v), theirs in qkv_tensors(config):
        maps += fused_rows([(q, hidden), (k, hidden), (v, hidden)], theirs)  # then regrouped (regrouped_rows)
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"{PREFIX}layers.{layer}"
        maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.input_layernorm")
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.attention.dense", bias)
        maps += layer_norm_maps(f"{mlp}.norm", f"{theirs}.post_attention_layernorm")
        maps += linear_maps(f"{mlp}.mixer.up_proj", f"{theirs}.mlp.dense_h_to_4h", True)
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.dense_4h_to_h", True)
    return maps


def canonical_tensors(tensors: dict) -> dict:
    """HF tensors as the maps name them: the head under ``embed_out``, the buffers of older files
    (causal masks, RoPE frequencies) left out."""
    named = {}
    for name, tensor in tensors.items():
        if name.endswith(BUFFER_SUFFIXES):
            continue
        named[HEAD_NAMES[0] if name == HEAD_NAMES[1] else name] = tensor
    return named


def regrouped_rows(config: ModelConfig) -> list[RegroupedRows]:
    """Each ``query_key_value``: meshlm's q, k, v are its rows regrouped from head-by-head order."""
    heads, rows = config.num_attention_heads, config.hidden_size
    order = grouped_qkv_row_order(heads, heads, config.resolved_head_dim)
    return [RegroupedRows(tuple((name, rows) for name in names), theirs, order)
            for names, theirs in qkv_tensors(config)]


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors=canonical_tensors, regrouped_rows=regrouped_rows)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
