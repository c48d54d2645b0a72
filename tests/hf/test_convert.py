import json

import pytest
import torch

from meshlm.checkpoint.model_files import save_model
from meshlm.errors import ConfigError
from meshlm.hf import choose_architecture, hf_to_meshlm, meshlm_to_hf
from meshlm.hf.convert import architecture_of
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel

BASE = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, mamba_head_dim=8, moe_num_experts=4, moe_top_k=2,
            moe_ffn_hidden_size=16)


@pytest.mark.parametrize("fields, expected", [
    ({"pattern": "*-*-"}, "LlamaForCausalLM"),
    ({"pattern": "*E*-", "qk_norm": True}, "Qwen3MoeForCausalLM"),
    ({"pattern": "*E*E", "moe_normalize_topk": True}, "MixtralForCausalLM"),
    ({"pattern": "MMMM"}, "Mamba2ForCausalLM"),
    ({"pattern": "M*-E", "position_embedding": "none", "mlp_activation": "squared_relu",
      "moe_score_function": "sigmoid", "moe_shared_expert_ffn_hidden_size": 16}, "NemotronHForCausalLM"),
    ({"pattern": "*-*-", "position_embedding": "none", "mlp_activation": "relu"}, "NemotronHForCausalLM"),
])
def test_architecture_is_chosen_by_shape(fields, expected):
    assert choose_architecture(ModelConfig(**BASE, **fields)).name == expected


def test_no_fitting_architecture_lists_every_blocking_field():
    config = ModelConfig(**BASE, pattern="M*-", norm="layernorm")
    with pytest.raises(ConfigError) as error:
        choose_architecture(config)
    message = str(error.value)
    for name in ("LlamaForCausalLM", "Mamba2ForCausalLM", "NemotronHForCausalLM"):
        assert name in message
    assert "model.norm='layernorm'" in message and "model.position_embedding='rope'" in message


def test_original_architecture_is_preferred_when_it_still_fits():
    dense = ModelConfig(**BASE, pattern="*-", qk_norm=True)
    assert choose_architecture(dense).name == "Qwen3ForCausalLM"
    assert choose_architecture(dense, original="LlamaForCausalLM").name == "Qwen3ForCausalLM"  # Llama lacks QK-norm
    assert choose_architecture(dense, original="Qwen3MoeForCausalLM").name == "Qwen3MoeForCausalLM"
    all_mamba = ModelConfig(**BASE, pattern="MM")
    assert choose_architecture(all_mamba, original="NemotronHForCausalLM").name == "NemotronHForCausalLM"
    with pytest.raises(ConfigError, match="--architecture 'GPT2' is not one of"):
        choose_architecture(all_mamba, requested="GPT2")


def test_architecture_falls_back_to_model_type():
    assert architecture_of({"model_type": "mamba2"}).name == "Mamba2ForCausalLM"


def test_token_ids_travel_through_meshlm_and_back(tmp_path):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(**BASE, pattern="*-"))
    save_model(model, tmp_path / "ours", extra_config={"hf": {"architecture": "LlamaForCausalLM", "bos_token_id": 7,
                                                              "eos_token_id": [8, 9], "max_position_embeddings": 77}})
    meshlm_to_hf(tmp_path / "ours", tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    kept = (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["max_position_embeddings"])
    assert kept == (7, [8, 9], 77)
    assert hf_config["dtype"] == "float32"
    hf_to_meshlm(tmp_path / "hf", tmp_path / "again")
    extra = json.loads((tmp_path / "again" / "config.json").read_text())["hf"]
    assert extra == {"architecture": "LlamaForCausalLM", "bos_token_id": 7, "eos_token_id": [8, 9],
                     "max_position_embeddings": 77}


def test_a_model_trained_in_meshlm_exports_its_tokenizers_special_ids(tmp_path):
    """No "hf" section (a model trained here): config.json takes bos/eos/pad from the tokenizer saved
    with the model, so transformers' generate stops at its end token."""
    from meshlm.data.tokenizer import load_tokenizer
    from meshlm.data.tokenizer_training import train_tokenizer

    corpus = tmp_path / "text.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    torch.manual_seed(0)
    save_model(LanguageModel(ModelConfig(**{**BASE, "vocab_size": 300}, pattern="*-")), tmp_path / "ours")
    train_tokenizer([corpus], 300, tmp_path / "ours" / "tokenizer.json")
    tokenizer = load_tokenizer(tmp_path / "ours")
    meshlm_to_hf(tmp_path / "ours", tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_config["bos_token_id"], hf_config["eos_token_id"], hf_config["pad_token_id"]) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert None not in (hf_config["bos_token_id"], hf_config["eos_token_id"])
