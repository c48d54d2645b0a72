import json

import pytest
import torch

from meshlm.checkpoint.model_files import load_model, save_model
from meshlm.errors import CheckpointError
from meshlm.models.config import ModelConfig
from meshlm.models.language_model import LanguageModel


@pytest.fixture
def model():
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=64, hidden_size=32, pattern="*-", num_attention_heads=4))


def test_save_and_load_reproduce_the_model(tmp_path, model):
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    tokens = torch.randint(0, 64, (2, 6))
    torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=0, atol=0)
    assert not list((tmp_path / "m").glob("*.tmp"))


def test_missing_directory_and_hf_config_are_explained(tmp_path, model):
    with pytest.raises(CheckpointError, match="no such model directory"):
        load_model(tmp_path / "nope")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="hf-to-meshlm"):
        load_model(tmp_path / "hf")


def test_truncated_weights_name_the_file(tmp_path, model):
    save_model(model, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path / "m")


def test_shape_mismatch_lists_the_tensors(tmp_path, model):
    save_model(model, tmp_path / "m")
    config_path = tmp_path / "m" / "config.json"
    payload = json.loads(config_path.read_text())
    payload["model"]["vocab_size"] = 80
    config_path.write_text(json.dumps(payload))
    with pytest.raises(CheckpointError, match=r"embedding.weight: file \(64, 32\) vs model \(80, 32\)"):
        load_model(tmp_path / "m")
