import json

import pytest
import torch
from safetensors.torch import save_file

from meshlm.errors import CheckpointError
from meshlm.hf.files import open_hf_tensors, read_hf_config, write_hf_folder


def test_sharded_checkpoints_are_read_through_their_index(tmp_path):
    first, second = {"a": torch.ones(2)}, {"b": torch.zeros(3)}
    save_file(first, tmp_path / "model-00001-of-00002.safetensors")
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with open_hf_tensors(tmp_path) as files:
        assert sorted(files.tensors) == ["a", "b"] and torch.equal(files.tensors["b"].load(), torch.zeros(3))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: missing"):
        open_hf_tensors(tmp_path)


def test_pickled_weights_and_meshlm_folders_are_explained(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="re-save the model with safetensors"):
        open_hf_tensors(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "meshlm", "model": {}}))
    with pytest.raises(CheckpointError, match="already a meshlm model"):
        read_hf_config(tmp_path)


def test_overwrite_replaces_a_stale_shard_index(tmp_path):
    save_file({"a": torch.ones(1)}, tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(CheckpointError, match="not empty"):
        write_hf_folder(tmp_path, {"time_step_limit": [0.0, float("inf")]}, {"x": torch.ones(2)})
    write_hf_folder(tmp_path, {"time_step_limit": [0.0, float("inf")]}, {"x": torch.ones(2)}, overwrite=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    with open_hf_tensors(tmp_path) as files:
        assert torch.equal(files.tensors["x"].load(), torch.ones(2))
