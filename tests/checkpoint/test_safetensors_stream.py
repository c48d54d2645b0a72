"""safetensors written one tensor at a time and read by slice (meshlm/checkpoint/safetensors_stream.py).

safetensors' own reader reads back, bit for bit and with the metadata, what ``write_safetensors``
wrote from a plan (every dtype meshlm stores, 0-dim and empty tensors); a plan whose tensor comes
out with another shape is refused and leaves no file behind; ``SafetensorsReader`` reads boxes
(into a strided view or a tensor of another dtype, too) and refuses a truncated file by name; ``StoredTensor`` handles narrow like tensors.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshlm.checkpoint.safetensors_stream import (PlannedTensor, SafetensorsFiles, SafetensorsReader,
                                                  write_safetensors)
from meshlm.errors import CheckpointError

TENSORS = {"bf16": torch.randn(3, 5).bfloat16(), "fp32": torch.randn(2, 3, 4), "fp16": torch.randn(7).half(),
           "scalar": torch.tensor(3.5), "int64": torch.arange(5), "empty": torch.empty(0, 4),
           "bool": torch.tensor([True, False, True]), "int8": torch.tensor([-3, 4], dtype=torch.int8)}


def test_safe_open_reads_back_a_streamed_file(tmp_path):
    produced = []

    def producer(name):
        produced.append(name)
        return TENSORS[name].clone()

    plan = {name: PlannedTensor(tuple(value.shape), value.dtype, lambda name=name: producer(name))
            for name, value in TENSORS.items()}
    write_safetensors(tmp_path / "m.safetensors", plan, metadata={"format": "meshlm"})
    assert produced == list(TENSORS)  # one at a time, in order
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as file:
        assert file.metadata() == {"format": "meshlm"} and sorted(file.keys()) == sorted(TENSORS)
        for name, value in TENSORS.items():
            read = file.get_tensor(name)
            assert read.dtype == value.dtype and torch.equal(read, value), name
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_tensor_unlike_its_plan_is_refused_and_leaves_no_file(tmp_path):
    plan = {"a": torch.ones(2), "b": PlannedTensor((3,), torch.float32, lambda: torch.ones(4))}
    with pytest.raises(RuntimeError, match=r"b: produced torch.float32 \(4,\), but the plan said"):
        write_safetensors(tmp_path / "m.safetensors", plan)
    assert not list(tmp_path.iterdir())


def test_reader_reads_boxes_and_names_a_truncated_file(tmp_path):
    save_file(TENSORS, tmp_path / "m.safetensors")
    reader = SafetensorsReader(tmp_path / "m.safetensors")
    assert torch.equal(reader.read("fp32", (slice(0, 2), slice(1, 3), slice(2, 4))), TENSORS["fp32"][:, 1:3, 2:])
    assert torch.equal(reader.read("bf16", (1,)), TENSORS["bf16"][1])
    assert torch.equal(reader.read("scalar"), TENSORS["scalar"])
    strided = torch.zeros(4, 3).t()  # a column-split shard's view: read straight into it
    assert reader.read("fp32", (0,), out=strided) is strided and torch.equal(strided, TENSORS["fp32"][0])
    as_fp32 = torch.zeros(3, 5)  # another dtype: read, then cast into place
    assert torch.equal(reader.read("bf16", out=as_fp32), TENSORS["bf16"].float())
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="cut.safetensors: unreadable or truncated"):
        SafetensorsReader(tmp_path / "cut.safetensors")


def test_stored_tensors_narrow_like_tensors(tmp_path):
    value = torch.arange(2 * 6 * 3.0).view(2, 6, 3)
    save_file({"fused": value}, tmp_path / "m.safetensors")
    with SafetensorsFiles([tmp_path / "m.safetensors"]) as files:
        fused = files.tensors["fused"]
        gate, up = fused[1].split([2, 4], dim=0)
        assert tuple(up.shape) == (4, 3) and torch.equal(up.load(), value[1, 2:])
        assert torch.equal(fused.split([1, 1])[1][0].load(), value[1])
        assert torch.equal(up.split([1, 3])[1][2].load(), value[1, 2:][1:][2])
        with pytest.raises(IndexError):
            fused[2]
        gates, ups = fused.split([2, 4], dim=1)  # stacked experts' fused gate/up halves
        assert tuple(ups.shape) == (2, 4, 3) and torch.equal(ups.load(), value[:, 2:])
        assert torch.equal(fused[0].split([1, 2], dim=1)[1].load(), value[0, :, 1:])
        with pytest.raises(ValueError, match="read whole, not narrowed"):
            gates[0]
        with pytest.raises(ValueError, match="cannot split"):
            up.split([1, 3])[1].split([1, 1, 1], dim=1)
