"""``GPT2LMHeadModel`` <-> meshlm: learned absolute positions, LayerNorm with biases, biases on every
linear layer, GELU's tanh approximation, and the transposed, fused ``Conv1D`` weights (c_attn)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
from transformers import GPT2Config  # noqa: E402

from meshlm.errors import CheckpointError, ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gpt2, hf_to_meshlm  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, assert_same_logits,  # noqa: E402
                      convert_and_compare, random_ids, save_random_hf_model,
                      with_trained_norms_and_biases)


def tiny_gpt2(**overrides) -> GPT2Config:
    """Three layers of hidden 32 over 4 heads, a table of 40 positions for the 24 tokens compared."""
    values = dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=40, attn_pdrop=0.0,
                  resid_pdrop=0.0, embd_pdrop=0.0)
    values.update(overrides)
    return GPT2Config(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": False, "n_inner": 48, "activation_function": "gelu", "layer_norm_epsilon": 1e-6},
    {"scale_attn_weights": False, "activation_function": "relu", "attn_pdrop": 0.1, "resid_pdrop": 0.2},
], ids=["gpt2-like", "untied-narrow-exact-gelu", "unscaled-relu-dropout"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_gpt2(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.pattern, config.norm, config.position_embedding) == ("*-" * 3, "layernorm", "learned")
    assert config.max_position_embeddings == 40 and config.attention_bias and config.mlp_bias
    assert config.mlp_activation == {"gelu_new": "gelu_tanh"}.get(hf_config.activation_function,
                                                                  hf_config.activation_function)
    assert config.attention_scale == (None if hf_config.scale_attn_weights else 1.0)
    assert (config.attention_dropout, config.hidden_dropout) == (hf_config.attn_pdrop, hf_config.resid_pdrop)
    assert_hf_round_trip(tmp_path, ("n_layer", "n_head", "n_positions", "n_inner", "activation_function",
                                    "layer_norm_epsilon", "scale_attn_weights", "attn_pdrop", "resid_pdrop"))


def test_hub_files_without_the_prefix_and_with_mask_buffers_import(tmp_path):
    """The hub's gpt2 files name tensors ``h.0.attn.c_attn.weight`` (no ``transformer.``) and hold
    each layer's causal-mask buffer ``h.0.attn.bias``."""
    hf_model = save_random_hf_model(tiny_gpt2(), tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    hub = {name.removeprefix("transformer."): tensor for name, tensor in tensors.items()}
    for layer in range(3):
        hub[f"h.{layer}.attn.bias"] = torch.ones(1, 1, 40, 40).tril()
    save_file(hub, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    out, _, _ = hf_to_meshlm(tmp_path / "hf", tmp_path / "meshlm")
    from meshlm.checkpoint.model_files import load_model
    assert_same_logits(hf_model, load_model(out), random_ids())


def test_a_gpt2_shaped_meshlm_model_exports_as_gpt2_and_others_refuse_its_positions(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4,
                         position_embedding="learned", max_position_embeddings=32, norm="layernorm",
                         attention_bias=True, mlp_bias=True, mlp_activation="gelu_tanh", ffn_hidden_size=128,
                         tie_embeddings=True)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == gpt2.NAME
    assert_meshlm_round_trip(model, tmp_path, gpt2.NAME)
    with pytest.raises(ConfigError, match=r"model.position_embedding='learned' \(only GPT2LMHeadModel"):
        choose_architecture(config, requested="LlamaForCausalLM")
    grouped = ModelConfig(**{**config.to_dict(), "num_kv_heads": 2})
    with pytest.raises(ConfigError, match="num_kv_heads=2 .GPT-2 has one key/value head per query head"):
        choose_architecture(grouped, requested=gpt2.NAME)


@pytest.mark.parametrize("fields, message", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
    ({"activation_function": "silu"}, "activation_function='silu' is not supported"),
    ({"add_cross_attention": True}, "add_cross_attention=True is not supported"),
])
def test_what_meshlm_cannot_compute_is_refused_by_name(fields, message):
    with pytest.raises(ConfigError, match=message):
        gpt2.config_from_hf({"architectures": [gpt2.NAME], "n_embd": 32, "n_head": 4, "n_layer": 2, **fields})


def test_a_c_attn_of_the_wrong_width_is_named(tmp_path):
    save_random_hf_model(tiny_gpt2(), tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["transformer.h.1.attn.c_attn.weight"] = tensors["transformer.h.1.attn.c_attn.weight"][:, :64].contiguous()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"transformer.h.1.attn.c_attn.weight has shape \(32, 64\)"):
        hf_to_meshlm(tmp_path / "hf", tmp_path / "meshlm")
