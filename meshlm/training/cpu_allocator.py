"""Keep freed CPU memory in the process: glibc ``malloc`` settings for training on CPU.

A training step allocates and frees the same large tensors (activations, gradients, logits
chunks) again and again. By default glibc serves every allocation above a threshold (128 KiB,
raised dynamically up to 32 MiB) with a fresh ``mmap`` and returns it to the kernel on ``free``,
and trims the top of the heap when more than 128 KiB is free there. Either way the next step's
tensor lands on pages the kernel must fault in and zero again -- for a 25M-parameter model on 2
cores that was several percent of the step (measured in ``bench/train_throughput.py``: fp32 MFU
0.77-0.78 by default, 0.84 with these settings, for meshlm and the plain-PyTorch reference loop
alike).

``keep_freed_memory()`` asks glibc (``mallopt``) to serve large blocks from the heap too
(``M_MMAP_MAX = 0``) and never to trim it (``M_TRIM_THRESHOLD`` = the largest value), so freed
blocks are reused by the next step, like the caching allocator PyTorch uses on GPUs. The price:
the process keeps its peak heap until it exits -- which a training process reaches in its first
steps anyway. It is a process-wide setting, applied by the trainer on CPU runs
(``train.keep_freed_cpu_memory``, default true); on other C libraries it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""``mallopt`` parameter numbers from glibc's <malloc.h>."""


def keep_freed_memory() -> bool:
    """Apply the settings; True when glibc accepted them (False elsewhere: macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    largest = 2**31 - 1
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, largest))


__all__ = ["keep_freed_memory"]
