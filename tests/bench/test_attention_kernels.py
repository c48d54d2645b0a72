"""bench/attention_kernels.py: the FLOP count, the record on a CPU (the CUDA-only kernels report
their error instead of timing another kernel), the process's SDPA order given back, bad flags."""

from __future__ import annotations

import json

import pytest
import torch

from bench import attention_kernels as bench


def test_flops_are_counted_as_flashattention_counts_them():
    # forward 4 b h s^2 d, halved when causal; backward 2.5x the forward
    assert bench.attention_flops(2, 3, 16, 8, causal=False) == 4 * 2 * 3 * 16 * 16 * 8 * 3.5
    assert bench.attention_flops(2, 3, 16, 8) == bench.attention_flops(2, 3, 16, 8, causal=False) / 2


def test_a_cpu_record_times_what_runs_and_names_what_cannot(capsys):
    before = torch._C._get_sdp_priority_order()
    assert bench.main(["--device", "cpu", "--batch", "1", "--heads", "4", "--kv-heads", "2", "--seq", "32",
                       "--head-dim", "8", "--warmup", "1", "--repeats", "2"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["shape"] == {"batch": 1, "heads": 4, "kv_heads": 2, "seq": 32, "head_dim": 8, "dtype": "float32",
                               "causal": True}
    kernels = record["kernels"]
    assert kernels["flash"]["ms"] > 0 and kernels["auto"]["ms"] > 0  # the CPU's flash kernel
    for name in ("cudnn", "efficient"):  # CUDA only: an error, not another kernel's time
        assert set(kernels[name]) == {"error"} and "No viable backend" in kernels[name]["error"]
    assert kernels["auto"]["ran"] == ["_scaled_dot_product_flash_attention_for_cpu",
                                      "_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert record["fastest"] == "flash"
    assert torch._C._get_sdp_priority_order() == before


@pytest.mark.parametrize("argv, message", [(["--seq", "0"], "--seq=0 must be at least 1"),
                                           (["--heads", "6", "--kv-heads", "4"], "--heads=6 must be a multiple of")])
def test_bad_flags_are_refused_with_one_sentence(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
