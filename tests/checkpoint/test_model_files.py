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


def test_loading_holds_the_model_plus_one_tensor(tmp_path):
    """``load_model`` (what ``meshlm generate`` and ``meshlm convert meshlm-to-hf`` load with) builds
    on meta and reads tensor by tensor: torch's peak is the model plus the one tensor being read.
    Reading the whole file first and then building the model -- as it did before -- exceeds that."""
    from safetensors.torch import load_file

    from tests.helpers.memory import peak_allocated_bytes

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, hidden_size=128, pattern="*-*-*-*-", num_attention_heads=4,
                         ffn_hidden_size=512)
    save_model(LanguageModel(config), tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    model_bytes = sum(value.numel() * value.element_size() for value in tensors.values())
    largest = max(value.numel() * value.element_size() for value in tensors.values())
    del tensors
    bound = model_bytes + largest + 64 * 1024
    peak = peak_allocated_bytes(lambda: load_model(tmp_path / "m"))
    assert peak <= bound, (peak, model_bytes, largest)

    def whole_then_model():
        state = load_file(str(tmp_path / "m" / "model.safetensors"))
        model = LanguageModel(config)
        model.load_state_dict(state)
        return model

    assert peak_allocated_bytes(whole_then_model) > bound  # the measurement sees a whole copy
