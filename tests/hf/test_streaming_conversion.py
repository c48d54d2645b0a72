"""``meshlm convert hf-to-meshlm`` streams: it converts a model larger than the memory it may use.

* A Mixtral-style checkpoint built for the purpose (about 430 MiB of fp32 in three shards with a
  ``model.safetensors.index.json``; the largest meshlm tensor, 8 stacked experts, is 64 MiB)
  converts in a process whose data size is capped 256 MiB above its baseline
  (``tests/helpers/capped_process.py`` explains the cap), its sampled peak within the largest
  output tensor plus the largest input tensor plus allocator slack; building the same model in
  memory, as the conversion did before it streamed, fails under the same cap -- so the test can
  fail. The
  output equals, tensor for tensor, the HF tensors mapped by the adapter's ``TensorMap`` list,
  both read back independently with safetensors' own ``safe_open``. Converted back
  (``meshlm-to-hf``) under the same cap, it gives the original HF tensors again.
* A small Qwen3-MoE checkpoint whose experts are stored fused (``experts.gate_up_proj`` [E, 2F, d],
  read expert by expert through ``StoredTensor`` handles) converts, by streaming, to exactly the
  tensors the in-memory conversion of the same tensors gives.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshlm.checkpoint.model_files import expected_shapes
from meshlm.hf import hf_to_meshlm, mixtral, qwen3_moe
from tests.helpers.capped_process import run_capped

MIB = 2**20
HEADROOM_MIB = 256
BIG_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 2048,
               "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 8,
               "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
               "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def hf_tensor_shapes(architecture, hf_config: dict) -> dict[str, tuple]:
    """{HF name: shape} of every tensor an HF checkpoint of ``hf_config`` holds (from the adapter's maps)."""
    config = architecture.config_from_hf(hf_config)
    shapes = expected_shapes(config)
    return {name: tuple(shapes[entry.ours][1:] if entry.stacked else shapes[entry.ours])
            for entry in architecture.tensor_maps(config) for name in entry.theirs}


def hf_value(name: str, shape: tuple) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def write_sharded_hf_model(directory: Path, hf_config: dict, shapes: dict[str, tuple], shard_bytes: int) -> int:
    """config.json + shards of about ``shard_bytes`` + the index, one shard in memory at a time; returns
    the total bytes of tensor data."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    groups, current, size, total = [], [], 0, 0
    for name, shape in shapes.items():
        current.append(name)
        size += torch.Size(shape).numel() * 4
        total += torch.Size(shape).numel() * 4
        if size >= shard_bytes:
            groups.append(current)
            current, size = [], 0
    groups += [current] if current else []
    weight_map = {}
    for index, names in enumerate(groups):
        file_name = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: hf_value(name, shapes[name]) for name in names}, directory / file_name,
                  metadata={"format": "pt"})
        weight_map.update({name: file_name for name in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


def test_a_model_larger_than_the_memory_cap_converts(tmp_path):
    shapes = hf_tensor_shapes(mixtral.ARCHITECTURE, BIG_MIXTRAL)
    total = write_sharded_hf_model(tmp_path / "hf", BIG_MIXTRAL, shapes, shard_bytes=150 * MIB)
    assert total > 1.5 * HEADROOM_MIB * MIB  # loading it once already exceeds the cap
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) == 3

    streamed = run_capped("hf-to-meshlm", HEADROOM_MIB, tmp_path / "hf", tmp_path / "out")
    figures = f"model {total / MIB:.0f} MiB, streamed conversion {streamed}"
    assert streamed["ok"], figures
    largest_output, largest_input = 8 * 2048 * 1024 * 4, 2048 * 1024 * 4  # 8 stacked experts; one expert
    assert streamed["data_peak"] <= largest_output + largest_input + 64 * MIB, figures  # allocator slack
    in_memory = run_capped("hf-in-memory", HEADROOM_MIB, tmp_path / "hf")
    assert not in_memory["ok"] and "allocate" in in_memory["error"], (figures, in_memory)
    print(f"\n{figures}\nin memory under the same cap: {in_memory}")

    config = mixtral.config_from_hf(BIG_MIXTRAL)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as out:
        assert out.metadata() == {"format": "meshlm"}
        assert sorted(out.keys()) == sorted(expected_shapes(config))
        for entry in mixtral.tensor_maps(config):
            def hf(name):
                with safe_open(str(tmp_path / "hf" / index[name]), "pt") as file:
                    return file.get_tensor(name)
            if not entry.theirs:
                expected = torch.zeros(expected_shapes(config)[entry.ours])
            else:
                expected = torch.stack([hf(name) for name in entry.theirs]) if entry.stacked else hf(entry.theirs[0])
            assert torch.equal(out.get_tensor(entry.ours), expected), entry.ours

    back = run_capped("meshlm-to-hf", HEADROOM_MIB, tmp_path / "out", tmp_path / "hf_again")
    assert back["ok"] and back["data_peak"] <= largest_output + largest_input + 64 * MIB, back
    print(f"back to HF under the same cap: {back}")
    with safe_open(str(tmp_path / "hf_again" / "model.safetensors"), "pt") as again:
        assert sorted(again.keys()) == sorted(index)
        for name in again.keys():
            with safe_open(str(tmp_path / "hf" / index[name]), "pt") as original:
                assert torch.equal(again.get_tensor(name), original.get_tensor(name)), name


def test_fused_experts_stream_to_the_in_memory_conversion(tmp_path):
    hf_config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
                 "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 8, "num_experts": 3, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 8, "mlp_only_layers": [1], "tie_word_embeddings": True}
    shapes = hf_tensor_shapes(qwen3_moe.ARCHITECTURE, hf_config)
    tensors = {name: hf_value(name, shape) for name, shape in shapes.items()}
    prefix = "model.layers.0.mlp.experts."
    gate_up = torch.stack([torch.cat((tensors.pop(f"{prefix}{e}.gate_proj.weight"),
                                      tensors.pop(f"{prefix}{e}.up_proj.weight"))) for e in range(3)])
    tensors[f"{prefix}gate_up_proj"] = gate_up
    tensors[f"{prefix}down_proj"] = torch.stack([tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(3)])
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config))
    save_file(tensors, tmp_path / "hf" / "model.safetensors")

    hf_to_meshlm(tmp_path / "hf", tmp_path / "out")
    reference = qwen3_moe.state_from_hf(tensors, qwen3_moe.config_from_hf(hf_config))  # in memory
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as out:
        assert sorted(out.keys()) == sorted(reference)
        for name, value in reference.items():
            assert torch.equal(out.get_tensor(name), value), name
