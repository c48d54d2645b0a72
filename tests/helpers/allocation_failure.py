"""The CPU allocator's own refusal of a request no host backs, for the out-of-memory tests.

The error is made in a process of its own and its message raised in the test's: after one failed
``malloc`` of that size, glibc serves every later large block of the process with ``mmap``, even
under ``M_MMAP_MAX = 0`` (meshlm/training/cpu_allocator.py), which would change how the rest of a
pytest process allocates (tests/training/test_cpu_allocator.py fails after it).
"""

from __future__ import annotations

import functools
import subprocess
import sys

IMPOSSIBLE_BYTES = 2 ** 50
"""1 PiB: the allocator refuses it at once, whatever the overcommit policy."""

SCRIPT = f"""
import torch
try:
    torch.empty({IMPOSSIBLE_BYTES}, dtype=torch.uint8)
except RuntimeError as error:
    print(error)
"""


@functools.cache
def cpu_allocator_refusal() -> str:
    """The message of the ``RuntimeError`` torch's CPU allocator raised for ``IMPOSSIBLE_BYTES``."""
    message = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.strip()
    assert "can't allocate memory" in message, message
    return message
