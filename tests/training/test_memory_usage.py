"""meshlm/training/memory_usage.py: the process's peak memory, as the progress line and metrics.jsonl report it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshlm.training.memory_usage import format_bytes, peak_memory

MIB = 2 ** 20
REPO_ROOT = Path(__file__).resolve().parents[2]


PEAK_GROWTH = """
import torch
from meshlm.training.memory_usage import peak_memory, reset_peak_resident, resident_bytes
reset_peak_resident()
before = peak_memory(torch.device("cpu"))["memory_peak_bytes"]
print(before - resident_bytes("VmRSS"))
block = torch.ones(64 * 2 ** 20)  # fp32: 256 MiB, every page written
print(peak_memory(torch.device("cpu"))["memory_peak_bytes"] - before)
del block
print(peak_memory(torch.device("cpu"))["memory_peak_bytes"] - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's (/proc/self/status)")
def test_the_cpu_peak_is_the_resident_high_water_mark():
    """256 MiB allocated and written after the mark was reset raise the peak by about that much;
    freeing them does not lower it (a peak, not the current size). In a process of its own: this
    one may hold freed memory the allocation would reuse (train.keep_freed_cpu_memory)."""
    lines = subprocess.run([sys.executable, "-c", PEAK_GROWTH], capture_output=True, text=True, check=True,
                           cwd=REPO_ROOT).stdout.split()
    above_resident, grown, after_free = (int(line) for line in lines)
    assert above_resident < 16 * MIB  # the reset brought the mark down to the resident size
    assert 240 * MIB < grown < 300 * MIB, grown / MIB
    assert after_free == pytest.approx(grown, abs=16 * MIB)


def test_memory_of_a_device_with_no_reading_is_left_out():
    assert peak_memory(torch.device("meta")) == {}
    assert [format_bytes(size) for size in (512, 1536, 320 * MIB, 1.5 * 2 ** 30)] == [
        "512 bytes", "1.5 KiB", "320 MiB", "1.5 GiB"]
