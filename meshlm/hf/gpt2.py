"""``GPT2LMHeadModel`` <-> meshlm (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners"): GPT-2 and the models trained in its shape (nanoGPT, llm.c, the GPT-2 speedruns).

A GPT-2 layer is a pre-norm attention block and a pre-norm MLP block, like meshlm's ``*-``, with
what came before RoPE and RMSNorm:

- **learned absolute positions** (``model.position_embedding=learned``): ``wpe``, a table of
  ``n_positions`` vectors (1024) added to the token embeddings (``model.max_position_embeddings``);
- **LayerNorm** with a bias (``model.norm=layernorm``), eps ``layer_norm_epsilon``;
- **biases on every linear layer** (``model.attention_bias``, ``model.mlp_bias``) and a
  non-gated MLP of width ``n_inner`` (4 x hidden) with ``gelu_new``, GELU's tanh approximation
  (``model.mlp_activation=gelu_tanh``);
- multi-head attention (no grouped KV heads) scaled by 1/sqrt(head_dim), or unscaled with
  ``scale_attn_weights=false`` (``model.attention_scale=1``); the head is tied to the token
  embedding unless ``tie_word_embeddings`` is false.

**Tensors.** GPT-2's linear layers are ``Conv1D`` modules whose weights are stored transposed,
[in, out]; q, k and v are one ``c_attn`` of 3 x hidden columns. Import cuts the columns apart and
transposes them (``common.transposed``), export joins and transposes them back. Hub files name
the tensors without the ``transformer.`` prefix of ``GPT2LMHeadModel``'s own state dict, and may
hold each layer's causal-mask buffer (``attn.bias``, ``attn.masked_bias``): import takes both
namings and leaves the buffers out.

**Dropout.** ``attn_pdrop`` becomes ``model.attention_dropout`` and ``resid_pdrop``
``model.hidden_dropout`` (meshlm's hidden dropout covers the embeddings and each block's output,
where GPT-2 uses ``embd_pdrop`` and ``resid_pdrop``: its value stands for both). They act in
training only; set them to 0 to fine-tune without.

Not supported, refused by name: ``scale_attn_by_inverse_layer_idx`` and cross-attention.
"""

from __future__ import annotations

from meshlm.hf.common import (Architecture, TensorMap, decoder_layers_unsupported, hf_common_fields, layer_norm_maps,
                              multi_head_unsupported, non_gated_activation_unsupported, rename, require, rows_of,
                              transposed, window_unsupported, with_defaults)
from meshlm.models.config import ModelConfig

NAME = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"
DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
            "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "tie_word_embeddings": True, "add_cross_attention": False}
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
"""GPT-2's ``activation_function`` values meshlm computes (``gelu_new`` is GELU's tanh approximation)."""
ACTIVATIONS_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
FIXED_FIELDS = {"norm": "layernorm", "position_embedding": "learned", "attention_bias": True, "mlp_bias": True,
                "qk_norm": False}
"""What every GPT-2 layer has."""
SUPPORTED_FEATURES = frozenset({"norm", "position_embedding", "attention_scale"})
HF_PREFIX = "transformer."
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
"""Suffixes of the per-layer causal-mask buffers older GPT-2 files hold: not weights."""


def config_from_hf(hf_config: dict) -> ModelConfig:
    hf = with_defaults(hf_config, DEFAULTS)
    require(hf, NAME, "activation_function", tuple(ACTIVATIONS), "meshlm's non-gated MLPs")
    require(hf, NAME, "scale_attn_by_inverse_layer_idx", False, "meshlm scales every layer's attention alike")
    require(hf, NAME, "add_cross_attention", False, "meshlm models are decoder-only")
    hidden, heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hidden, pattern="*-" * hf["n_layer"], num_attention_heads=heads,
        position_embedding="learned", max_position_embeddings=hf["n_positions"],
        attention_bias=True, attention_scale=None if hf["scale_attn_weights"] else 1.0,
        attention_dropout=float(hf["attn_pdrop"]), hidden_dropout=float(hf["resid_pdrop"]),
        mlp_activation=ACTIVATIONS[hf["activation_function"]], ffn_hidden_size=hf["n_inner"] or 4 * hidden,
        mlp_bias=True, norm="layernorm", norm_eps=hf["layer_norm_epsilon"],
        tie_embeddings=bool(hf["tie_word_embeddings"]), init_std=hf["initializer_range"])


def unsupported(config: ModelConfig) -> list[str]:
    reasons = decoder_layers_unsupported(config, "GPT-2", SUPPORTED_FEATURES, FIXED_FIELDS)
    reasons += window_unsupported(config, "GPT-2", uniform_only=False)
    reasons += non_gated_activation_unsupported(config, "GPT-2", ACTIVATIONS_TO_HF)
    reasons += multi_head_unsupported(config, "GPT-2")
    return reasons + gpt2_attention_unsupported(config, "GPT-2")


def gpt2_attention_unsupported(config: ModelConfig, label: str) -> list[str]:
    """Why ``config``'s attention is not GPT-2's (class ``label``, GPT-2's or GPTBigCode's): a biased
    output projection, scaled by 1/sqrt(head_dim) or, with ``scale_attn_weights`` false, not at all."""
    reasons = []
    if not config.resolved_attention_output_bias:
        reasons.append(f"model.attention_output_bias=False ({label}'s c_proj has a bias)")
    if config.attention_scale not in (None, 1.0):
        reasons.append(f"model.attention_scale={config.attention_scale} ({label} scales by 1/sqrt(head_dim) or, "
                       "with scale_attn_weights=false, not at all)")
    return reasons


def config_to_hf(config: ModelConfig) -> dict:
    ARCHITECTURE.check_expressible(config)
    common = hf_common_fields(config, NAME, MODEL_TYPE)
    del common["hidden_size"]  # GPT2Config's name for it is n_embd (hidden_size is an alias when read)
    return {**common, "n_embd": config.hidden_size, "n_layer": config.num_blocks // 2, "n_head": config.num_attention_heads,
            "n_positions": config.max_position_embeddings,
            "n_inner": None if config.resolved_ffn_hidden_size == 4 * config.hidden_size else config.resolved_ffn_hidden_size,
            "activation_function": ACTIVATIONS_TO_HF[config.mlp_activation],
            "layer_norm_epsilon": config.norm_eps, "scale_attn_weights": config.attention_scale is None,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "attn_pdrop": config.attention_dropout, "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout}


def conv1d_maps(ours: str, theirs: str) -> list[TensorMap]:
    """A meshlm nn.Linear from one whole GPT-2 Conv1D (weight stored [in, out])."""
    return [transposed(f"{ours}.weight", f"{theirs}.weight"), rename(f"{ours}.bias", f"{theirs}.bias")]


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    hidden, prefix = config.hidden_size, HF_PREFIX
    maps = [rename("embedding.weight", f"{prefix}wte.weight"), rename("position_embedding.weight", f"{prefix}wpe.weight"),
            *layer_norm_maps("final_norm", f"{prefix}ln_f")]
    if not config.tie_embeddings:
        maps.append(rename("output.weight", "lm_head.weight"))
    for layer in range(config.num_blocks // 2):
        attention, mlp, theirs = f"blocks.{2 * layer}", f"blocks.{2 * layer + 1}", f"{prefix}h.{layer}"
        maps += layer_norm_maps(f"{attention}.norm", f"{theirs}.ln_1")
        for index, projection in enumerate(("q_proj", "k_proj", "v_proj")):  # columns of one c_attn
            columns = (index * hidden, (index + 1) * hidden)
            maps += [transposed(f"{attention}.mixer.{projection}.weight", f"{theirs}.attn.c_attn.weight", columns),
                     rows_of(f"{attention}.mixer.{projection}.bias", f"{theirs}.attn.c_attn.bias", *columns)]
        maps += conv1d_maps(f"{attention}.mixer.o_proj", f"{theirs}.attn.c_proj")
        maps += layer_norm_maps(f"{mlp}.norm", f"{theirs}.ln_2")
        maps += conv1d_maps(f"{mlp}.mixer.up_proj", f"{theirs}.mlp.c_fc")
        maps += conv1d_maps(f"{mlp}.mixer.down_proj", f"{theirs}.mlp.c_proj")
    return maps


def canonical_tensors(tensors: dict) -> dict:
    """HF tensors under ``GPT2LMHeadModel``'s own names: the ``transformer.`` prefix hub files leave
    out added, the causal-mask buffers left out."""
    named = {}
    for name, tensor in tensors.items():
        if name.endswith(MASK_BUFFERS):
            continue
        named[name if name.startswith((HF_PREFIX, "lm_head.")) else HF_PREFIX + name] = tensor
    return named


ARCHITECTURE = Architecture(NAME, MODEL_TYPE, config_from_hf, config_to_hf, tensor_maps, unsupported,
                            normalize_hf_tensors=canonical_tensors)
state_from_hf = ARCHITECTURE.state_from_hf
state_to_hf = ARCHITECTURE.state_to_hf
