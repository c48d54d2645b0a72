"""``GPTBigCodeForCausalLM`` <-> meshlm (Allal et al. 2023, "SantaCoder: don't reach for the stars!";
Li et al. 2023, "StarCoder: may the source be with you!"): SantaCoder, StarCoder and StarCoderBase,
and the code models fine-tuned from them (WizardCoder, OctoCoder).

A GPTBigCode layer is GPT-2's (``gpt2.py``) -- learned absolute positions (``wpe``: ``model.position_
embedding=learned``), LayerNorm with biases, biases on every linear layer, a non-gated MLP with
GELU's tanh approximation -- with two differences:

- **multi-query attention** (``multi_query``, StarCoder's): one key/value head for all query heads
  (``model.num_kv_heads=1``), its fused ``c_attn`` rows the queries (hidden), the key (head_dim) and
  the value (head_dim), in that order; without ``multi_query``, multi-head attention whose ``c_attn``
  rows are grouped per head, [q_h; k_h; v_h] (regrouped on import, back on export, as GPT-NeoX's);
- ordinary ``nn.Linear`` weights, [out, in], where GPT-2 stores ``Conv1D`` ones transposed.

The attention is scaled by 1/sqrt(head_dim), or not at all with ``scale_attn_weights`` false
(``model.attention_scale=1``). ``attn_pdrop`` is ``model.attention_dropout`` and ``resid_pdrop``
``model.hidden_dropout`` (standing for ``embd_pdrop`` too). Cross-attention is refused by name.
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, RegroupedRows, TensorMap, decoder_layers_unsupported, fused_qkv_tensors,
                              fused_rows, grouped_qkv_row_order, hf_common_fields, layer_norm_maps, linear_maps,
                              non_gated_activation_unsupported, rename, require, window_unsupported, with_defaults)
from meshlm.hf.gpt2 import ACTIVATIONS, canonical_tensors, gpt2_attention_unsupported
from meshlm.models.config import ModelConfig

NAME = "GPTBigCodeForCausalLM"
MODEL_TYPE = "gpt_bigcode"
DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
            "activation_function": "gelu_pytorch_tanh", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True, "multi_query": True,
            "add_cross_attention": False, "tie_word_embeddings": True}
ACTIVATIONS_TO_HF = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "relu": "relu"}
FIXED_FIELDS = {"norm": "layernorm", "position_embedding": "learned", "attention_bias": True, "mlp_bias": True,
                "qk_norm": False}
"""What every GPTBigCode layer has."""
SUPPORTED_FEATURES = frozenset({"norm", "position_embedding", "attention_scale"})
PREFIX = "transformer."


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "activation_function", tuple(ACTIVATIONS), "meshlm's non-gated MLPs")
    require(hf, NAME, "add_cross_attention", False, "meshlm models are decoder-only")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hidden, pattern="*-" * hf["n_layer"], num_attention_heads=heads,
        num_kv_heads=1 if hf["multi_query"] else None, position_embedding="learned",
        max_position_embeddings=hf["n_positions"], attention_bias=True,
        attention_scale=None if hf["scale_attn_weights"] else 1.0, attention_dropout=float(hf["attn_pdrop"]),
        hidden_dropout=float(hf["resid_pdrop"]), mlp_activation=ACTIVATIONS[hf["activation_function"]],
        ffn_hidden_size=hf["n_inner"] or 4 * hidden, mlp_bias=True, norm="layernorm",
        norm_eps=hf["layer_norm_epsilon"], tie_embeddings=bool(hf["tie_word_embeddings"]),
        init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "GPTBigCode", SUPPORTED_FEATURES, FIXED_FIELDS)
    reasons += window_unsupported(config, "GPTBigCode", uniform_only=False)
    reasons += non_gated_activation_unsupported(config, "GPTBigCode", ACTIVATIONS_TO_HF)
    if config.resolved_num_kv_heads not in (1, config.num_attention_heads):
        reasons.append(f"model.num_kv_heads={config.num_kv_heads} (GPTBigCode has one key/value head, multi_query, "
                       "or one per query head)")
    if config.resolved_head_dim * config.num_attention_heads != config.hidden_size:
        reasons.append(f"model.head_dim={config.head_dim} (GPTBigCode's heads split the hidden size)")
    return reasons + gpt2_attention_unsupported(config, "GPTBigCode")


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    common = hf_common_fields(config, NAME, MODEL_TYPE)
    del common["hidden_size"]  # GPTBigCodeConfig's name for it is n_embd
    width = config.resolved_ffn_hidden_size
    return {**common, "n_embd": config.hidden_size, "n_layer": config.num_blocks // 2,
            "n_head": config.num_attention_heads, "n_positions": config.max_position_embeddings,
            "n_inner": None if width == 4 * config.hidden_size else width,
            "multi_query": multi_query(config),
            "activation_function": ACTIVATIONS_TO_HF[config.mlp_activation], "layer_norm_epsilon": config.norm_eps,
            "scale_attn_weights": config.attention_scale is None, "attn_pdrop": config.attention_dropout,
            "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout}


def multi_query(config: ModelConfig) -> bool:
    """Whether the fused c_attn holds one key/value head after all the queries (else one per head, grouped)."""
    return config.resolved_num_kv_heads == 1 and config.num_attention_heads > 1


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [rename("embedding.weight", f"{PREFIX}wte.weight"), rename("position_embedding.weight", f"{PREFIX}wpe.weight"),
            *layer_norm_maps("final_norm", f"{PREFIX}ln_f")]
    if not config.tie_embeddings:
        maps.append(rename("output.weight", "lm_head.weight"))
    rows = (config.hidden_size, config.resolved_num_kv_heads * config.resolved_head_dim)
    for names, theirs in fused_qkv_tensors(config, lambda layer: f"{PREFIX}h.{layer}.attn.c_attn"):
        maps += fused_rows(list(zip(names, (rows[0], rows[1], rows[1]))), theirs)  # multi-head: then regrouped
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"{PREFIX}h.{layer}"
        maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.ln_1")
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.attn.c_proj", True)
        maps += layer_norm_maps(f"{mlp}.norm", f"{theirs}.ln_2")
        maps += linear_maps(f"{mlp}.mixer.up_proj", f"{theirs}.mlp.c_fc", True)
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.c_proj", True)
    return maps


def regrouped_rows(config: ModelConfig) -> list[RegroupedRows]:
    """Without multi_query, every layer's fused q/k/v (weight and bias), [q_h; k_h; v_h] per head."""
    if multi_query(config):
        return []
    heads, hidden = config.num_attention_heads, config.hidden_size
    order = grouped_qkv_row_order(heads, heads, config.resolved_head_dim)
    return [RegroupedRows(tuple((name, hidden) for name in names), theirs, order)
            for names, theirs in fused_qkv_tensors(config, lambda layer: f"{PREFIX}h.{layer}.attn.c_attn")]


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors=canonical_tensors, regrouped_rows=regrouped_rows)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
