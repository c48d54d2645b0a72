"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL folders (meshlm/hf/qwen_vl.py): meshlm takes the language model,
whose logits on text equal transformers' whole vision-language model's (M-RoPE on text is plain
RoPE), reads the released layout with its fields at the top of config.json, and writes the model
back as the text class."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from meshlm.checkpoint.model_files import load_model  # noqa: E402
from meshlm.errors import ConfigError  # noqa: E402
from meshlm.hf import hf_to_meshlm, meshlm_to_hf, qwen_vl  # noqa: E402

from .helpers import VOCAB, assert_same_logits, load_hf  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
VISION = dict(depth=1, hidden_size=16, out_hidden_size=32, num_heads=2, intermediate_size=32)


def whole_model(kind: str):
    """A random transformers vision-language model of ``kind``, every tensor perturbed."""
    import transformers

    if kind == "qwen3_vl":
        config = transformers.Qwen3VLConfig(
            text_config={**TEXT, "head_dim": 8, "rope_parameters": {
                "rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
            vision_config={**VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
            image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)
        model = transformers.Qwen3VLForConditionalGeneration(config)
    else:
        config_class, model_class = {
            "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
            "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration)}[kind]
        vision = VISION if kind == "qwen2_5_vl" else dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2)
        config = config_class(text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0,
                                                                       "mrope_section": [2, 1, 1]}},
                              vision_config=vision, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
                              vision_start_token_id=VOCAB - 3)
        model = model_class(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn_like(tensor))
    return model.eval()


@pytest.mark.parametrize("kind, text_class", [("qwen2_vl", "Qwen2ForCausalLM"), ("qwen2_5_vl", "Qwen2ForCausalLM"),
                                              ("qwen3_vl", "Qwen3ForCausalLM")])
def test_the_language_model_has_the_whole_models_logits_on_text(kind, text_class, tmp_path):
    whole = whole_model(kind)
    whole.save_pretrained(tmp_path / "hf")
    assert any(name.startswith("model.visual.") for name in whole.state_dict())
    model = load_model(hf_to_meshlm(tmp_path / "hf", tmp_path / "meshlm")[0])
    ids = torch.randint(0, VOCAB - 4, (2, 24), generator=torch.Generator().manual_seed(1))  # text tokens only
    assert_same_logits(whole, model, ids)
    assert model.config.rope_theta == 5000.0 and model.config.qk_norm == (kind == "qwen3_vl")
    _, chosen = meshlm_to_hf(tmp_path / "meshlm", tmp_path / "text")
    assert chosen.name == text_class
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "text")(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_the_released_layout_with_its_fields_at_the_top_reads_alike(tmp_path):
    """Qwen2.5-VL as released: the language model's fields at the top of config.json, RoPE as
    ``{"type": "mrope", "mrope_section": [...]}``, the tensors under ``model.*`` and ``visual.*``."""
    whole = whole_model("qwen2_5_vl")
    whole.save_pretrained(tmp_path / "hf")
    nested = json.loads((tmp_path / "hf" / "config.json").read_text())
    flat = {**{key: value for key, value in nested.items() if key != "text_config"}, **nested["text_config"],
            "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}, "rope_theta": 5000.0}
    flat.pop("rope_parameters", None)
    config = qwen_vl.QWEN2_5_VL.config_from_hf(flat)
    assert config == qwen_vl.QWEN2_5_VL.config_from_hf(nested)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    released = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): tensor
                for name, tensor in tensors.items()}
    assert any(name.startswith("visual.") for name in released)
    (tmp_path / "released").mkdir()
    save_file(released, tmp_path / "released" / "model.safetensors")
    (tmp_path / "released" / "config.json").write_text(json.dumps(flat))
    model = load_model(hf_to_meshlm(tmp_path / "released", tmp_path / "meshlm")[0])
    ids = torch.randint(0, VOCAB - 4, (2, 24), generator=torch.Generator().manual_seed(2))
    assert_same_logits(whole, model, ids)


def test_export_as_the_vision_class_is_refused_and_a_bad_text_config_named():
    from meshlm.hf import choose_architecture

    config = qwen_vl.QWEN3_VL.config_from_hf({"text_config": {**TEXT, "head_dim": 8}})
    with pytest.raises(ConfigError, match="holds only the language model of a Qwen3VLForConditionalGeneration folder; "
                                          "export it as Qwen3ForCausalLM"):
        qwen_vl.QWEN3_VL.config_to_hf(config)
    assert choose_architecture(config).name == "Qwen3ForCausalLM"
    with pytest.raises(ConfigError, match="text_config is not an object"):
        qwen_vl.QWEN2_VL.config_from_hf({"text_config": 3})
