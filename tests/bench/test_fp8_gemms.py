"""bench/fp8_gemms.py on this CPU's tensorwise torch._scaled_mm: the record's shapes and sums.

The speeds mean nothing on a CPU (no FP8 units); the GPU session runs the real thing. Here the
GEMM shapes of every linear layer, the per-layer totals and the ratios derived from them are held
to what the module docstring says.
"""

import json

import pytest
import torch

from bench.fp8_gemms import gemm_shape, layer_linears, main
from meshlm.precision.fp8_gemm import hardware_fp8_supported


def test_each_gemm_contracts_over_the_right_dimension():
    assert gemm_shape("forward", 8192, 2048, 8192) == (8192, 8192, 2048)  # X W^T: over the input features
    assert gemm_shape("dgrad", 8192, 2048, 8192) == (8192, 2048, 8192)  # dY W: over the output features
    assert gemm_shape("wgrad", 8192, 2048, 8192) == (8192, 2048, 8192)  # dY^T X: over the tokens
    assert layer_linears(2048, 8192)["down"] == (8192, 2048)


@pytest.mark.skipif(not hardware_fp8_supported("cpu", "tensorwise", out_dtype=torch.bfloat16),
                    reason=f"torch {torch.__version__} runs no tensorwise torch._scaled_mm on this CPU")
def test_the_record_adds_up(tmp_path, capsys):
    out = tmp_path / "fp8_gemms.json"
    main(["--device", "cpu", "--tokens", "32", "--hidden", "32", "--ffn", "64", "--calls", "1", "--repeats", "1",
          "--out", str(out)])
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert len(record["gemms"]) == 6 * 3 and len(record["quantize"]) == 6 * 3 - 2  # k, v: q's cast input
    assert "k.x" not in record["quantize"] and "q.x" in record["quantize"]
    assert record["gemms"]["up.wgrad"]["m_n_k"] == [64, 32, 32]
    pair = record["layer_pair"]
    bf16 = sum(entry["bf16_ms"] for entry in record["gemms"].values())
    fp8 = sum(entry["fp8_fast_ms" if name.endswith("forward") else "fp8_split_ms"]
              for name, entry in record["gemms"].items())
    quantize = sum(entry["ms"] for entry in record["quantize"].values())
    assert pair["bf16_ms"] == pytest.approx(bf16, abs=2e-3) and pair["fp8_ms"] == pytest.approx(fp8, abs=2e-3)
    assert pair["quantize_ms"] == pytest.approx(quantize, abs=2e-3)
    assert pair["gemm_speedup"] == pytest.approx(pair["bf16_ms"] / (pair["fp8_ms"] + pair["quantize_ms"]), rel=1e-2)
