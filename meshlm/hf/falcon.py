"""``FalconForCausalLM`` <-> meshlm (Almazrouei et al. 2023, "The Falcon Series of Open Language
Models"): Falcon-7B, 40B and 180B, Falcon 2 11B, and the models trained in their shape.

A Falcon layer is an attention block and an MLP block, meshlm's ``*-``, with RoPE over whole heads,
LayerNorm (with a bias) and a non-gated MLP (``dense_h_to_4h`` -> ``activation``, exact GELU ->
``dense_4h_to_h``), biases on every linear layer or none (``bias``), and three ways to lay them out:

- Falcon-7B (``parallel_attn``, one key/value head: ``multi_query``): attention and MLP side by
  side through one norm, ``h + attn(ln(h)) + mlp(ln(h))`` -- ``model.parallel_residual`` with
  ``model.parallel_residual_shared_norm``;
- Falcon-40B and 180B, Falcon 2 (``new_decoder_architecture``, grouped KV heads: ``num_kv_heads``):
  side by side with a norm each (``ln_attn``, ``ln_mlp``; ``num_ln_in_parallel_attn`` 2) --
  ``model.parallel_residual`` -- or one (``num_ln_in_parallel_attn`` 1);
- without ``parallel_attn`` (and without the new architecture): the usual sequential layer.

**Tensors.** q, k and v are one ``query_key_value`` whose rows follow the layout: the new
architecture groups them per key/value head (the query heads that share it, then its key, then its
value); ``multi_query`` puts every query head first, then the key and the value; multi-head
attention without either groups them per head, [q_i; k_i; v_i]. Import regroups the rows into
meshlm's q, k and v (``qkv_row_order``); export writes the layout the model needs, the new
architecture when its KV heads are grouped or its parallel layer has two norms.

``hidden_dropout`` is ``model.hidden_dropout``. Falcon's ``attention_dropout`` drops nothing in its
attention without ALiBi (only, in the sequential layer, the attention block's output), so it is not
carried over, and export writes 0. Not supported, refused by name: ``alibi`` (Falcon-RW's linear
position biases) and a sequential layer with grouped KV heads (which Falcon cannot write).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.hf.common import (ACTIVATION_FROM_HF, ACTIVATION_TO_HF, Architecture, RegroupedRows, TensorMap,
                              decoder_layers_unsupported, fused_qkv_tensors, fused_rows, grouped_qkv_row_order,
                              hf_common_fields, layer_norm_maps, linear_maps, non_gated_activation_unsupported, rename,
                              require, rope_from_hf, rope_to_hf, split_heads_unsupported, window_unsupported,
                              with_defaults)
from meshlm.models.config import ModelConfig

NAME = "FalconForCausalLM"
MODEL_TYPE = "falcon"
DEFAULTS = {"vocab_size": 65024, "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71,
            "num_ln_in_parallel_attn": None, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "hidden_dropout": 0.0, "num_kv_heads": None, "alibi": False, "new_decoder_architecture": False,
            "multi_query": True, "parallel_attn": True, "bias": False, "max_position_embeddings": 2048,
            "ffn_hidden_size": None, "activation": "gelu", "tie_word_embeddings": True}
FIXED_FIELDS = {"norm": "layernorm", "position_embedding": "rope", "qk_norm": False}
SUPPORTED_FEATURES = frozenset({"norm", "parallel_residual", "parallel_residual_shared_norm"})
PREFIX = "transformer."


@dataclass(frozen=True)
class Layout:
    """How a Falcon config.json lays its layers out (module docstring)."""

    new_decoder_architecture: bool
    multi_query: bool
    parallel_attn: bool
    norms_in_parallel: int
    """1 or 2: the norms of a parallel layer."""

    @staticmethod
    def from_hf(hf: dict) -> "Layout":
        new = bool(hf["new_decoder_architecture"])
        norms = hf["num_ln_in_parallel_attn"] or (2 if new else 1)
        # the new architecture is always parallel (transformers adds the attention output to the MLP's)
        return Layout(new, bool(hf["multi_query"]), new or bool(hf["parallel_attn"]), norms if new else 1)

    @staticmethod
    def for_model(config: ModelConfig) -> "Layout":
        kv_heads, heads = config.resolved_num_kv_heads, config.num_attention_heads
        new = (config.parallel_residual and not config.parallel_residual_shared_norm) or kv_heads not in (1, heads)
        norms = 1 if config.parallel_residual_shared_norm else 2
        # multi_query true with the new architecture too, which ignores it, as Falcon-40B's config.json has it
        return Layout(new, new or kv_heads == 1, config.parallel_residual, norms if new else 1)

    def kv_heads(self, hf: dict) -> int:
        heads = hf["num_attention_heads"]
        if self.new_decoder_architecture:
            return hf["num_kv_heads"] or heads
        return 1 if self.multi_query else heads


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "alibi", False, "meshlm's attention positions are RoPE (or learned tables), not ALiBi biases")
    require(hf, NAME, "activation", tuple(ACTIVATION_FROM_HF), "meshlm's non-gated MLPs")
    layout, heads, hidden = Layout.from_hf(hf), hf["num_attention_heads"], hf["hidden_size"]
    kv_heads, bias = layout.kv_heads(hf), bool(hf["bias"])
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hidden, pattern="*-" * hf["num_hidden_layers"],
        num_attention_heads=heads, num_kv_heads=None if kv_heads == heads else kv_heads, attention_bias=bias,
        position_embedding="rope", **rope_from_hf(hf_config, 10000.0, NAME),
        parallel_residual=layout.parallel_attn,
        parallel_residual_shared_norm=layout.parallel_attn and layout.norms_in_parallel == 1,
        hidden_dropout=float(hf["hidden_dropout"]), mlp_activation=ACTIVATION_FROM_HF[hf["activation"]],
        ffn_hidden_size=hf["ffn_hidden_size"] or 4 * hidden, mlp_bias=bias, norm="layernorm",
        norm_eps=hf["layer_norm_epsilon"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "Falcon", SUPPORTED_FEATURES, FIXED_FIELDS)
    reasons += window_unsupported(config, "Falcon", uniform_only=False)
    reasons += non_gated_activation_unsupported(config, "Falcon", ACTIVATION_TO_HF)
    reasons += split_heads_unsupported(config, "Falcon")
    if not config.attention_bias == config.resolved_attention_output_bias == config.mlp_bias:
        reasons.append(f"model.attention_bias={config.attention_bias}, model.attention_output_bias="
                       f"{config.attention_output_bias}, model.mlp_bias={config.mlp_bias} (Falcon's bias puts "
                       "biases on every linear layer or none)")
    if not config.parallel_residual and config.resolved_num_kv_heads not in (1, config.num_attention_heads):
        reasons.append(f"model.num_kv_heads={config.num_kv_heads} with model.parallel_residual=false (Falcon groups "
                       "KV heads only in its new decoder architecture, whose layers are parallel)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    layout = Layout.for_model(config)
    common = hf_common_fields(config, NAME, MODEL_TYPE)
    return {**common, **rope_to_hf(config), "num_hidden_layers": config.num_blocks // 2,
            "num_attention_heads": config.num_attention_heads, "num_kv_heads": config.resolved_num_kv_heads,
            "new_decoder_architecture": layout.new_decoder_architecture, "multi_query": layout.multi_query,
            "parallel_attn": layout.parallel_attn,
            "num_ln_in_parallel_attn": layout.norms_in_parallel if layout.new_decoder_architecture else None,
            "alibi": False, "bias": config.attention_bias, "ffn_hidden_size": config.resolved_ffn_hidden_size,
            "activation": ACTIVATION_TO_HF[config.mlp_activation], "layer_norm_epsilon": config.norm_eps,
            "hidden_dropout": config.hidden_dropout, "attention_dropout": 0.0,
            "max_position_embeddings": DEFAULTS["max_position_embeddings"]}


def qkv_row_order(config: ModelConfig) -> torch.Tensor:
    """Row r of meshlm's [q; k; v] is row ``order[r]`` of Falcon's ``query_key_value``: one layout,
    grouped per KV head, covers all three (``common.grouped_qkv_row_order``), since multi_query means
    one KV head and the old layout without it one KV head per query head."""
    return grouped_qkv_row_order(config.num_attention_heads, config.resolved_num_kv_heads, config.resolved_head_dim)


def qkv_tensors(config: ModelConfig) -> list[tuple[list[str], str]]:
    """([meshlm q, k, v names], HF name) of each fused ``query_key_value`` weight (and bias)."""
    return fused_qkv_tensors(config, lambda layer: f"{PREFIX}h.{layer}.self_attention.query_key_value")


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [rename("embedding.weight", f"{PREFIX}word_embeddings.weight"),
            *layer_norm_maps("final_norm", f"{PREFIX}ln_f")]
    if not config.tie_embeddings:
        maps.append(rename("output.weight", "lm_head.weight"))
    query, key_value = config.hidden_size, config.resolved_num_kv_heads * config.resolved_head_dim
    for (q, k, v), theirs in qkv_tensors(config):
        maps += fused_rows([(q, query), (k, key_value), (v, key_value)], theirs)  # then regrouped (regrouped_rows)
    layout, bias = Layout.for_model(config), config.attention_bias
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"{PREFIX}h.{layer}"
        if layout.parallel_attn and layout.norms_in_parallel == 2:
            maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.ln_attn")
            maps += layer_norm_maps(f"{mlp}.norm", f"{theirs}.ln_mlp")
        else:
            maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.input_layernorm")
            if not layout.parallel_attn:
                maps += layer_norm_maps(f"{mlp}.norm", f"{theirs}.post_attention_layernorm")
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.self_attention.dense", bias)
        maps += linear_maps(f"{mlp}.mixer.up_proj", f"{theirs}.mlp.dense_h_to_4h", bias)
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.dense_4h_to_h", bias)
    return maps


def regrouped_rows(config: ModelConfig) -> list[RegroupedRows]:
    """Each ``query_key_value``: meshlm's q, k, v are its rows regrouped from the layout's order."""
    order = qkv_row_order(config)
    rows = (config.hidden_size, *2 * [config.resolved_num_kv_heads * config.resolved_head_dim])
    return [RegroupedRows(tuple(zip(names, rows)), theirs, order) for names, theirs in qkv_tensors(config)]


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            regrouped_rows=regrouped_rows)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
