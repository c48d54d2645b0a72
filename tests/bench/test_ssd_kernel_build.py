"""bench/ssd_kernel_build.py: the Triton SSD kernels compile for Hopper (sm_90a) on this CPU, and
the autotuner has a choice that does not spill registers for each of them.

The interpreter (tests/kernels) checks what the kernels compute; this checks what only a GPU
build shows -- that Triton lowers them for the hardware, and how many registers they take. It
runs the bench in a subprocess without ``TRITON_INTERPRET`` (which tests/conftest.py sets)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from bench.ssd_kernel_build import ptxas_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def build_report(tmp_path, *arguments) -> dict:
    if not os.path.exists(ptxas_path()):
        pytest.skip("Triton's NVIDIA backend has no ptxas here")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = subprocess.run([sys.executable, "-m", "bench.ssd_kernel_build", *arguments], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_every_kernel_builds_for_hopper_and_each_has_a_choice_without_spills(tmp_path):
    report = build_report(tmp_path)  # the 1B hybrid's shape: chunk 128, head dim 64, state 128, bf16
    kernels = report["kernels"]
    assert report["arch"] == "sm_90a"
    assert all(0 < result["registers"] <= 255 for result in kernels.values()), kernels
    for kernel in ("forward", "backward_sources", "backward_targets"):
        choices = {name: result for name, result in kernels.items() if name.startswith(kernel + " ")}
        assert len(choices) == 4, choices  # 2 tiles x 2 warp counts
        assert any(result["spill_bytes"] == 0 for result in choices.values()), choices
    assert kernels["entering_states warps 8"]["spill_bytes"] == 0
    assert kernels["entering_states_backward warps 8"]["spill_bytes"] == 0


def test_interpreter_mode_is_refused_in_one_sentence():
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.ssd_kernel_build"], cwd=REPO, env=environment,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "TRITON_INTERPRET=1 is set: the interpreter's kernels cannot be compiled; unset it." in done.stderr


def test_a_triton_without_ptxas_is_refused_in_one_sentence(monkeypatch, capsys):
    import bench.ssd_kernel_build as kernel_build

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernel_build, "ptxas_path", lambda: "/nonexistent/triton/backends/nvidia/bin/ptxas")
    with pytest.raises(SystemExit) as stopped:
        kernel_build.main([])
    assert stopped.value.code == 2
    assert "needs Triton with its NVIDIA backend's ptxas (pip install triton)." in capsys.readouterr().err
