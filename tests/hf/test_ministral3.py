"""``Ministral3ForCausalLM`` <-> meshlm: Mistral's layer with YaRN and Llama 4's query scale by
position, 1 + beta ln(1 + floor(p / L)), here with L = 4 so the 24 positions compared reach 5 steps."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Ministral3Config  # noqa: E402

from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import choose_architecture, ministral3  # noqa: E402
from meshlm.models.config import ModelConfig  # noqa: E402
from meshlm.models.language_model import LanguageModel  # noqa: E402

from .helpers import (VOCAB, assert_hf_round_trip, assert_meshlm_round_trip, convert_and_compare,  # noqa: E402
                      random_ids)

ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.8}


def tiny_ministral3(**overrides) -> Ministral3Config:
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_parameters=dict(ROPE),
                  max_position_embeddings=64)
    values.update(overrides)
    return Ministral3Config(**values)


def test_logits_match_transformers_and_round_trip(tmp_path):
    model = convert_and_compare(tiny_ministral3(), tmp_path)
    config = model.config
    assert (config.query_scale_beta, config.query_scale_length) == (0.8, 4)
    assert (config.rope_scaling, config.rope_original_max_positions) == ("yarn", 4)
    unscaled = LanguageModel(ModelConfig(**{**config.to_dict(), "query_scale_beta": 0.0})).eval()
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():  # the scale is not vacuous
        assert (unscaled(random_ids()).logits - model(random_ids()).logits).abs().max() > 1e-3
    assert_hf_round_trip(tmp_path, ("num_key_value_heads", "head_dim", "intermediate_size"))
    written = json.loads((tmp_path / "hf_again" / "config.json").read_text())["rope_parameters"]
    # (mscale / mscale_all_dim come back as the YaRN attention factor they make, 1.0)
    assert {key: written[key] for key in ("rope_type", "factor", "original_max_position_embeddings",
                                          "llama_4_scaling_beta", "rope_theta")} == {
        key: ROPE[key] for key in ("rope_type", "factor", "original_max_position_embeddings", "llama_4_scaling_beta",
                                   "rope_theta")}


def test_a_sliding_window_matches_transformers(tmp_path):
    model = convert_and_compare(tiny_ministral3(sliding_window=6), tmp_path)
    assert model.config.sliding_window == 6
    assert_hf_round_trip(tmp_path, ("sliding_window",))


def test_meshlm_query_scale_exports_as_ministral3_and_only_there(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, pattern="*-*-", num_attention_heads=4, num_kv_heads=2,
                         ffn_hidden_size=48, query_scale_beta=0.3, query_scale_length=6)
    assert choose_architecture(config).name == "Ministral3ForCausalLM"
    assert_meshlm_round_trip(LanguageModel(config), tmp_path, "Ministral3ForCausalLM")
    with pytest.raises(ConfigError, match="query_scale_beta=0.3 \\(only Ministral3ForCausalLM"):
        choose_architecture(config, requested="LlamaForCausalLM")
    yarn = ModelConfig(**{**config.to_dict(), "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                          "rope_original_max_positions": 8})
    with pytest.raises(ConfigError, match="make them equal"):
        ministral3.config_to_hf(yarn)


def test_the_language_model_of_a_mistral3_vision_folder_imports_and_exports_as_text(tmp_path):
    """A Mistral3ForConditionalGeneration folder (a tiny Pixtral tower beside a Ministral 3 language
    model): meshlm takes the language model, whose text logits equal transformers' on the whole
    model, and writes it back as Ministral3ForCausalLM."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    from meshlm.checkpoint.model_files import load_model
    from meshlm.hf import hf_to_meshlm, meshlm_to_hf

    from .helpers import assert_same_logits, load_hf

    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=28, patch_size=14, head_dim=8)
    multimodal = Mistral3Config(text_config=tiny_ministral3().to_dict(), vision_config=vision.to_dict(),
                                image_token_index=VOCAB - 1, spatial_merge_size=1)
    torch.manual_seed(0)
    whole = Mistral3ForConditionalGeneration(multimodal).eval()  # (no AutoModelForCausalLM for this class)
    with torch.no_grad():
        for tensor in whole.state_dict().values():
            tensor.add_(0.05 * torch.randn_like(tensor))
    whole.save_pretrained(tmp_path / "hf")
    model = load_model(hf_to_meshlm(tmp_path / "hf", tmp_path / "meshlm")[0])
    assert_same_logits(whole, model, random_ids())
    assert model.config.query_scale_beta == 0.8
    _, chosen = meshlm_to_hf(tmp_path / "meshlm", tmp_path / "text")
    assert chosen.name == "Ministral3ForCausalLM"
    text_only = load_hf(tmp_path / "text")
    ids = torch.randint(0, VOCAB - 1, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(text_only(ids).logits, model.eval()(ids).logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="text_config has model_type 'qwen3'"):
        from meshlm.hf import mistral3
        mistral3.config_from_hf({"text_config": {"model_type": "qwen3"}})
