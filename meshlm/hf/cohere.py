"""``CohereForCausalLM`` <-> meshlm (Cohere's Command R and Command R+, Aya 23 and Aya Expanse).

A Command R layer runs attention and a SwiGLU MLP side by side through one norm,
``h + attn(ln(h)) + mlp(ln(h))`` (``model.parallel_residual`` with
``model.parallel_residual_shared_norm``), with:

- **LayerNorm without a bias** (``model.norm=layernorm``, ``model.norm_bias=false``), before each
  layer and at the end;
- **RoPE over interleaved pairs** (2j, 2j + 1) of each whole head, where meshlm rotates (j, j + d/2):
  import takes the rows of ``q_proj`` and ``k_proj`` in the order ``half_from_interleaved`` gives,
  the same on both, so no score changes, and export puts them back;
- grouped KV heads, biases on q/k/v/o or none (``attention_bias``), a tied head, and logits
  multiplied by ``logit_scale`` (0.0625): ``model.logit_divisor`` = 1 / logit_scale.

With ``use_qk_norm`` (Command R+) each head of q and k has a LayerNorm weight of its own, no bias,
before RoPE: ``model.qk_norm`` with ``qk_norm_type=layernorm`` and ``qk_norm_per_head``. Its
weights [heads, head_dim] take their channels in the order of the head's reordered rows.

``attention_dropout`` is ``model.attention_dropout``. Not supported: Cohere2's sliding layers
(another class).
"""

from __future__ import annotations

from meshlm.hf.common import (QK_LAYERNORM_FEATURES, Architecture, RegroupedRows, TensorMap,
                              deinterleaved_rotary_rows, fixed_fields_unsupported, half_from_interleaved, linear_maps,
                              qk_layernorm_unsupported, query_key_tensors, rename, rows_of, split_heads_unsupported,
                              window_unsupported, with_defaults)
from meshlm.hf.llama import dense_decoder_config, dense_decoder_to_hf, dense_decoder_unsupported
from meshlm.models.config import ModelConfig

NAME = "CohereForCausalLM"
MODEL_TYPE = "cohere"
DEFAULTS = {"vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528, "logit_scale": 0.0625,
            "num_hidden_layers": 40, "num_attention_heads": 64, "hidden_act": "silu", "max_position_embeddings": 8192,
            "initializer_range": 0.02, "layer_norm_eps": 1e-5, "tie_word_embeddings": True, "attention_bias": False,
            "attention_dropout": 0.0, "use_qk_norm": False}
FIXED_FIELDS = {"norm": "layernorm", "norm_bias": False, "parallel_residual": True,
                "parallel_residual_shared_norm": True, "mlp_bias": False}
"""What every Command R layer has."""
SUPPORTED_FEATURES = frozenset({"norm", "norm_bias", "parallel_residual", "parallel_residual_shared_norm",
                                "logit_divisor"}) | QK_LAYERNORM_FEATURES


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    scale, qk_norm = float(hf["logit_scale"]), bool(hf["use_qk_norm"])
    return dense_decoder_config({**hf, "rms_norm_eps": hf["layer_norm_eps"]}, hf_config, NAME, norm="layernorm",
                                norm_bias=False, parallel_residual=True, parallel_residual_shared_norm=True,
                                logit_divisor=1.0 / scale, qk_norm=qk_norm,
                                qk_norm_type="layernorm" if qk_norm else "rmsnorm", qk_norm_per_head=qk_norm)


def unsupported(config: ModelConfig) -> list[str]:
    reasons = dense_decoder_unsupported(config, "Command R", qk_norm=config.qk_norm, supported=SUPPORTED_FEATURES)
    reasons += qk_layernorm_unsupported(config, "Command R", per_head=True, bias=False)
    reasons += window_unsupported(config, "Command R", uniform_only=False)
    reasons += fixed_fields_unsupported(config, "Command R", FIXED_FIELDS)
    return reasons + split_heads_unsupported(config, "Command R")


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    values = dense_decoder_to_hf(config, NAME, MODEL_TYPE, DEFAULTS["max_position_embeddings"],
                                 layer_norm_eps=config.norm_eps, logit_scale=1.0 / config.logit_divisor,
                                 attention_bias=config.attention_bias, use_qk_norm=config.qk_norm)
    del values["rms_norm_eps"], values["head_dim"]
    return values


def qk_norm_weights(config: ModelConfig) -> list[tuple[str, str, int]]:
    """(meshlm name, HF name, heads) of every per-head QK-norm weight [heads, head_dim] (none without)."""
    if not config.qk_norm:
        return []
    return [(f"blocks.{2 * layer}.mixer.{norm}.weight", f"model.layers.{layer}.self_attn.{norm}.weight", heads)
            for layer in range(config.num_blocks // 2)
            for norm, heads in (("q_norm", config.num_attention_heads), ("k_norm", config.resolved_num_kv_heads))]


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [rename("embedding.weight", "model.embed_tokens.weight"), rename("final_norm.weight", "model.norm.weight")]
    if not config.tie_embeddings:
        maps.append(rename("output.weight", "lm_head.weight"))
    head_dim = config.resolved_head_dim
    # rows of their HF tensors, then reordered (regrouped_rows)
    maps += [rows_of(ours, theirs, 0, heads * head_dim) for ours, theirs, heads in query_key_tensors(config)]
    maps += [rows_of(ours, theirs, 0, heads) for ours, theirs, heads in qk_norm_weights(config)]
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"model.layers.{layer}"
        maps.append(rename(f"{attention}.norm.weight", f"{theirs}.input_layernorm.weight"))  # the MLP's too
        for projection in ("v_proj", "o_proj"):
            maps += linear_maps(f"{attention}.mixer.{projection}", f"{theirs}.self_attn.{projection}",
                                config.attention_bias)
        for projection in ("gate_proj", "up_proj", "down_proj"):
            maps += linear_maps(f"{mlp}.mixer.{projection}", f"{theirs}.mlp.{projection}", False)
    return maps


def regrouped_rows(config: ModelConfig) -> list[RegroupedRows]:
    """q_proj and k_proj (weights and biases) of every layer, each head's rows de-interleaved, and
    the channels of the per-head QK-norm weights in the same order."""
    head_dim = config.resolved_head_dim
    return ([RegroupedRows(((ours, heads * head_dim),), theirs, deinterleaved_rotary_rows(heads, head_dim, head_dim))
             for ours, theirs, heads in query_key_tensors(config)]
            + [RegroupedRows(((ours, head_dim),), theirs, half_from_interleaved(head_dim), dim=1)
               for ours, theirs, _ in qk_norm_weights(config)])


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            regrouped_rows=regrouped_rows)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
