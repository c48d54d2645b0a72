"""``GPTJForCausalLM`` <-> meshlm (Wang & Komatsuzaki 2021, "GPT-J-6B: A 6 Billion Parameter
Autoregressive Language Model"): GPT-J-6B and the models trained in its shape.

A GPT-J layer runs attention and the MLP side by side through one LayerNorm,
``h + attn(ln_1(h)) + mlp(ln_1(h))`` (``model.parallel_residual`` with
``model.parallel_residual_shared_norm``), with:

- **partial rotary** on the first ``rotary_dim`` channels of each head (64 of 256), base 10000
  (``model.rope_fraction`` = rotary_dim / head_dim), rotating *interleaved* pairs (2j, 2j + 1)
  where meshlm rotates (j, j + d/2): import takes the rotary rows of ``q_proj`` and ``k_proj`` in
  the order ``half_from_interleaved`` gives, which changes no score, and export puts them back;
- multi-head attention without biases, a non-gated MLP ``fc_in`` -> ``activation_function``
  (``gelu_new``, GELU's tanh approximation) -> ``fc_out`` with biases, and a bias on the output head
  (``lm_head``: ``model.output_bias``);
- LayerNorm with a bias (``layer_norm_epsilon``).

``attn_pdrop`` is ``model.attention_dropout``, ``resid_pdrop`` ``model.hidden_dropout`` (standing for
``embd_pdrop`` too). Training only. Older files hold each layer's causal mask (``attn.bias``,
``attn.masked_bias``): buffers, left out. Not supported, refused by name: ``rotary_dim`` null and a
tied head (its bias has no place there).
"""

from __future__ import annotations

from meshlm.errors import ConfigError
from meshlm.hf.common import (ACTIVATION_FROM_HF, ACTIVATION_TO_HF_GELU_NEW, Architecture, RegroupedRows, TensorMap,
                              decoder_layers_unsupported, deinterleaved_rotary_rows, hf_common_fields, layer_norm_maps,
                              linear_maps, multi_head_unsupported, non_gated_activation_unsupported, rename, require,
                              rows_of, window_unsupported, with_defaults)
from meshlm.models.config import ModelConfig

NAME = "GPTJForCausalLM"
MODEL_TYPE = "gptj"
DEFAULTS = {"vocab_size": 50400, "n_positions": 2048, "n_embd": 4096, "n_layer": 28, "n_head": 16, "rotary_dim": 64,
            "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "tie_word_embeddings": False}
ROPE_THETA = 10000.0
"""GPT-J's RoPE base, fixed in its code."""
FIXED_FIELDS = {"norm": "layernorm", "position_embedding": "rope", "qk_norm": False, "parallel_residual": True,
                "parallel_residual_shared_norm": True, "attention_bias": False, "mlp_bias": True,
                "output_bias": True, "rope_theta": ROPE_THETA, "rope_scaling": "none"}
"""What every GPT-J layer has."""
SUPPORTED_FEATURES = frozenset({"norm", "rope_fraction", "parallel_residual", "parallel_residual_shared_norm",
                                "output_bias"})
PREFIX = "transformer."
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "activation_function", tuple(ACTIVATION_FROM_HF), "meshlm's non-gated MLPs")
    require(hf, NAME, "tie_word_embeddings", False, "GPT-J's lm_head has a bias of its own, and meshlm's tied head "
            "has none (model.output_bias needs an untied head)")
    hidden, heads, rotary = hf["n_embd"], hf["n_head"], hf_config.get("rotary_dim", DEFAULTS["rotary_dim"])
    head_dim = hidden // heads
    fraction = None if rotary is None else rotary / head_dim
    if fraction is None or not 0 < rotary <= head_dim or int(head_dim * fraction) != rotary:
        raise ConfigError(f"{NAME} config.json: rotary_dim={rotary!r} is not supported; meshlm rotates a whole number "
                          f"of the {head_dim} channels of each head, at most all of them.")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hidden, pattern="*-" * hf["n_layer"], num_attention_heads=heads,
        position_embedding="rope", rope_theta=ROPE_THETA, rope_fraction=fraction, parallel_residual=True,
        parallel_residual_shared_norm=True, attention_dropout=float(hf["attn_pdrop"]),
        hidden_dropout=float(hf["resid_pdrop"]), mlp_activation=ACTIVATION_FROM_HF[hf["activation_function"]],
        ffn_hidden_size=hf["n_inner"] or 4 * hidden, mlp_bias=True, output_bias=True, norm="layernorm",
        norm_eps=hf["layer_norm_epsilon"], init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "GPT-J", SUPPORTED_FEATURES, FIXED_FIELDS)
    reasons += window_unsupported(config, "GPT-J", uniform_only=False)
    reasons += non_gated_activation_unsupported(config, "GPT-J", ACTIVATION_TO_HF_GELU_NEW)
    reasons += multi_head_unsupported(config, "GPT-J")
    if config.resolved_attention_output_bias:
        reasons.append("model.attention_output_bias=True (GPT-J's out_proj has no bias)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    common = hf_common_fields(config, NAME, MODEL_TYPE)
    del common["hidden_size"]  # GPTJConfig's name for it is n_embd
    width = config.resolved_ffn_hidden_size
    return {**common, "n_embd": config.hidden_size, "n_layer": config.num_blocks // 2,
            "n_head": config.num_attention_heads, "rotary_dim": config.rotary_dim,
            "n_inner": None if width == 4 * config.hidden_size else width,
            "activation_function": ACTIVATION_TO_HF_GELU_NEW[config.mlp_activation],
            "layer_norm_epsilon": config.norm_eps, "n_positions": DEFAULTS["n_positions"],
            "attn_pdrop": config.attention_dropout,
            "resid_pdrop": config.hidden_dropout, "embd_pdrop": config.hidden_dropout}


def rotary_projections(config: ModelConfig) -> list[tuple[str, str]]:
    """(meshlm name, HF name) of every weight whose rows ``regrouped_rows`` reorders."""
    return [(f"blocks.{2 * layer}.mixer.{projection}.weight", f"{PREFIX}h.{layer}.attn.{projection}.weight")
            for layer in range(config.num_blocks // 2) for projection in ("q_proj", "k_proj")]


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [rename("embedding.weight", f"{PREFIX}wte.weight"), *layer_norm_maps("final_norm", f"{PREFIX}ln_f"),
            *linear_maps("output", "lm_head", True)]
    # rows of their HF tensors, then reordered (regrouped_rows)
    maps += [rows_of(ours, theirs, 0, config.hidden_size) for ours, theirs in rotary_projections(config)]
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"{PREFIX}h.{layer}"
        maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.ln_1")  # the MLP block applies it too
        maps += linear_maps(f"{attention}.mixer.v_proj", f"{theirs}.attn.v_proj", False)
        maps += linear_maps(f"{attention}.mixer.o_proj", f"{theirs}.attn.out_proj", False)
        maps += linear_maps(f"{mlp}.mixer.up_proj", f"{theirs}.mlp.fc_in", True)
        maps += linear_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.fc_out", True)
    return maps


def canonical_tensors(tensors: dict) -> dict:
    """HF tensors without the causal-mask buffers older files hold."""
    return {name: tensor for name, tensor in tensors.items() if not name.endswith(BUFFER_SUFFIXES)}


def regrouped_rows(config: ModelConfig) -> list[RegroupedRows]:
    """q_proj and k_proj of every layer, the first rotary_dim rows of each head de-interleaved (module
    docstring), the others as they are."""
    order = deinterleaved_rotary_rows(config.num_attention_heads, config.resolved_head_dim, config.rotary_dim)
    return [RegroupedRows(((ours, config.hidden_size),), theirs, order) for ours, theirs in rotary_projections(config)]


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors=canonical_tensors, regrouped_rows=regrouped_rows)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
