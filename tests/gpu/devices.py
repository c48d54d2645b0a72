"""Where the GPU tier runs: on ``cuda:0``, or on the CPU in a dry run; and the skip of what needs CUDA itself.

Kept apart from ``support.py`` (which loads the trainer-run helpers) so that ``conftest.py``
decides the tier's skip without importing anything heavy at collection.
"""

from __future__ import annotations

import os

import pytest
import torch

DRY_RUN_VARIABLE = "MESHLM_GPU_TESTS_ON_CPU"


def cpu_dry_run() -> bool:
    """Whether the tier runs on the CPU to check its own logic (``MESHLM_GPU_TESTS_ON_CPU=1``)."""
    return os.environ.get(DRY_RUN_VARIABLE) == "1"


def tier_device() -> torch.device:
    """``cuda:0``, or the CPU in a dry run."""
    return torch.device("cpu") if cpu_dry_run() else torch.device("cuda", 0)


def require_cuda(device: torch.device, what: str) -> None:
    """Skip the calling test unless ``device`` is CUDA: ``what`` (say, "NCCL") exists only there."""
    if device.type != "cuda":
        pytest.skip(f"{what} needs CUDA; a CPU dry run ({DRY_RUN_VARIABLE}=1) cannot check it.")


__all__ = ["DRY_RUN_VARIABLE", "cpu_dry_run", "require_cuda", "tier_device"]
