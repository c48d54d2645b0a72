"""The CUDA test tier: everything under tests/gpu gets the ``gpu`` marker and needs a GPU.

    make test-gpu                        # on a machine with CUDA: pytest -m gpu tests/gpu -x -q

meshlm's ordinary suite runs on CPU; these tests run the same code on CUDA tensors, where
device-placement bugs, dtype defaults (bf16, TF32) and the fused kernels (FlashAttention through
SDPA, grouped GEMM, the Triton SSD kernels) only show up there. Each test compares a CUDA result
with the PyTorch reference computed the way the CPU suite already trusts.

Where ``torch.cuda.is_available()`` is false every test here is skipped *at collection*, with
the reason -- no fixture runs, no model is built -- so ``pytest tests`` on a CPU machine stays
green and fast.

**Dry run on CPU** (``MESHLM_GPU_TESTS_ON_CPU=1``): the ``gpu_device`` fixture is then
``torch.device("cpu")`` and the tier runs on the CPU, so its logic (configs, comparisons,
tolerances, spawned layouts) can be checked on a machine without a GPU. It proves nothing about
CUDA: a dry run only says the tests themselves are sound. Tests that need CUDA itself (NCCL, the
CUDA flash and memory-efficient kernels, compiled Triton, the TF32 switch) still skip, each with
its own reason (``tests/gpu/devices.py``: ``require_cuda``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.devices import cpu_dry_run, tier_device

HERE = Path(__file__).parent
ORDER = ("test_fused_paths.py", "test_fp8_hardware.py", "test_model_kinds.py", "test_compiled_blocks.py", "test_nccl.py",
         "test_gloo_on_cuda.py", "test_layouts.py")
"""The files in the order they run: one process before many, each collective alone before the
layouts that combine them, so that under ``-x`` the first failure is the most basic one."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark every test of this folder ``gpu`` and put them in ``ORDER``; skip them all where there
    is no GPU (unless dry-running)."""
    skip = None
    if not torch.cuda.is_available() and not cpu_dry_run():
        skip = pytest.mark.skip(reason="CUDA is not available: the GPU tier (tests/gpu, `make test-gpu`) needs a "
                                       "GPU; set MESHLM_GPU_TESTS_ON_CPU=1 to dry-run its logic on the CPU.")
    positions = [index for index, item in enumerate(items) if HERE in item.path.parents]
    rank = {name: number for number, name in enumerate(ORDER)}
    ordered = sorted((items[index] for index in positions), key=lambda item: rank.get(item.path.name, len(ORDER)))
    for index, item in zip(positions, ordered):
        items[index] = item
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_device() -> torch.device:
    """``cuda:0``; the CPU in a dry run (``MESHLM_GPU_TESTS_ON_CPU=1``, see the module docstring)."""
    return tier_device()


@pytest.fixture
def exact_fp32_cuda():
    """fp32 products on CUDA (no TF32 in matmuls or cuDNN convolutions) while a test runs: the tier's
    trainer runs may have left TF32 on, and the Triton SSD kernels follow the same switch."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
