"""``meshlm checkpoint consolidate`` streams: a checkpoint larger than the memory cap consolidates.

A distributed checkpoint built for the purpose -- about 430 MiB of fp32 weights of an MoE model
(the largest tensor, 8 stacked experts, is 64 MiB), each tensor stored as two row blocks as a tp2
run writes them, with ``.metadata`` and a completion marker as ``Checkpointer`` writes them --
consolidates in a process whose data size is capped 256 MiB above its baseline
(``tests/helpers/capped_process.py``), its sampled peak within one whole tensor plus the DCP
reader's copies of one stored chunk plus allocator slack; reading every model tensor whole at
once, as consolidation did before, fails under the same cap. The single file equals the values
written, tensor for tensor.
"""

from __future__ import annotations

import json
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter

from meshlm.checkpoint.files import file_checksum
from meshlm.checkpoint.global_state import GlobalTensor
from meshlm.checkpoint.model_files import expected_shapes
from meshlm.checkpoint.planners import ChunkSavePlanner
from meshlm.models.config import ModelConfig
from tests.helpers.capped_process import run_capped

MIB = 2**20
HEADROOM_MIB = 256
MOE = ModelConfig(vocab_size=2048, hidden_size=1024, pattern="*E*E", num_attention_heads=8, moe_num_experts=8,
                  moe_top_k=2, moe_ffn_hidden_size=2048)


def value(name: str, shape) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def write_checkpoint(directory: Path, config: ModelConfig) -> int:
    """A complete distributed checkpoint holding ``model/NAME`` for every tensor, in two row blocks each."""
    tensors = {}
    for name, shape in expected_shapes(config).items():
        whole = value(name, shape)
        rows = (shape[0] + 1) // 2
        chunks = [((0,) * len(shape), whole[:rows])]
        if len(shape) and rows < shape[0]:
            chunks.append(((rows,) + (0,) * (len(shape) - 1), whole[rows:]))
        tensors[f"model/{name}"] = GlobalTensor(tuple(shape), whole.dtype, chunks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({}, storage_writer=FileSystemWriter(directory), planner=ChunkSavePlanner(tensors), no_dist=True)
    (directory / "config.json").write_text(json.dumps({"format": "meshlm", "version": 1, "model": config.to_dict()}))
    files = {path.name: file_checksum(path) for path in directory.iterdir()}
    (directory / "complete.json").write_text(json.dumps({"step": 1, "files": files}))
    return sum(tensor.chunks[0][1].numel() * 4 * (1 + (len(tensor.chunks) > 1)) for tensor in tensors.values())


def test_a_checkpoint_larger_than_the_memory_cap_consolidates(tmp_path):
    total = write_checkpoint(tmp_path / "step_1", MOE)
    assert total > 1.5 * HEADROOM_MIB * MIB

    streamed = run_capped("consolidate", HEADROOM_MIB, tmp_path / "step_1", tmp_path / "model")
    figures = f"checkpoint {total / MIB:.0f} MiB, streamed consolidation {streamed}"
    assert streamed["ok"], figures
    largest = 8 * 2048 * 1024 * 4
    assert streamed["data_peak"] <= largest + 2 * (largest // 2) + 64 * MIB, figures  # tensor, chunk bytes + copy
    in_memory = run_capped("dcp-in-memory", HEADROOM_MIB, tmp_path / "step_1")
    assert not in_memory["ok"] and "allocate" in in_memory["error"], (figures, in_memory)
    print(f"\n{figures}\nall tensors at once under the same cap: {in_memory}")

    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as out:
        assert sorted(out.keys()) == sorted(expected_shapes(MOE))
        for name, shape in expected_shapes(MOE).items():
            assert torch.equal(out.get_tensor(name), value(name, shape)), name
