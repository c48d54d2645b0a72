"""Optional fast paths (Triton kernels on CUDA) behind the models' interfaces, each tested against
the PyTorch path it replaces (on CPU with Triton's interpreter, ``TRITON_INTERPRET=1``).

    ssd_diagonal.py   the SSD scan's diagonal blocks, forward and backward (imports Triton)

This file imports nothing optional: it says whether Triton is installed, and holds what the
kernels and the PyTorch paths they replace must agree on.
"""

import importlib.util

import torch

SSD_MIN_LOG_DECAY = -80.0
"""Log-decays inside an SSD chunk are clamped here, by the PyTorch scan (meshlm/models/ssd_fast.py)
and the kernels alike: e^-80 is still a normal fp32, and exp() is several times slower on results
that underflow."""


@torch.compiler.assume_constant_result
def triton_installed() -> bool:
    """Whether Triton can be imported (checked without importing it).

    Asked inside compiled blocks too (the Mamba scan picks its kernels per call): marked constant,
    TorchDynamo calls it once while tracing instead of tracing ``importlib``, which it refuses
    (torch 2.11 breaks the graph there)."""
    return importlib.util.find_spec("triton") is not None
