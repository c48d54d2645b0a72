"""``GPTNeoXForCausalLM`` (GPT-NeoX-20B, Pythia) <-> meshlm: attention and MLP side by side (a
parallel residual) or in sequence, RoPE on part of each head, LayerNorm, biases, q/k/v rows grouped
per head in one ``query_key_value``, an untied ``embed_out`` head."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPTNeoXConfig  # noqa: E402

from meshlm.errors import CheckpointError, ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, gpt_neox, llama, starcoder2  # noqa: E402
from meshlm.hf.files import open_hf_tensors  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      save_random_hf_model, with_trained_norms_and_biases)


def tiny_neox(**overrides) -> GPTNeoXConfig:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, bos_token_id=0, eos_token_id=2)
    values.update(overrides)
    return GPTNeoXConfig(**values)


@pytest.mark.parametrize("overrides", [
    {},
    {"use_parallel_residual": False, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                         "partial_rotary_factor": 0.5},
     "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    {"attention_bias": False, "tie_word_embeddings": True, "attention_dropout": 0.1, "hidden_dropout": 0.1,
     "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
], ids=["pythia-like", "sequential-half-rotary", "no-attention-bias-tied-linear-rope"])
def test_logits_match_transformers_and_round_trip(overrides, tmp_path):
    hf_config = tiny_neox(**overrides)
    model = convert_and_compare(hf_config, tmp_path)
    config = model.config
    assert (config.pattern, config.norm, config.mlp_bias) == ("*-" * 3, "layernorm", True)
    assert config.parallel_residual == hf_config.use_parallel_residual
    assert config.rope_fraction == hf_config.rope_parameters["partial_rotary_factor"]
    assert config.attention_bias == hf_config.attention_bias
    assert (config.attention_dropout, config.hidden_dropout) == (hf_config.attention_dropout, hf_config.hidden_dropout)
    assert_hf_round_trip(tmp_path, ("num_hidden_layers", "intermediate_size", "hidden_act", "layer_norm_eps",
                                    "use_parallel_residual", "attention_bias", "tie_word_embeddings"))
    exported = json.loads((tmp_path / "hf_again" / "config.json").read_text())
    assert exported["rope_parameters"]["partial_rotary_factor"] == exported["rotary_pct"] == config.rope_fraction
    with open_hf_tensors(tmp_path / "hf_again") as files:  # the hub's name for the head, read by every version
        assert ("embed_out.weight" in files.tensors) != config.tie_embeddings and "lm_head.weight" not in files.tensors


def test_pythia_files_with_v4_names_and_buffers_import(tmp_path):
    """A config.json in transformers v4's words (rotary_pct, rotary_emb_base, no rope_parameters) and
    the buffers Pythia's files hold (causal masks, RoPE frequencies) next to the weights."""
    save_random_hf_model(tiny_neox(rope_parameters={"rope_type": "default", "rope_theta": 2000.0,
                                                    "partial_rotary_factor": 0.25}), tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json"
    hf_config = json.loads(config_path.read_text())
    del hf_config["rope_parameters"]
    hf_config.update(rotary_pct=0.25, rotary_emb_base=2000)
    config_path.write_text(json.dumps(hf_config))
    with open_hf_tensors(tmp_path / "hf") as files:
        state = {name: handle.load() for name, handle in files.tensors.items()}
    assert gpt_neox.config_from_hf(hf_config).rope_theta == 2000.0
    buffers = {"gpt_neox.layers.0.attention.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool),
               "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9),
               "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.ones(1)}
    config = gpt_neox.config_from_hf(hf_config)
    imported = gpt_neox.state_from_hf({**state, **buffers}, config)
    assert imported.keys() == LanguageModel(config).state_dict().keys()
    # a per-head regrouping a transposition away from the identity: q of head 1 is rows 24..31 of the fused tensor
    fused = state["gpt_neox.layers.0.attention.query_key_value.weight"]
    assert torch.equal(imported["blocks.0.mixer.q_proj.weight"][8:16], fused[24:32])
    assert torch.equal(imported["blocks.0.mixer.v_proj.weight"][:8], fused[16:24])
    name = "gpt_neox.layers.1.attention.query_key_value.weight"
    with pytest.raises(CheckpointError, match="query_key_value.weight has 88 rows, but config.json implies at least"):
        gpt_neox.state_from_hf({**state, name: fused[:-8]}, config)
    with pytest.raises(CheckpointError, match="query_key_value.weight has 104 rows, but config.json implies 96"):
        gpt_neox.state_from_hf({**state, name: torch.cat((fused, fused[:8]))}, config)


def test_a_parallel_residual_model_exports_as_gpt_neox_and_back(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, norm="layernorm",
                         attention_bias=True, mlp_bias=True, mlp_activation="gelu", ffn_hidden_size=64,
                         rope_fraction=0.25, parallel_residual=True)
    model = with_trained_norms_and_biases(LanguageModel(config))
    assert choose_architecture(config).name == gpt_neox.NAME
    assert_meshlm_round_trip(model, tmp_path, gpt_neox.NAME)
    for other in (llama.NAME, starcoder2.NAME):
        with pytest.raises(ConfigError, match="model.parallel_residual=True .only GPTNeoXForCausalLM"):
            choose_architecture(config, requested=other)


def test_what_gpt_neox_cannot_hold_is_refused_by_name():
    grouped = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-", num_attention_heads=4, num_kv_heads=2,
                          norm="layernorm", mlp_bias=True, parallel_residual=True)
    with pytest.raises(ConfigError, match="num_kv_heads=2 .GPT-NeoX has one key/value head per query head"):
        choose_architecture(grouped)
    shared = ModelConfig(**{**grouped.to_dict(), "num_kv_heads": None, "parallel_residual_shared_norm": True})
    with pytest.raises(ConfigError, match="parallel_residual_shared_norm=True .only StableLmForCausalLM"):
        choose_architecture(shared, requested=gpt_neox.NAME)
    with pytest.raises(ConfigError, match="hidden_act='gelu_fast' is not supported"):
        gpt_neox.config_from_hf({"architectures": [gpt_neox.NAME], "hidden_size": 32, "num_attention_heads": 4,
                                 "num_hidden_layers": 2, "hidden_act": "gelu_fast"})
